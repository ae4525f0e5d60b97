"""Trains a SentencePiece tokenizer on the documents of ArrayRecord files (as MaxText's train_tokenizer.py).

    python3 MaxText/train_tokenizer.py --grain_train_files '~/maxtext_data/demo/array_record/train/*' \
      --vocab_size 8000 --output ~/maxtext_data/demo/tokenizer.model

Reads documents in file order until --max_corpus_chars characters, trains a unigram model with byte
fallback (no unknown tokens) and ids pad=0, eos=1, bos=2, unk=3, and writes it atomically to --output.
"""

import argparse
import glob
import io
import os
import sys
import time


def documents(pattern: str, max_chars: int):
  """Texts of the records of the files matching `pattern`, until max_chars characters in all."""
  from array_record.python.array_record_module import ArrayRecordReader

  total = 0
  for path in sorted(glob.glob(os.path.expanduser(pattern))):
    reader = ArrayRecordReader(path)
    try:
      for i in range(reader.num_records()):
        text = reader.read([i])[0].decode("utf-8")
        yield text[: max_chars - total]
        total += len(text)
        if total >= max_chars:
          return
    finally:
      reader.close()


def train(texts, vocab_size: int, output: str) -> None:
  import sentencepiece as spm

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=(line for text in texts for line in text.splitlines() if line.strip()),
    model_writer=model,
    vocab_size=vocab_size,
    model_type="unigram",
    character_coverage=1.0,
    byte_fallback=True,
    pad_id=0,
    eos_id=1,
    bos_id=2,
    unk_id=3,
    max_sentence_length=1 << 16,
    minloglevel=2,
  )
  output = os.path.expanduser(output)
  os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
  tmp = f"{output}.tmp{os.getpid()}"
  with open(tmp, "wb") as f:
    f.write(model.getvalue())
  os.replace(tmp, output)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--grain_train_files", required=True, help="glob of ArrayRecord files of UTF-8 documents")
  parser.add_argument("--vocab_size", type=int, default=8000)
  parser.add_argument("--max_corpus_chars", type=int, default=10_000_000)
  parser.add_argument("--output", required=True, help="path of the .model file to write")
  args = parser.parse_args(argv)
  if not glob.glob(os.path.expanduser(args.grain_train_files)):
    print(f"error: --grain_train_files={args.grain_train_files} matches no files", file=sys.stderr)
    return 2
  start = time.time()
  print(f"training a {args.vocab_size}-token SentencePiece model on up to {args.max_corpus_chars:,} characters ...")
  train(documents(args.grain_train_files, args.max_corpus_chars), args.vocab_size, args.output)
  print(f"wrote {args.output} in {time.time() - start:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
