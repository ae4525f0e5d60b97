"""inference/detokenize.py against whole decodes: for random token sequences of a SentencePiece model with byte
fallback (the demo's, and one trained here on text of many scripts) and of a byte-level BPE (Hugging Face
`tokenizers`), the text streamed in random bursts after a random context equals decode(context + tokens) after the
part of decode(context) that the whole decode starts with (`after`, computed from two whole decodes, never through
the code under test); stop strings cut where the whole decodes first hold one; and the work is linear in the
number of tokens."""

import os
import random

import pytest

from MaxText.inference import detokenize

DEMO_TOKENIZER = os.path.expanduser("~/maxtext_data/demo/tokenizer.model")
TEXTS = [
  "The king said: héllo wörld — €5 ✓ 😀 naïve café, 日本語のテキスト, Ελληνικά, русский.",
  "  two spaces, a\ttab, new\nlines\n\n and ünïcödé: 👨\u200d👩\u200d👧 ﬁ ½ ①",
]


def after(decode, context, tokens) -> str:
  full, before = decode([*context, *tokens]), decode(list(context))
  return full[len(os.path.commonprefix([before, full])) :]


@pytest.fixture(scope="module", params=["spm_demo", "spm", "bytelevel"])
def decoder(request, tmp_path_factory):
  """(decode, vocabulary size) of each tokenizer."""
  if request.param == "spm_demo":
    if not os.path.isfile(DEMO_TOKENIZER):
      pytest.skip("the demo tokenizer is built by setup.sh")
    import sentencepiece as spm

    model = spm.SentencePieceProcessor(model_file=DEMO_TOKENIZER)
    return model.decode, model.get_piece_size()
  if request.param == "spm":
    import sentencepiece as spm

    from MaxText import train_tokenizer

    path = str(tmp_path_factory.mktemp("spm") / "tok.model")
    train_tokenizer.train(TEXTS * 50, vocab_size=328, output=path)  # byte_fallback: bytes of rare characters
    model = spm.SentencePieceProcessor(model_file=path)
    return model.decode, model.get_piece_size()
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=["<|endoftext|>", "<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  hf.train_from_iterator(TEXTS * 50, trainer)
  return hf.decode, hf.get_vocab_size()


def _random_case(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
  """A context and a completion: random ids, or runs of one id (whitespace and control tokens repeated)."""
  sequence = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
  if rng.random() < 0.2:
    sequence = [rng.randrange(vocab)] * rng.randint(1, 12) + sequence
  cut = rng.randint(0, min(len(sequence), 10))
  return sequence[:cut], sequence[cut:]


def _bursts(rng: random.Random, tokens: list[int]) -> list[list[int]]:
  out, i = [], 0
  while i < len(tokens):
    size = rng.randint(1, 5)
    out.append(tokens[i : i + size])
    i += size
  return out


def test_streamed_text_equals_the_whole_decode_after_the_context(decoder):
  decode, vocab = decoder
  rng = random.Random(43)
  leading_spaces = 0
  for case in range(1500):
    context, tokens = _random_case(rng, vocab)
    text = detokenize.Incremental(decode, context)
    bursts = _bursts(rng, tokens)
    got = "".join(text.add(burst, final=i == len(bursts) - 1) for i, burst in enumerate(bursts))
    want = after(decode, context, tokens)
    assert got == want, (case, context, tokens)
    leading_spaces += bool(context) and want.startswith(" ")
  assert leading_spaces > 20  # the cases include completions whose first word keeps its space


def test_stop_strings_cut_where_the_whole_decode_first_holds_one(decoder):
  """A stop string taken from the completion's own text: the text sent is the completion's up to the earliest stop
  string in the text of the shortest prefix of tokens that holds one, and the tokens kept are that prefix; text
  that may begin a stop string is never sent before the request ends."""
  decode, vocab = decoder
  rng = random.Random(7)
  cuts = 0
  for case in range(600):
    context, tokens = _random_case(rng, vocab)
    whole = after(decode, context, tokens)
    stops = ["\x00never"]
    if len(whole) > 2 and rng.random() < 0.8:
      start = rng.randrange(len(whole) - 1)
      stops.append(whole[start : start + rng.randint(1, 4)])
    if "\ufffd" in stops[-1]:
      continue
    end = next((m for m in range(len(tokens) + 1) if any(s in after(decode, context, tokens[:m]) for s in stops)), None)
    text = detokenize.StopText(decode, context, stops)
    sent, kept = "", None
    bursts = _bursts(rng, tokens)
    for i, burst in enumerate(bursts):
      piece, keep = text.add(burst, final=i == len(bursts) - 1)
      sent += piece
      if keep is not None:
        kept = sum(map(len, bursts[:i])) + keep
        break
      assert not any(s in sent for s in stops), case
    if end is None:
      assert (sent, kept) == (whole, None), (case, stops)
    else:
      prefix = after(decode, context, tokens[:end])
      want = prefix[: min(i for i in (prefix.find(s) for s in stops) if i >= 0)]
      assert (sent, kept) == (want, end), (case, stops, context, tokens)
      cuts += 1
  assert cuts > 100


def test_the_work_is_linear_in_the_tokens(decoder):
  """2000 tokens a few at a time decode about a constant number of tokens each (before: the whole completion was
  decoded again each round, 2000 x 2000 / 2 tokens), stop strings and all."""
  decode, vocab = decoder
  rng = random.Random(5)
  decoded = []

  def counting(ids):
    decoded.append(len(ids))
    return decode(ids)

  tokens = [rng.randrange(vocab) for _ in range(2000)]
  text = detokenize.StopText(counting, tokens[:10], ["\x00never", "zzzz"])
  for burst in _bursts(rng, tokens[10:]):
    text.add(burst)
  assert sum(decoded) < 40 * len(tokens), sum(decoded)
