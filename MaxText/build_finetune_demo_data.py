"""Builds the fine-tuning demo's data from the demo corpus: `python3 MaxText/build_finetune_demo_data.py OUT_DIR`.

Three kinds of question with one-phrase answers, taken from the corpus's own documents (build_demo_dataset.py):

  "Is this from the Bible or from Shakespeare? TEXT"    -> "the Bible" or "Shakespeare" (half of the questions)
  "Which book of the Bible is this verse from? VERSE"   -> the book ("2 Chronicles"), from a King James chapter
  "Which play is this line from? LINE"                  -> the play ("Pericles"), from a Shakespeare scene

The corpus's split is kept: training questions come from training documents and held-out questions from
validation documents, so no held-out verse or line was seen in pre-training or fine-tuning. Written to OUT_DIR:

  sft_train.jsonl, sft_heldout.jsonl   {"prompt", "completion"} (objective=sft, train_data_columns=[prompt, completion])
  dpo_train.jsonl, dpo_heldout.jsonl   {"prompt", "chosen", "rejected"}: the right answer, and a wrong one of the
                                       same kind drawn at random (objective=dpo)
  heldout_prompts.txt, heldout_answers.txt   one held-out question (decode_prompts_file) and its answer per line
"""

import argparse
import glob
import json
import os
import re
import sys

import numpy as np

SOURCE_QUESTION = "Is this from the Bible or from Shakespeare? "
BIBLE_QUESTION = "Which book of the Bible is this verse from? "
PLAY_QUESTION = "Which play is this line from? "
SOURCES = {"bible": "the Bible", "play": "Shakespeare"}
_CHAPTER = re.compile(r"^(.*\S) \d+$")  # a King James document's title: "2 Chronicles 2"
_SENTENCE_END = re.compile(r"(?<=[.?!;:])\s+")
_STAGE = re.compile(r"^(Enter|Exit|Exeunt|Re-enter|\[|ACT |SCENE )")


def read_documents(pattern: str) -> list[str]:
  from array_record.python.array_record_module import ArrayRecordReader

  texts = []
  for path in sorted(glob.glob(os.path.expanduser(pattern))):
    reader = ArrayRecordReader(path)
    texts += [r.decode("utf-8") for r in reader.read_all()]
    reader.close()
  return texts


def questions(document: str) -> tuple[str, str, list[str]]:
  """(kind, answer, candidate passages) of one corpus document: ("bible", its book, its sentences) for a chapter,
  ("play", its play, its spoken lines) for a scene, ("", "", []) for a document of neither kind."""
  lines = document.split("\n")
  title = _CHAPTER.match(lines[0])
  if title and len(lines) > 2 and not lines[1]:  # "Book N", a blank line, the verses
    text = " ".join(lines[2:])
    return "bible", title.group(1), [s for s in _SENTENCE_END.split(text) if 40 <= len(s) <= 160]
  if len(lines) > 3 and lines[1].startswith(("ACT ", "PROLOGUE", "EPILOGUE", "INDUCTION")):
    spoken = [line.strip() for line in lines[3:] if 30 <= len(line.strip()) <= 120]
    spoken = [line for line in spoken if not _STAGE.match(line) and not line.isupper()]
    return "play", lines[0], spoken
  return "", "", []


def build(train_docs: list[str], heldout_docs: list[str], per_document: tuple[int, int], seed: int = 0) -> dict:
  """{split: [(question, answer, kind)]}: up to per_document[0] passages per training document and per_document[1]
  per held-out one, drawn with `seed`, each asked about its source (kind "source") or its book or play (kind
  "bible" or "play") at random."""
  rng = np.random.default_rng(seed)
  out = {}
  for split, docs, k in (("train", train_docs, per_document[0]), ("heldout", heldout_docs, per_document[1])):
    rows = []
    for doc in docs:
      kind, answer, passages = questions(doc)
      prefix = BIBLE_QUESTION if kind == "bible" else PLAY_QUESTION
      for i in rng.choice(len(passages), size=min(k, len(passages)), replace=False) if passages else []:
        if rng.random() < 0.5:
          rows.append((SOURCE_QUESTION + passages[i], SOURCES[kind], "source"))
        else:
          rows.append((prefix + passages[i], answer, kind))
    rng.shuffle(rows)
    out[split] = rows
  return out


def write(out_dir: str, sets: dict, seed: int = 0) -> None:
  rng = np.random.default_rng(seed + 1)
  kinds = ("source", "bible", "play")
  answers = {kind: sorted({a for rows in sets.values() for _, a, k in rows if k == kind}) for kind in kinds}
  answers["source"] = sorted(SOURCES.values())
  os.makedirs(out_dir, exist_ok=True)
  for split, rows in sets.items():
    with open(os.path.join(out_dir, f"sft_{split}.jsonl"), "w", encoding="utf-8") as f:
      f.writelines(json.dumps({"prompt": q, "completion": a}) + "\n" for q, a, _ in rows)
    with open(os.path.join(out_dir, f"dpo_{split}.jsonl"), "w", encoding="utf-8") as f:
      for q, a, kind in rows:
        wrong = str(rng.choice([x for x in answers[kind] if x != a]))
        f.write(json.dumps({"prompt": q, "chosen": a, "rejected": wrong}) + "\n")
  heldout = sets["heldout"]
  with open(os.path.join(out_dir, "heldout_prompts.txt"), "w", encoding="utf-8") as f:
    f.writelines(q + "\n" for q, _, _ in heldout)
  with open(os.path.join(out_dir, "heldout_answers.txt"), "w", encoding="utf-8") as f:
    f.writelines(a + "\n" for _, a, _ in heldout)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--corpus", default="~/maxtext_data/demo/array_record")
  parser.add_argument("--per_train_document", type=int, default=6)
  parser.add_argument("--per_heldout_document", type=int, default=2)
  args = parser.parse_args(argv)
  train = read_documents(f"{args.corpus}/train/*")
  heldout = read_documents(f"{args.corpus}/validation/*")
  if not train or not heldout:
    print(f"error: --corpus {args.corpus} has no ArrayRecord files; build it with `bash setup.sh`", file=sys.stderr)
    return 2
  sets = build(train, heldout, (args.per_train_document, args.per_heldout_document))
  write(args.out_dir, sets)
  counts = {split: len(rows) for split, rows in sets.items()}
  print(f"Wrote {args.out_dir}: {counts['train']} training and {counts['heldout']} held-out questions", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
