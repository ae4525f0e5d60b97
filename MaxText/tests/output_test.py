"""The output processor (inference/output.py): a 4,000-token completion's text, stop strings and logprob texts cost
decoding work linear in its length, counted as the tokens handed to the decoder (not wall time), and the text is
the whole decode's.

The reference for the text is the whole decode: decode(prompt + tokens) after decode(prompt). The reference for the
cost is the approach the output processor replaced, re-decoding the whole completion every round: the same
counting decoder shows it costs hundreds of times the bound, so the bound fails for it.
"""

import functools
import random

import pytest

from MaxText.inference import output as output_lib
from MaxText.inference.request import Request, TokenLogprob

LENGTH = 4000  # tokens generated
PER_TOKEN = 16  # the most tokens the decoder may be handed per token generated (about 5 here; see the tests)
EURO = "€".encode()  # three bytes, one token each: a character that two tokens leave incomplete


def _piece(token: int) -> bytes:
  """A small byte-level vocabulary: the euro sign's three bytes, a space, a newline, and words."""
  if token < 3:
    return EURO[token : token + 1]
  if token == 3:
    return b" "
  if token == 4:
    return b"\n"
  return f"w{token}".encode()


class CountingDecode:
  """decode(ids) as a byte-level tokenizer decodes (incomplete characters as U+FFFD), counting the ids it is given."""

  def __init__(self):
    self.tokens = 0
    self.calls = 0

  def __call__(self, ids) -> str:
    self.tokens += len(ids)
    self.calls += 1
    return b"".join(_piece(int(t)) for t in ids).decode("utf-8", "replace")


def _completion(seed: int = 0) -> list[int]:
  """LENGTH tokens: words, spaces and newlines, and now and then a euro sign split over three tokens."""
  rng = random.Random(seed)
  tokens = []
  while len(tokens) < LENGTH:
    roll = rng.random()
    tokens += [0, 1, 2] if roll < 0.05 else [3] if roll < 0.35 else [4] if roll < 0.4 else [rng.randrange(5, 500)]
  return tokens[:LENGTH]


PROMPT = (5, 3, 6, 3, 7)


def _run(tokens: list[int], burst: int, stop: tuple[str, ...] = (), decode=None) -> tuple[str, list[int], str, int]:
  """Tokens through a RequestOutput `burst` at a time, as the engine hands them over -> (text, tokens, finish
  reason, tokens handed to the decoder)."""
  decode = decode or CountingDecode()
  updates = []
  out = output_lib.RequestOutput(Request(PROMPT, LENGTH, stop=stop), updates.append, decode)
  for start in range(0, len(tokens), burst):
    last = start + burst >= len(tokens)
    text, finish = out.process(tokens[start : start + burst], None, done=last, stop_ids=())
    out.send(text, finish)
    if finish is not None:
      break
  return "".join(u.text for u in updates), out.tokens, updates[-1].finish_reason, decode.tokens


def _whole(tokens) -> str:
  decode = CountingDecode()
  return decode([*PROMPT, *tokens])[len(decode(PROMPT)) :]


@functools.cache
def _quadratic_cost(tokens: tuple[int, ...]) -> int:
  """The tokens handed to the decoder by re-decoding the whole completion after each new token (the old way)."""
  decode = CountingDecode()
  for n in range(1, len(tokens) + 1):
    decode([*PROMPT, *tokens[:n]])
  return decode.tokens


@pytest.mark.parametrize("burst", [1, 7])
def test_a_4000_token_completion_decodes_in_linear_time(burst):
  """One token per round (streaming) or bursts of 7 (a generate call's steps): the text is the whole decode's, and
  the decoder is handed at most PER_TOKEN tokens per token generated (a window of a few tokens, twice per round);
  re-decoding the whole completion each round hands it about LENGTH / 2 per token, over 100 times the bound."""
  tokens = _completion()
  text, kept, finish, cost = _run(tokens, burst)
  assert text == _whole(tokens) and kept == tokens and finish == "length"
  assert cost <= PER_TOKEN * LENGTH, cost
  assert _quadratic_cost(tuple(tokens)) > 100 * PER_TOKEN * LENGTH  # the bound tells the two apart by far


def test_the_cost_grows_linearly_with_the_length():
  """Twice the tokens, at most about twice the decoding (the quadratic way: four times)."""
  tokens = _completion(1)
  half, whole = _run(tokens[: LENGTH // 2], 1)[3], _run(tokens, 1)[3]
  assert whole <= 2.2 * half, (half, whole)
  assert _quadratic_cost(tuple(tokens)) >= 3.9 * _quadratic_cost(tuple(tokens[: LENGTH // 2]))


def test_stop_strings_cut_where_they_complete_in_linear_time():
  """A stop string that never comes (its start "w1" comes often, so text is held back and released all along)
  costs linear time too; one that comes cuts the text before it and drops the tokens after the one completing it."""
  tokens = _completion(2)
  text, kept, finish, cost = _run(tokens, 1, stop=("w1 never",))
  assert (text, kept, finish) == (_whole(tokens), tokens, "length")
  assert cost <= PER_TOKEN * LENGTH, cost
  at = len(tokens) - 10
  tokens[at : at + 3] = [3, 999, 3]  # " w999 " late in the completion
  text, kept, finish, cost = _run(tokens, 5, stop=("w999",))
  whole = _whole(tokens)
  assert (text, finish) == (whole[: whole.index("w999")], "stop")
  assert kept == tokens[: at + 2]  # through the token that completes the stop string
  assert cost <= PER_TOKEN * LENGTH, cost


def test_logprob_texts_join_to_the_text_in_linear_time():
  """LogprobText (the server's logprob text): the chosen tokens' texts join to the whole decode's text, their offsets
  index it, each alternative's text is what it adds in the chosen token's place, and the decoding stays linear
  (the alternatives add one window decode each)."""
  tokens = _completion(3)
  decode = CountingDecode()
  pieces = output_lib.LogprobText(decode, PROMPT)
  entries = [TokenLogprob(-1.0, [(3, -1.5), (7, -2.0)]) for _ in tokens]
  walked = []
  for start in range(0, LENGTH, 16):
    walked += pieces.walk(tokens[start : start + 16], entries[start : start + 16], final=start + 16 >= LENGTH)
  texts = [text for text, _, _, _ in walked]
  whole = _whole(tokens)
  assert "".join(texts) == whole
  assert [offset for *_, offset in walked] == [sum(map(len, texts[:i])) for i in range(len(texts))]
  reference = CountingDecode()
  for i in [i for i in range(1000, 1100) if tokens[i - 1] >= 3]:  # after a complete character
    context = [*PROMPT, *tokens[:i]]
    assert walked[i][2] == [reference([*context, alt])[len(reference(context)) :] for alt in (3, 7)], i
  assert decode.tokens <= 2 * PER_TOKEN * LENGTH, decode.tokens
