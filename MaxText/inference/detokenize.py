"""Generated tokens to text as they arrive: decoded in the context of the tokens before them, a few at a time.

A token's text depends on its neighbours: SentencePiece drops the space of a sequence's first "▁word", so "▁g"
decoded alone is "g" but after "said" is " g"; a byte-level token may hold part of a character that the next one
completes. `Incremental` follows vLLM's prefix_offset / read_offset scheme (vllm/v1/engine/detokenizer.py): each
call decodes only a window, the tokens since the last complete character and those before them back to the
previous call's, and returns what the new tokens add to it; an incomplete character at the end (U+FFFD) waits
for its next bytes. Each token is decoded a bounded number of times, so a request's text costs linear time in its
length, where decoding the whole completion each round costs quadratic time.

What it promises (MaxText/tests/detokenize_test.py checks it against whole decodes of random token sequences, for
SentencePiece and a byte-level BPE): the texts of `add` calls joined equal decode(context + tokens) after the part
of decode(context) that the whole decode starts with, so context text + completion text is the text of context
tokens + completion tokens. (When the context ends inside a character that the completion finishes, the whole
decode writes that character where decode(context) writes U+FFFD: it is the completion's.)

`StopText` adds stop strings: text that may begin one is held back until the request ends, and the text is cut
before the first stop string, at the token that completes it (the tokens after it are dropped, with their
logprobs).
"""

import os
from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

CONTEXT_TOKENS = 6  # context tokens decoded before the first new one (vLLM's initial offset is 5)
MAX_WINDOW = 128  # tokens a window may grow to while the text is only whitespace (see Incremental.add)
INCOMPLETE = "\ufffd"  # what decoders write for bytes that are not (yet) a whole UTF-8 character


def _shared_prefix(a: str, b: str) -> int:
  """Length of the longest common prefix of a and b."""
  if b.startswith(a):
    return len(a)
  return len(os.path.commonprefix([a, b]))


class Incremental:
  """The text that tokens add after `context`, decoded a window at a time (see the module docstring)."""

  def __init__(self, decode: Decode, context: Sequence[int] = ()):
    self.decode = decode
    size = min(len(context), CONTEXT_TOKENS)
    while size < min(len(context), MAX_WINDOW) and not decode(list(context[len(context) - size :])).strip():
      size = min(2 * size, len(context), MAX_WINDOW)  # back to a token of visible text (see `add`)
    self.ids = [int(t) for t in context[len(context) - size :]]
    self.prefix = 0  # the window's first token
    self.read = len(self.ids)  # the tokens before it have given their text

  def add(self, tokens: Sequence[int], final: bool = False) -> str:
    """The text `tokens` add; with `final` (no token follows) also an incomplete character at the end."""
    self.ids += tokens
    if self.read == len(self.ids):
      return ""
    before = self.decode(self.ids[self.prefix : self.read])
    after = self.decode(self.ids[self.prefix :])
    if after.endswith(INCOMPLETE) and not final:
      return ""  # its next token may complete it
    # The window's text before the new tokens may change with them (the context ended inside a character): the
    # changed part is theirs. Once a character is complete, the bytes after it never change it.
    text = after[_shared_prefix(before, after) :]
    # The next window starts at these tokens, unless they are only whitespace or tokens of no text (BOS, EOS):
    # SentencePiece strips a sequence's leading whitespace, so a window must begin with visible text, or the next
    # "▁word" would lose its space. (Past MAX_WINDOW tokens of whitespace it moves on regardless.)
    if text.strip() or len(self.ids) - self.prefix > MAX_WINDOW:
      self.prefix = self.read
    self.read = len(self.ids)
    return text

  def unsettled(self) -> str:
    """The text of the tokens `add` holds back (their last character is incomplete), that character left out."""
    if self.read == len(self.ids):
      return ""
    before = self.decode(self.ids[self.prefix : self.read])
    after = self.decode(self.ids[self.prefix :])
    return after[_shared_prefix(before, after) :].rstrip(INCOMPLETE)

  def peek(self, alternatives: Sequence[int]) -> list[str]:
    """The text each of `alternatives` would add after the tokens so far (the top log-probabilities' tokens)."""
    window = self.ids[self.prefix :]
    before = self.decode(window)
    out = []
    for token in alternatives:
      after = self.decode([*window, int(token)])
      out.append(after[_shared_prefix(before, after) :])
    return out

  def mark(self) -> tuple[int, int, int]:
    return len(self.ids), self.prefix, self.read

  def rewind(self, mark: tuple[int, int, int]) -> None:
    """Back to the state of `mark` (taken before later `add` calls)."""
    length, self.prefix, self.read = mark
    del self.ids[length:]


def first_stop(text: str, stops: Sequence[str], begin: int = 0) -> int | None:
  """Where the earliest of `stops` begins in text[begin:] (an index of text), or None."""
  found = [i for i in (text.find(stop, begin) for stop in stops) if i >= 0]
  return min(found) if found else None


class StopText:
  """A completion's text with stop strings: what may be sent as tokens arrive, and where a stop string cuts it."""

  def __init__(self, decode: Decode, context: Sequence[int], stops: Sequence[str] = ()):
    self.text = Incremental(decode, context)
    self.stops = tuple(stops)
    self.keep = max(map(len, self.stops), default=1) - 1  # sent characters a stop string may begin in
    self.tail = ""  # the last `keep` characters sent
    self.held = ""  # decoded, not sent: it may begin a stop string

  def add(self, tokens: Sequence[int], final: bool = False) -> tuple[str, int | None]:
    """(text to send now, None), or where a stop string completes: (the text before it not sent yet, how many of
    `tokens` to keep: those up to the one that completes it)."""
    mark = self.text.mark()
    new = self.text.add(tokens, final)
    if not self.stops:
      return new, None
    pending = self.held + new
    # Text held back for an incomplete character at the end may complete a stop string already.
    if first_stop(self.tail + pending + self.text.unsettled(), self.stops) is not None:
      self.text.rewind(mark)
      return self._cut(tokens, final)
    if final:
      self.held = ""
      return pending, None
    hold = self._hold(self.tail + pending, len(pending))
    send, self.held = pending[: len(pending) - hold], pending[len(pending) - hold :]
    self.tail = (self.tail + send)[-self.keep :] if self.keep else ""
    return send, None

  def _cut(self, tokens: Sequence[int], final: bool) -> tuple[str, int]:
    """Token by token (once per request), the first that completes a stop string, and the text before it."""
    text = seen = self.tail + self.held
    for i, token in enumerate(tokens):
      text += self.text.add([token], final and i == len(tokens) - 1)
      seen = text + self.text.unsettled()
      cut = first_stop(seen, self.stops)
      if cut is not None:
        return seen[len(self.tail) : max(cut, len(self.tail))], i + 1
    cut = first_stop(seen, self.stops)  # a decoder whose text depends on how tokens are grouped: cut at the end
    return seen[len(self.tail) : max(len(seen) if cut is None else cut, len(self.tail))], len(tokens)

  def _hold(self, text: str, limit: int) -> int:
    """The length of the longest end of `text` (at most `limit` characters, the unsent ones) that begins a stop
    string."""
    for size in range(min(self.keep, limit), 0, -1):
      end = text[len(text) - size :]
      if any(stop.startswith(end) for stop in self.stops):
        return size
    return 0
