"""The output processor: a request's sampled tokens -> the Updates its caller gets, and the texts of its logprobs.

One path for every consumer (decode.py and RL through Engine.generate's Results, the server through the Updates
and `LogprobText`), as vLLM's v1 output processor is one path for its engine and its servers:

- `RequestOutput`, one per request on the engine's thread: the tokens so far, the stop token (left out of tokens
  and text, kept for RL with its logprob), its logprobs, and its text decoded after the prompt, incrementally
  (detokenize.StopText over detokenize.Incremental: each token is decoded a bounded number of times, so a
  completion's text costs time linear in its length; MaxText/tests/output_test.py counts it). A stop string cuts
  the text where it completes and drops the tokens after the one that completes it, with their logprobs.
- `LogprobText`, one per choice in the server: each token's text (what it adds after the tokens before it, the same
  Incremental decoding as the choice's text, so the tokens' texts join to the text) and its alternatives' texts.
"""

from collections.abc import Callable, Iterator, Sequence

from MaxText.inference import detokenize as detokenize_lib
from MaxText.inference.request import MAX_TOP_LOGPROBS, Request, TokenLogprob, Update

Decode = detokenize_lib.Decode


def pairs(ids, logprobs, k: int = MAX_TOP_LOGPROBS) -> list[tuple[int, float]]:
  """The first k of a token's alternatives (ids and their logprobs, most likely first) as (id, logprob) pairs."""
  return [(int(i), float(lp)) for i, lp in zip(ids[:k], logprobs[:k], strict=True)]


class RequestOutput:
  """What one request has produced and what is not sent yet; `on_update` gets each Update (the engine's thread)."""

  def __init__(self, request: Request, on_update: Callable[[Update], None], detokenize: Decode | None = None):
    self.request, self.on_update, self.detokenize = request, on_update, detokenize
    self.tokens: list[int] = []
    self.sent_tokens = 0
    self.text: detokenize_lib.StopText | None = None  # its text so far, decoded after the prompt (with a detokenizer)
    self.pending_logprobs: list[TokenLogprob] = []
    self.prompt_logprobs: list | None = [] if request.echo else None
    self.first = True
    self.stop_token: int | None = None  # the EOS or stop id that ended it
    self.stop_logprob: TokenLogprob | None = None

  def add_prompt_logprobs(self, picked, top_ids, top_logprobs) -> None:
    """One prefill chunk's prompt logprobs (echo): each position's logprob of the token after it, and its top."""
    k = self.request.logprobs
    self.prompt_logprobs += [
      TokenLogprob(float(lp), pairs(i, t, k)) for lp, i, t in zip(picked, top_ids, top_logprobs, strict=True)
    ]

  def prompt_done(self) -> None:
    """The prompt's logprobs in OpenAI's shape: None for its first token, which nothing predicts."""
    if self.prompt_logprobs is not None:
      self.prompt_logprobs = [None, *self.prompt_logprobs[: len(self.request.prompt) - 1]]

  def process(self, tokens: list[int], logprobs, done: bool, stop_ids) -> tuple[str, str | None]:
    """New tokens of the request (`logprobs`: (logprob, top ids, top logprobs) of each, or None), `done` when its
    slot stopped, by its last token when that is in `stop_ids`, else by its length. Returns (the text to send now,
    the finish reason or None while it runs); `send` sends them."""
    request = self.request
    finish = None
    if done:
      stopped = bool(tokens) and tokens[-1] in stop_ids
      finish = "stop" if stopped else "length"
      if stopped:
        self.stop_token = tokens[-1]
        if request.logprobs is not None and logprobs is not None:
          lp, ids, lps = logprobs[-1]
          self.stop_logprob = TokenLogprob(lp, pairs(ids, lps, request.logprobs))
        tokens, logprobs = tokens[:-1], (logprobs[:-1] if logprobs is not None else None)
    self.tokens += tokens
    if request.logprobs is not None and logprobs is not None:
      self.pending_logprobs += [TokenLogprob(lp, pairs(ids, lps, request.logprobs)) for lp, ids, lps in logprobs]
    text, cut = self.new_text(tokens, final=finish is not None)
    if cut:  # a stop string ended it earlier than any stop token
      finish, self.stop_token, self.stop_logprob = "stop", None, None
    return text, finish

  def new_text(self, tokens: list[int], final: bool) -> tuple[str, bool]:
    """(the text `tokens` add that may be sent now, whether a stop string ended it). Until the request ends, text
    that may still turn into a stop string, and an incomplete character at the end, are held back. At a stop
    string, the tokens after the one that completes it are dropped, with their logprobs."""
    if self.detokenize is None:
      return "", False
    if self.text is None:
      self.text = detokenize_lib.StopText(self.detokenize, self.request.prompt, self.request.stop)
    text, keep = self.text.add(tokens, final)
    if keep is None:
      return text, False
    drop = len(tokens) - keep
    if drop:
      del self.tokens[len(self.tokens) - drop :]
      del self.pending_logprobs[max(len(self.pending_logprobs) - drop, 0) :]
    return text, True

  def send(self, text: str, finish: str | None) -> None:
    tokens = self.tokens[self.sent_tokens :]
    self.sent_tokens = len(self.tokens)
    logprobs = None
    if self.request.logprobs is not None:
      logprobs, self.pending_logprobs = self.pending_logprobs, []
    update = Update(tokens, text, logprobs, self.prompt_logprobs if self.first else None, finish)
    if finish is not None:
      update.stop_token, update.stop_logprob = self.stop_token, self.stop_logprob
    self.first = False
    self.on_update(update)

  def finish(self, reason: str) -> None:
    self.send("", reason)


class LogprobText:
  """Token texts for logprobs, following a choice's tokens as they come: a token's text is what it adds after the
  tokens before it (`context`, then the earlier ones), so the chosen tokens' texts join to the choice's text and
  their offsets (from `offset`) point at them. An incomplete character waits for the token that completes it (its
  text is then that token's); an alternative's text is what it would add in the chosen token's place."""

  def __init__(self, decode: Decode, context: Sequence[int] = (), offset: int = 0):
    self.text, self.offset = detokenize_lib.Incremental(decode, context), offset

  def walk(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], final: bool) -> Iterator[tuple]:
    """(token text, its entry, the texts of its entry's alternatives, its offset) of each of `ids`, advancing past
    it; `final`: no token follows the last (an incomplete character at the end is then its text)."""
    for i, (token, entry) in enumerate(zip(ids, entries, strict=False)):
      alternatives = self.text.peek([alt for alt, _ in entry.top]) if entry is not None else []
      text = self.text.add([token], final and i == len(ids) - 1)
      yield text, entry, alternatives, self.offset
      self.offset += len(text)
