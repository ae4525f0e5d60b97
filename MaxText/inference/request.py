"""What a caller of the engine gives and gets: a Request, its Updates as it runs (summed into a Result), and the
errors a submission can raise. engine.py re-exports every name, so callers import them from there."""

import dataclasses

MAX_TOP_LOGPROBS = 5  # OpenAI's limit for completions' logprobs
MAX_STOP_IDS = 16  # stop token ids per request, EOS included


class RequestError(ValueError):
  """A request the engine cannot run; the message names the field (`max_tokens=...: ...`)."""


class QueueFull(RuntimeError):
  """More requests wait than the queue holds."""


class EngineFailed(RuntimeError):
  """The engine's thread failed; it takes no more requests."""


@dataclasses.dataclass(frozen=True)
class Request:
  prompt: tuple[int, ...]  # token ids, BOS included by the caller when wanted
  max_tokens: int  # tokens to generate at most
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: off
  top_p: float = 1.0  # 1: off
  seed: int | None = None  # None: the engine draws one
  stop: tuple[str, ...] = ()  # stop strings: the text is cut before the first one
  stop_token_ids: tuple[int, ...] = ()  # besides EOS, which always stops
  logprobs: int | None = None  # None: none; k: each sampled token's logprob and the k most likely alternatives
  echo: bool = False  # also the prompt tokens' logprobs (with logprobs)
  ignore_eos: bool = False  # generate past EOS (benchmarks: a fixed number of tokens)
  stream: bool = False  # a client reads the tokens as they come: while it runs, generate calls last stream_interval_ms


@dataclasses.dataclass
class TokenLogprob:
  logprob: float  # of the token, under the model's distribution (before temperature, top-k and top-p)
  top: list[tuple[int, float]]  # the k most likely (token, logprob), most likely first


@dataclasses.dataclass
class Update:
  tokens: list[int]  # new tokens since the last update (none past a stop)
  text: str  # new text since the last update, decoded after the prompt (detokenize.py: prompt + text is its tokens')
  logprobs: list[TokenLogprob] | None  # one per new token, when asked for
  prompt_logprobs: list[TokenLogprob | None] | None = None  # first update only, with echo (entry 0 is None)
  finish_reason: str | None = None  # last update only: "stop" (EOS, a stop id or string), "length", "abort"
  stop_token: int | None = None  # last update only: the EOS or stop id that ended it, left out of tokens and text
  stop_logprob: TokenLogprob | None = None  # with logprobs: stop_token's (RL trains on the stop token too)


@dataclasses.dataclass
class Result:
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  logprobs: list[TokenLogprob] | None = None
  prompt_logprobs: list[TokenLogprob | None] | None = None
  finish_reason: str | None = None
  stop_token: int | None = None
  stop_logprob: TokenLogprob | None = None

  def add(self, update: Update) -> None:
    self.tokens += update.tokens
    self.text += update.text
    if update.logprobs is not None:
      self.logprobs = (self.logprobs or []) + update.logprobs
    if update.prompt_logprobs is not None:
      self.prompt_logprobs = update.prompt_logprobs
    self.finish_reason = update.finish_reason or self.finish_reason
    if update.stop_token is not None:
      self.stop_token, self.stop_logprob = update.stop_token, update.stop_logprob


def counted(n: int, noun: str) -> str:
  """A count and its noun, plural unless the count is one ("1 slot", "2 slots"), for what the tools print."""
  return f"{n} {noun}{'' if n == 1 else 's'}"
