"""OpenAI-compatible HTTP server over the continuous-batching engine (inference/engine.py):
`python3 MaxText/serve.py MaxText/configs/base.yml load_parameters_path=PATH tokenizer_path=PATH [key=value ...]`.

The config keys are decode.py's (model, checkpoint, tokenizer, max_prefill_predict_length, max_target_length, ...)
plus base.yml's serving section: server_host (127.0.0.1: this machine only), server_port, server_api_key (set it
as M_SERVER_API_KEY=KEY in the environment, so that no command line shows it), server_max_queue,
server_max_prompt_chars, server_read_timeout and served_model_name; and stream_interval_ms (the engine's).

Endpoints, in OpenAI's shapes (vLLM's extensions where OpenAI has none: top_k, stop_token_ids, the tokenizer ones):
  POST /v1/completions       prompt: text, a list of texts, token ids or a list of lists of token ids; n, echo,
                             logprobs (0..5), stop, seed, stream. Text gets BOS per add_bos, token ids are sent as
                             they are. max_tokens=0 with echo scores the prompt only (lm-eval's loglikelihood).
  POST /v1/chat/completions  messages rendered by the chat template exactly as fine-tuning renders them
                             (input_pipeline/sft.py, with the generation prompt); logprobs + top_logprobs, n, stream.
  GET  /v1/models            the one model served;  GET /health  200 while the engine runs.
  GET  /tokenizer_info, POST /tokenize, POST /detokenize   vLLM's tokenizer endpoints, which lm-eval's
                             tokenizer_backend=remote uses to count tokens for any of our tokenizer files.

Rules: with an API key, every route but /health needs `Authorization: Bearer KEY` (401 otherwise). Every error is
OpenAI's `{"error": {"message", "type", "param", "code"}}` with the field named: bad JSON, a field of the wrong
type, range or size, or a string with a lone surrogate 400, an unknown model 404, a request not sent within
server_read_timeout 408, past the engine's queue 503. Unknown fields are ignored, as OpenAI's clients send
extras. A client that disconnects, streaming or not, has its requests cancelled, freeing their slots.

Text is vLLM's: a completion's text is what its tokens add after the prompt's tokens (inference/detokenize.py),
so prompt text + completion text is the text of all the tokens; with echo the choice's text starts with the
prompt's tokens' text, the logprobs' tokens join to it, and their `text_offset`s index it.

The event loop only moves bytes: parsing, validating (sizes first, by len() alone), tokenizing and rendering run on
worker threads (`Server.run`), so a large request never stalls the others (/health answers throughout).
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hmac
import json
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import fastapi
import h11
import jax
import pydantic
import starlette.exceptions
import uvicorn
from fastapi import responses
from pydantic import Field
from starlette.background import BackgroundTask
from uvicorn.protocols.http.h11_impl import H11Protocol

from MaxText import cli
from MaxText.common_types import Config, ConfigError, shown
from MaxText.inference import detokenize as detokenize_lib
from MaxText.inference import engine as engine_lib
from MaxText.inference.engine import counted
from MaxText.input_pipeline import sft
from MaxText.input_pipeline import tokenizer as tokenizer_lib

MAX_BODY_BYTES = 32 << 20  # A request body past this is refused (413): prompts are at most a few MB of token ids.
MAX_CHOICES = 1024  # prompts x n in one request, so that one request cannot allocate without bound.
MAX_STOP = 64  # stop strings or stop token ids in one request.
MAX_STOP_CHARS = 256  # characters of one stop string: each round looks for the end of a stop string in the text.
MAX_MESSAGES = 4096  # messages, and content parts, of one conversation.
MAX_LOGPROBS = 5  # the engine's limit (OpenAI's for completions).
POLL_SECONDS = 0.25  # how often a non-streamed request looks for its client's disconnect.
# Bodies up to this size are parsed by json's C scanner, which holds the GIL throughout (at most ~0.1 s for 1 MB of
# the slowest shape, `[[],[],...`); larger ones by its Python scanner, which the event loop can interrupt.
FAST_JSON_BYTES = 1 << 20
WORKERS = 4  # threads that parse, validate, tokenize and render requests, off the event loop
PROGRESS_SECONDS = 5  # start-up: a line at least this often while the engine's programs compile


# ------------------------------------------------------------------------------------------------ options
def check(config: Config) -> None:
  """ConfigError for a serving key out of range."""
  if not 0 <= config.server_port <= 65535:
    raise ConfigError(f"server_port={config.server_port} is not a TCP port; give 1 to 65535 (0: any free port)")
  if not config.server_host.strip():
    raise ConfigError("server_host is empty; give the address to listen on, e.g. 127.0.0.1 (this machine only)")
  if config.server_max_queue < 1:
    raise ConfigError(f"server_max_queue={config.server_max_queue} must be at least 1 (requests waiting for a slot)")
  if config.server_max_prompt_chars < 1:
    raise ConfigError(
      f"server_max_prompt_chars={config.server_max_prompt_chars} must be at least 1 (characters of a prompt)"
    )
  if not 0 < config.server_read_timeout <= 86400:
    raise ConfigError(
      f"server_read_timeout={config.server_read_timeout} must be 1 to 86400 seconds (a client's time to send a request)"
    )


def served_name(config: Config) -> str:
  """served_model_name, else run_name, else the run folder of load_parameters_path (.../RUN/checkpoints/STEP/items)."""
  if config.served_model_name:
    return config.served_model_name
  if config.run_name:
    return config.run_name
  parts = [p for p in config.load_parameters_path.replace("\\", "/").split("/") if p]
  while parts and (parts[-1] in ("items", "checkpoints") or parts[-1].isdigit()):
    parts.pop()
  return parts[-1] if parts else "maxtext"


@dataclasses.dataclass(frozen=True)
class Options:
  """What the app needs of the config (tests build one directly)."""

  model_name: str
  api_key: str = ""
  add_bos: bool = True
  chat_template: str = sft.FALLBACK_TEMPLATE  # Jinja text, as sft.find_template gives it
  max_prompt_chars: int = 1_000_000  # server_max_prompt_chars
  read_timeout: float = 30.0  # server_read_timeout: seconds for a request's headers, and again for its body

  @classmethod
  def from_config(cls, config: Config) -> "Options":
    check(config)
    template, _ = sft.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
    return cls(
      served_name(config),
      config.server_api_key,
      config.add_bos,
      template,
      config.server_max_prompt_chars,
      config.server_read_timeout,
    )


# ------------------------------------------------------------------------------------------------ errors
class APIError(Exception):
  """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")


def error_response(error: APIError) -> responses.JSONResponse:
  body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": error.code}}
  close = {"connection": "close"} if error.status == 408 else None  # the rest of its body is not waited for
  return responses.JSONResponse(body, status_code=error.status, headers=close)


def _param_of(message: str) -> str | None:
  """The field an engine RequestError names first ("max_tokens=5000: ..." -> "max_tokens")."""
  match = re.match(r"\s*([A-Za-z_][\w.\[\]]*)\s*[=:]", message)
  return match.group(1) if match else None


# Union fields: pydantic reports one error per member; one sentence says what the field takes.
UNION_HINTS = {
  "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
  "stop": "a string or a list of strings",
  "content": "a string or a list of {'type': 'text', 'text': ...} parts",
}


def _is_union_tag(part: str) -> bool:
  return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


def _validation_error(first: dict) -> APIError:
  """A request's first validation error (pydantic's dict) as a 400 naming the field, e.g. `messages[0].role: ...`."""
  path, last = "", ""
  for part in first["loc"]:
    if isinstance(part, int):
      path += f"[{part}]"
    elif _is_union_tag(part):
      if last in UNION_HINTS:
        return APIError(400, f"{path} must be {UNION_HINTS[last]}", param=path)
      continue
    else:
      path, last = f"{path}.{part}" if path else part, part
  if first["type"] == "missing":
    return APIError(400, f"{path} is required", param=path)
  return APIError(400, f"{path}: {first['msg']} (got {shown(first.get('input'), 60)})", param=path or None)


# ------------------------------------------------------------------------------------------------ requests
class _Body(pydantic.BaseModel):
  """Fields are typed strictly (a known field of the wrong type is a 400); unknown ones are ignored."""

  model_config = pydantic.ConfigDict(extra="ignore", strict=True)

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_is_default(cls, data):
    """A field given as null takes its default, as OpenAI's API does (clients send nulls for what they omit)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Body):
  include_usage: bool = False


class _Sampling(_Body):
  model: str | None = None
  temperature: float = Field(1.0, ge=0, le=100, allow_inf_nan=False)
  top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
  top_k: int = Field(0, ge=-1, le=1 << 30)  # vLLM's extension; -1 and 0 are off
  n: int = Field(1, ge=1, le=128)
  seed: int | None = Field(None, ge=0, lt=2**64 - 128)  # the engine's range; choice j of n samples with seed + j
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)  # vLLM's extension
  ignore_eos: bool = False  # vLLM's extension: generate max_tokens past EOS (benchmarks)
  stream: bool = False
  stream_options: StreamOptions | None = None


class CompletionBody(_Sampling):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int = Field(16, ge=0)  # OpenAI's default
  echo: bool = False
  logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ContentPart(_Body):
  type: str
  text: str | None = None


class Message(_Body):
  role: str
  content: str | list[ContentPart] | None = None


class ChatBody(_Sampling):
  messages: list[Message] = Field(min_length=1)
  max_tokens: int | None = Field(None, ge=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeBody(_Body):
  prompt: str
  add_special_tokens: bool = True


class DetokenizeBody(_Body):
  tokens: list[int]


def _refuse_constant(name: str):
  raise ValueError(f"{name} is not JSON")


async def read_body(request: fastapi.Request, seconds: float) -> bytes:
  """The request's body; APIError 413 past MAX_BODY_BYTES, 408 when it has not all arrived after `seconds`."""
  raw = bytearray()
  try:
    async with asyncio.timeout(seconds):
      async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
          raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes; send fewer or shorter prompts")
  except TimeoutError:
    raise APIError(
      408, f"the request body did not arrive within {seconds:g} s (server_read_timeout); send it at once", code="timeout"
    ) from None
  return bytes(raw)


def parse_json(raw: bytes) -> dict:
  """The body as a JSON object; APIError 400. Runs on a worker thread: a body over FAST_JSON_BYTES is parsed by
  json's Python scanner, which lets the event loop take the GIL between values (the C scanner holds it throughout:
  3 s for 32 MB of `[],`); its strings are still read by the C function, so a long text costs no more."""
  decoder = json.JSONDecoder(parse_constant=_refuse_constant)
  if len(raw) > FAST_JSON_BYTES:
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
  try:
    body = decoder.decode(raw.decode(json.detect_encoding(raw), "surrogatepass"))
  except (ValueError, RecursionError) as e:
    raise APIError(400, f"the request body is not valid JSON ({shown(str(e), 100)}); send a JSON object") from None
  if not isinstance(body, dict):
    raise APIError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object")
  return body


@dataclasses.dataclass(frozen=True)
class Limits:
  """The sizes a request's fields may have, checked before anything reads them (`check_sizes`)."""

  prompt_tokens: int  # token ids in one prompt: the engine's longest prompt (max_prefill_predict_length)
  cache_tokens: int  # token ids /detokenize takes: the cache's length (max_target_length)
  prompts: int  # prompts in one request: the engine's queue (server_max_queue), which choices may not exceed
  chars: int  # characters of text to tokenize: server_max_prompt_chars


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _top_field(path: str) -> str:
  """The request field a path is in: "messages[0].content" -> "messages"."""
  return re.match(r"\w*", path).group()


def _too_long(field: str, size: int, limit: int, what: str, fix: str) -> APIError:
  return APIError(400, f"{field}: {size} {what}, more than {limit} ({fix})", param=_top_field(field))


def check_sizes(body: dict, limits: Limits) -> None:
  """APIError 400 naming the field for one larger than the server can take: cheap checks of len() only, before
  any validation walks a field or a tokenizer reads it (a 15M-token prompt is refused at once, not after seconds
  of validating it). A field of the wrong type is left to validation."""
  _check_prompt_sizes(body.get("prompt"), limits)
  _check_message_sizes(body.get("messages"), limits)
  stop = body.get("stop")
  for i, text in enumerate([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []):
    if i >= MAX_STOP:
      raise _too_long("stop", len(stop), MAX_STOP, "stop strings", "give fewer")
    if isinstance(text, str) and len(text) > MAX_STOP_CHARS:
      field = f"stop[{i}]" if isinstance(stop, list) else "stop"
      raise _too_long(field, len(text), MAX_STOP_CHARS, "characters", "a stop string is a short marker")
  for name, limit, fix in (("stop_token_ids", MAX_STOP, "give fewer"), ("tokens", limits.cache_tokens, "max_target_length")):
    value = body.get(name)
    if isinstance(value, list) and len(value) > limit:
      raise _too_long(name, len(value), limit, "token ids", fix)


def _check_prompt_sizes(prompt, limits: Limits) -> None:
  chars = f"server_max_prompt_chars={limits.chars}; send a shorter text"
  tokens = f"the longest prompt, max_prefill_predict_length={limits.prompt_tokens}; send a shorter prompt"
  if isinstance(prompt, str) and len(prompt) > limits.chars:
    raise _too_long("prompt", len(prompt), limits.chars, "characters", chars)
  if not isinstance(prompt, list):
    return
  if prompt and _is_int(prompt[0]):
    if len(prompt) > limits.prompt_tokens:
      raise _too_long("prompt", len(prompt), limits.prompt_tokens, "token ids", tokens)
    return
  if len(prompt) > limits.prompts:
    raise _too_long("prompt", len(prompt), limits.prompts, "prompts", "server_max_queue; send fewer at a time")
  for i, p in enumerate(prompt):
    if isinstance(p, str) and len(p) > limits.chars:
      raise _too_long(f"prompt[{i}]", len(p), limits.chars, "characters", chars)
    if isinstance(p, list) and len(p) > limits.prompt_tokens:
      raise _too_long(f"prompt[{i}]", len(p), limits.prompt_tokens, "token ids", tokens)


def _check_message_sizes(messages, limits: Limits) -> None:
  if not isinstance(messages, list):
    return
  if len(messages) > MAX_MESSAGES:
    raise _too_long("messages", len(messages), MAX_MESSAGES, "messages", "send a shorter conversation")
  total, parts = 0, 0
  for message in messages:
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
      total += len(content)
    elif isinstance(content, list):
      parts += len(content)
      total += sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
  if parts > MAX_MESSAGES:
    raise _too_long("messages", parts, MAX_MESSAGES, "content parts", "send fewer parts")
  if total > limits.chars:
    raise _too_long("messages", total, limits.chars, "characters of content", f"server_max_prompt_chars={limits.chars}")


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(body: dict, fields) -> None:
  """APIError 400 naming the first string of `fields` (keys included, at any depth) that holds a lone surrogate:
  JSON's "\\ud800" escape parses to one, which is no Unicode text, so no tokenizer or response could encode it."""
  stack = [(name, body[name]) for name in reversed(list(fields)) if name in body]
  while stack:
    path, value = stack.pop()
    if isinstance(value, str):
      found = _SURROGATE.search(value)
      if found:
        raise APIError(
          400,
          f"{path} holds a lone surrogate ({found.group()!r} at character {found.start()}), which is not text; send "
          "UTF-8 text (an escaped pair such as \\ud83d\\ude00 is one character and fine)",
          param=_top_field(path),
        )
    elif isinstance(value, list):
      stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))) if isinstance(v, str | list | dict)]
    elif isinstance(value, dict):
      for key, item in reversed(list(value.items())):
        stack += [(f"{path}.{key}", item), (f"{path} (a key)", key)]


def validate(body: dict, model: type[_Body], limits: Limits) -> Any:
  """`body` checked for size, then for text, then as `model` (a 400 naming the field for each); on a worker thread."""
  check_sizes(body, limits)
  check_text(body, model.model_fields)
  try:
    return model.model_validate(body)
  except pydantic.ValidationError as e:
    raise _validation_error(e.errors(include_url=False)[0]) from None


def _stop(body: _Sampling, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
  if len(stop) > MAX_STOP:
    raise APIError(400, f"stop has {len(stop)} strings; give at most {MAX_STOP}", param="stop")
  if "" in stop:
    raise APIError(400, f"stop[{stop.index('')}] is empty; a stop string needs a character", param="stop")
  ids = list(body.stop_token_ids or [])
  _check_ids(ids, vocab_size, "stop_token_ids")
  return tuple(stop), tuple(ids)


def _check_ids(ids: list[int], vocab_size: int, name: str) -> None:
  for i, token in enumerate(ids):
    if not 0 <= token < vocab_size:
      raise APIError(400, f"{name}[{i}]={token} is not a token id of this model (0 to {vocab_size - 1})", param=name)


# ------------------------------------------------------------------------------------------------ the engine
class Submission:
  """The engine requests of one HTTP request: their updates reach this event loop through a queue (the engine
  calls back on its own thread), and those unfinished when the client goes are cancelled."""

  def __init__(self, engine):
    self.engine = engine
    self.loop = asyncio.get_running_loop()
    self.queue: asyncio.Queue = asyncio.Queue()
    self.ids: dict[int, int] = {}  # choice index -> engine request id
    self.done: set[int] = set()

  def submit(self, requests: list) -> None:
    """Checks every request first, so that a bad one submits none; APIError 400 or 503."""
    if len(requests) > self.engine.max_queue:  # could never all wait at once: no retry would help
      raise APIError(
        400,
        f"n: {len(requests)} choices (prompts x n) exceed the server's queue of {self.engine.max_queue} "
        "(server_max_queue); send fewer prompts or a smaller n",
        param="n",
      )
    try:
      for request in requests:
        self.engine.check(request)
      for index, request in enumerate(requests):
        self.ids[index] = self.engine.submit(request, functools.partial(self._on_update, index))
    except engine_lib.RequestError as e:
      self.cancel_unfinished()
      raise APIError(400, str(e), param=_param_of(str(e))) from None
    except engine_lib.QueueFull as e:
      self.cancel_unfinished()
      raise APIError(503, f"the server is busy ({e}); retry later", code="queue_full") from None
    except engine_lib.EngineFailed as e:
      self.cancel_unfinished()
      raise APIError(503, str(e), code="engine_failed") from None

  def _on_update(self, index: int, update) -> None:  # On the engine's thread: must not block.
    with contextlib.suppress(RuntimeError):  # The event loop has closed: the server is stopping.
      self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, update))

  async def updates(self, request: fastapi.Request | None = None) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, Update) until every choice finishes; with `request`, stops (cancelling) if its client goes."""
    next_look = self.loop.time() + POLL_SECONDS
    while len(self.done) < len(self.ids):
      if request is not None and self.loop.time() >= next_look:  # also while updates keep coming
        next_look = self.loop.time() + POLL_SECONDS
        if await request.is_disconnected():
          self.cancel_unfinished()
          return
      try:
        index, update = await asyncio.wait_for(self.queue.get(), POLL_SECONDS)
      except TimeoutError:
        continue
      if update.finish_reason is not None:
        self.done.add(index)
      yield index, update

  async def collect(self, request: fastapi.Request, choices: list["Choice"]) -> None:
    """Every update into its choice (a non-streamed answer); cancels what is left if the client goes, and raises
    the 500 of an aborted request."""
    try:
      async for index, update in self.updates(request):
        choices[index].take(update)
    finally:
      self.cancel_unfinished()
    _check_not_aborted(choices)

  def cancel_unfinished(self) -> None:
    for index, request_id in self.ids.items():
      if index not in self.done:
        self.done.add(index)
        self.engine.cancel(request_id)


@dataclasses.dataclass
class Choice:
  """One choice as its updates arrive. With max_tokens=0 the engine generates one token (it needs max_tokens >= 1)
  and it is dropped here: only the prompt's logprobs are wanted."""

  prompt_ids: list[int]
  keep_generated: bool = True
  tokens: list[int] = dataclasses.field(default_factory=list)
  text: str = ""
  logprobs: list = dataclasses.field(default_factory=list)
  prompt_logprobs: list | None = None
  finish_reason: str | None = None
  started: bool = False

  def take(self, update) -> "Choice":
    """Adds `update`; returns what it adds, as a Choice holding only that."""
    delta = Choice(self.prompt_ids, started=self.started)
    if update.prompt_logprobs is not None:
      delta.prompt_logprobs = self.prompt_logprobs = list(update.prompt_logprobs)
    if self.keep_generated:
      delta.tokens, delta.text, delta.logprobs = list(update.tokens), update.text, list(update.logprobs or [])
      self.tokens += delta.tokens
      self.text += delta.text
      self.logprobs += delta.logprobs
    if update.finish_reason is not None:
      self.finish_reason = delta.finish_reason = update.finish_reason if self.keep_generated else "length"
    self.started = True
    return delta


class Pieces:
  """Token texts and logprob entries in OpenAI's shapes, following the tokens as they are generated: a token's text
  is what it adds after the tokens before it (detokenize.Incremental, as the engine decodes the choice's text), so
  the chosen tokens' texts join to the text and `text_offset`s point at them. An incomplete character waits for
  the token that completes it (its text is then that token's); an alternative's text is what it would add."""

  def __init__(self, tokenizer, context: list[int], offset: int = 0):
    self.text, self.offset = detokenize_lib.Incremental(tokenizer.decode, context), offset

  def _walk(self, ids: list[int], entries: list, final: bool):
    """(token text, its entry, the alternatives' texts, its offset) of each token, advancing past it."""
    for i, (token, entry) in enumerate(zip(ids, entries, strict=False)):
      alternatives = self.text.peek([alt for alt, _ in entry.top]) if entry is not None else []
      text = self.text.add([token], final and i == len(ids) - 1)
      yield text, entry, alternatives, self.offset
      self.offset += len(text)

  def completion(self, ids: list[int], entries: list, final: bool) -> dict:
    """Completions' logprobs for `ids`: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, entry, alternatives, offset in self._walk(ids, entries, final):
      top = None
      if entry is not None:
        top = {alt: lp for alt, (_, lp) in zip(alternatives, entry.top, strict=True)}
        top.setdefault(text, entry.logprob)  # OpenAI's (and vLLM's): the chosen token is always there.
      out["tokens"].append(text)
      out["token_logprobs"].append(None if entry is None else entry.logprob)
      out["top_logprobs"].append(top)
      out["text_offset"].append(offset)
    return out

  def chat(self, ids: list[int], entries: list, final: bool) -> list[dict]:
    """Chat's logprobs content entries for `ids`."""
    out = []
    for text, entry, alternatives, _ in self._walk(ids, entries, final):
      top = [self._entry(alt, lp) for alt, (_, lp) in zip(alternatives, entry.top, strict=True)]
      out.append({**self._entry(text, entry.logprob), "top_logprobs": top})
    return out

  @staticmethod
  def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def _join(parts: list[dict]) -> dict:
  return {
    key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
  }


def _usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
  prompt_tokens = sum(len(p) for p in prompts)
  completion_tokens = sum(len(c.tokens) for c in choices)
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


def _sse(payload: dict | str) -> str:
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def _streaming(events: AsyncIterator[str], submission: Submission) -> responses.StreamingResponse:
  # The background task also cancels when the client left before the first event (the generator never ran).
  return responses.StreamingResponse(
    events, media_type="text/event-stream", background=BackgroundTask(submission.cancel_unfinished)
  )


# ------------------------------------------------------------------------------------------------ the app
@dataclasses.dataclass
class Server:
  """The app's state: the engine, the tokenizer, the options and the compiled chat template, and the threads that do
  a request's CPU work (parsing, validating, tokenizing, rendering), so that the event loop only moves bytes: one
  large request never stalls the others, /health included."""

  engine: Any
  tokenizer: tokenizer_lib.Tokenizer
  options: Options
  template: Any
  stopping: bool = False
  limits: Limits = dataclasses.field(init=False)
  workers: concurrent.futures.ThreadPoolExecutor = dataclasses.field(init=False)

  def __post_init__(self):
    engine = self.engine
    self.limits = Limits(engine.max_prompt_length, engine.max_length, engine.max_queue, self.options.max_prompt_chars)
    self.workers = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="serve")

  async def run(self, fn, *args):
    """fn(*args) on a worker thread (its APIError raised here)."""
    return await asyncio.get_running_loop().run_in_executor(self.workers, functools.partial(fn, *args))

  async def body(self, request: fastapi.Request, model: type[_Body]) -> Any:
    """The request's body, read within server_read_timeout, parsed and validated as `model` on a worker thread."""
    raw = await read_body(request, self.options.read_timeout)
    return await self.run(lambda: validate(parse_json(raw), model, self.limits))

  def sampling(self, body: _Sampling, **fields) -> dict:
    stop, stop_ids = _stop(body, self.tokenizer.vocab_size)
    top_k = max(body.top_k, 0)
    common = {
      "temperature": body.temperature,
      "top_k": top_k,
      "top_p": body.top_p,
      "stop": stop,
      "stop_token_ids": stop_ids,
      "ignore_eos": body.ignore_eos,
    }
    return {**common, **fields}

  def requests(self, prompts: list[list[int]], body: _Sampling, max_tokens: list[int], **fields) -> list:
    """n engine Requests per prompt, choice i*n+j (seeds seed, seed+1, ... when a seed is given)."""
    if len(prompts) * body.n > MAX_CHOICES:
      raise APIError(400, f"{len(prompts)} prompts x n={body.n} is over {MAX_CHOICES} choices; send fewer", param="n")
    sampling = self.sampling(body, **fields)
    return [
      engine_lib.Request(
        prompt=tuple(ids),
        max_tokens=limit,
        seed=None if body.seed is None else body.seed + j,
        **sampling,
      )
      for ids, limit in zip(prompts, max_tokens, strict=True)
      for j in range(body.n)
    ]

  def room(self, ids: list[int]) -> int:
    """Tokens the cache leaves after the prompt `ids` (the default max_tokens when none is given)."""
    return max(self.engine.max_length - len(ids), 1)

  def check_model(self, body: _Sampling) -> None:
    if body.model is not None and body.model != self.options.model_name:
      raise APIError(
        404,
        f"model={body.model!r} does not exist; this server serves {self.options.model_name!r} (GET /v1/models)",
        param="model",
        code="model_not_found",
      )

  def text_prompt(self, text: str) -> list[int]:
    """[BOS] text, as decode.prompt_tokens encodes a prompt without a chat template."""
    bos = [self.tokenizer.bos_id] if self.options.add_bos and self.tokenizer.bos_id >= 0 else []
    return bos + self.tokenizer.encode(text)

  def completion_prompts(self, prompt) -> tuple[list[list[int]], list[str]]:
    """(token ids, text) of each prompt of a completions request: its text as its tokens decode (for echo, so that
    the text is what the logprobs' tokens join to: the prompt's text as it was sent, unless the tokenizer
    normalizes it)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
      prompt = [prompt]
    if not prompt:
      raise APIError(400, "prompt is an empty list; give a prompt", param="prompt")
    ids, texts = [], []
    for i, p in enumerate(prompt):
      if len(p) == 0:
        raise APIError(400, f"prompt[{i}] is empty; give at least one character or token", param="prompt")
      if isinstance(p, str):
        ids.append(self.text_prompt(p))
      else:
        _check_ids(p, self.tokenizer.vocab_size, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
        ids.append(list(p))
      texts.append(self.tokenizer.decode(ids[-1]))
    return ids, texts

  def chat_prompt(self, messages: list[Message]) -> list[int]:
    """The conversation's tokens through the chat template, with the generation prompt (as sft renders it)."""
    turns = []
    for i, message in enumerate(messages):
      content = message.content or ""
      if not isinstance(content, str):
        if any(part.type != "text" or part.text is None for part in content):
          raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(part.text for part in content)
      role = "system" if message.role == "developer" else message.role
      if role not in sft.ROLES:
        raise APIError(400, f"messages[{i}].role={message.role!r}; give one of {list(sft.ROLES)}", param="messages")
      turns.append({"role": role, "content": content})
    try:
      return sft.render(self.template, self.tokenizer, turns, add_generation_prompt=True)
    except ConfigError as e:
      raise APIError(400, f"messages: {e}", param="messages") from None


ABORTED = "the engine stopped or failed before the request finished; retry it"


def _check_not_aborted(choices: list["Choice"]) -> None:
  if any(choice.finish_reason == "abort" for choice in choices):
    raise APIError(500, ABORTED, code="engine_aborted", kind="server_error")


def _aborted_event() -> str:
  return _sse({"error": {"message": ABORTED, "type": "server_error", "param": None, "code": "engine_aborted"}})


def _head(kind: str, model: str) -> dict:
  prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
  return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}


@dataclasses.dataclass
class CompletionPlan:
  """What a completions request asks of the engine, prepared on a worker thread."""

  prompts: list[list[int]]  # token ids of each prompt
  texts: list[str]  # the text of each choice's prompt (echo)
  requests: list  # engine Requests, n per prompt
  wanted: list[int]  # max_tokens of each prompt (0: the prompt's logprobs only)


def plan_completion(server: Server, body: CompletionBody) -> CompletionPlan:
  server.check_model(body)
  prompts, texts = server.completion_prompts(body.prompt)
  wanted = [body.max_tokens] * len(prompts)
  echo_logprobs = body.echo and body.logprobs is not None
  fields = {"logprobs": body.logprobs, "echo": echo_logprobs, "stream": body.stream}
  if echo_logprobs and body.max_tokens <= 1:
    # Scoring (lm-eval's log-likelihood): the one generated token is always returned, EOS or not, so the response's
    # last logprob is the generated token's, as lm-eval expects.
    fields |= {"ignore_eos": True, "stop": (), "stop_token_ids": ()}
  requests = server.requests(prompts, body, [max(m, 1) for m in wanted], **fields)
  return CompletionPlan(prompts, [texts[i // body.n] for i in range(len(requests))], requests, wanted)


async def completions(server: Server, request: fastapi.Request):
  body = await server.body(request, CompletionBody)
  plan = await server.run(plan_completion, server, body)
  submission = Submission(server.engine)
  await server.run(submission.submit, plan.requests)
  choices = [
    Choice(plan.prompts[i // body.n], keep_generated=plan.wanted[i // body.n] > 0) for i in range(len(plan.requests))
  ]
  view = CompletionView(server, body, choices, plan.texts)
  if body.stream:
    return _streaming(view.events(submission), submission)
  await submission.collect(request, choices)
  return await server.run(lambda: responses.JSONResponse(view.response(plan.prompts)))


class CompletionView:
  """Completions' response, whole or as server-sent events."""

  def __init__(self, server: Server, body: CompletionBody, choices: list[Choice], texts: list[str]):
    self.server, self.body, self.choices, self.texts = server, body, choices, texts
    self.logprobs = body.logprobs is not None
    self.head = _head("text_completion", server.options.model_name)
    echo_len = [len(t) if body.echo else 0 for t in texts]
    self.pieces = [Pieces(server.tokenizer, [], 0) for _ in choices]
    self.generated = [Pieces(server.tokenizer, c.prompt_ids, n) for c, n in zip(choices, echo_len, strict=True)]

  def delta(self, index: int, delta: Choice) -> dict:
    """One choice's new part: the prompt first (with echo), then what was generated."""
    first = not delta.started
    text = (self.texts[index] if first and self.body.echo else "") + delta.text
    logprobs = None
    if self.body.logprobs is not None:
      parts = []
      if first and self.body.echo:
        parts.append(self.pieces[index].completion(delta.prompt_ids, delta.prompt_logprobs or [], final=True))
      final = delta.finish_reason is not None
      parts.append(self.generated[index].completion(delta.tokens, delta.logprobs, final))
      logprobs = _join(parts)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

  def response(self, prompts: list[list[int]]) -> dict:
    out = []
    for index, choice in enumerate(self.choices):
      whole = Choice(choice.prompt_ids, tokens=choice.tokens, text=choice.text, logprobs=choice.logprobs)
      whole.prompt_logprobs, whole.finish_reason = choice.prompt_logprobs, choice.finish_reason
      out.append(self.delta(index, whole))
    return {**self.head, "choices": out, "usage": _usage(self.choices, prompts)}

  async def events(self, submission: Submission) -> AsyncIterator[str]:
    try:
      async for index, update in submission.updates():
        delta = self.choices[index].take(update)
        if delta.finish_reason == "abort":
          yield _aborted_event()
          return
        if delta.started and not delta.tokens and not delta.text and delta.finish_reason is None:
          continue
        # With logprobs, each token's text and its alternatives' are decoded: a worker's job.
        part = await self.server.run(self.delta, index, delta) if self.logprobs else self.delta(index, delta)
        yield _sse({**self.head, "choices": [part]})
      if self.body.stream_options is not None and self.body.stream_options.include_usage:
        prompts = [c.prompt_ids for c in self.choices[:: self.body.n]]
        yield _sse({**self.head, "choices": [], "usage": _usage(self.choices, prompts)})
      yield _sse("[DONE]")
    finally:
      submission.cancel_unfinished()


def plan_chat(server: Server, body: ChatBody) -> tuple[list[int], list]:
  """(the conversation's tokens, the engine Requests of its n choices), prepared on a worker thread."""
  server.check_model(body)
  if body.top_logprobs is not None and not body.logprobs:
    raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
  ids = server.chat_prompt(body.messages)
  limit = body.max_completion_tokens or body.max_tokens or server.room(ids)
  logprobs = (body.top_logprobs or 0) if body.logprobs else None
  return ids, server.requests([ids], body, [limit], logprobs=logprobs, stream=body.stream)


async def chat_completions(server: Server, request: fastapi.Request):
  body = await server.body(request, ChatBody)
  ids, requests = await server.run(plan_chat, server, body)
  submission = Submission(server.engine)
  await server.run(submission.submit, requests)
  choices = [Choice(ids) for _ in range(body.n)]
  view = ChatView(server, body, choices)
  if body.stream:
    return _streaming(view.events(submission), submission)
  await submission.collect(request, choices)
  return await server.run(lambda: responses.JSONResponse(view.response()))


class ChatView:
  """Chat completions' response, whole or as `chat.completion.chunk` events."""

  def __init__(self, server: Server, body: ChatBody, choices: list[Choice]):
    self.server, self.body, self.choices = server, body, choices
    self.pieces = [Pieces(server.tokenizer, c.prompt_ids) for c in choices]
    self.model = server.options.model_name

  def _logprobs(self, index: int, choice: Choice) -> dict | None:
    if not self.body.logprobs:
      return None
    return {"content": self.pieces[index].chat(choice.tokens, choice.logprobs, choice.finish_reason is not None)}

  def response(self) -> dict:
    out = [
      {
        "index": i,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": self._logprobs(i, c),
        "finish_reason": c.finish_reason,
      }
      for i, c in enumerate(self.choices)
    ]
    return {
      **_head("chat.completion", self.model),
      "choices": out,
      "usage": _usage(self.choices, [self.choices[0].prompt_ids]),
    }

  async def events(self, submission: Submission) -> AsyncIterator[str]:
    head = _head("chat.completion.chunk", self.model)
    try:
      for i in range(len(self.choices)):
        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield _sse({**head, "choices": [role]})
      async for index, update in submission.updates():
        delta = self.choices[index].take(update)
        if delta.finish_reason == "abort":
          yield _aborted_event()
          return
        if not delta.text and not delta.tokens and delta.finish_reason is None:
          continue
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        logprobs = await self.server.run(self._logprobs, index, delta) if self.body.logprobs else None
        part = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        yield _sse({**head, "choices": [part]})
      if self.body.stream_options is not None and self.body.stream_options.include_usage:
        yield _sse({**head, "choices": [], "usage": _usage(self.choices, [self.choices[0].prompt_ids])})
      yield _sse("[DONE]")
    finally:
      submission.cancel_unfinished()


def _add_error_handlers(app: fastapi.FastAPI) -> None:
  async def api_error(request, error: APIError):
    return error_response(error)

  async def http_error(request, error: starlette.exceptions.HTTPException):
    code = "not_found" if error.status_code == 404 else None
    return error_response(APIError(error.status_code, f"{request.method} {request.url.path}: {error.detail}", code=code))

  async def validation_error(request, error: fastapi.exceptions.RequestValidationError):
    first = dict(error.errors()[0])
    first["loc"] = tuple(first["loc"])[1:]  # ("body", field, ...)
    return error_response(_validation_error(first))

  async def internal_error(request, error: Exception):
    return error_response(APIError(500, f"internal error ({type(error).__name__}); the server logged it"))

  app.add_exception_handler(APIError, api_error)
  app.add_exception_handler(starlette.exceptions.HTTPException, http_error)
  app.add_exception_handler(fastapi.exceptions.RequestValidationError, validation_error)
  app.add_exception_handler(Exception, internal_error)


def create_app(engine, tokenizer: tokenizer_lib.Tokenizer, config_or_options: Config | Options) -> fastapi.FastAPI:
  """The OpenAI-compatible app over a started `engine` (inference/engine.py's interface) and its tokenizer."""
  options = config_or_options if isinstance(config_or_options, Options) else Options.from_config(config_or_options)
  try:
    template = sft.compile_template(options.chat_template)
  except ConfigError as e:
    raise ConfigError(f"chat template: {e}") from None
  server = Server(engine, tokenizer, options, template)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    yield
    server.stopping = True
    server.workers.shutdown(wait=False, cancel_futures=True)

  def authorize(request: fastapi.Request) -> None:
    if not options.api_key:
      return
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), options.api_key.encode()):
      raise APIError(401, "missing or wrong API key; send `Authorization: Bearer KEY`", code="invalid_api_key")

  app = fastapi.FastAPI(title="MaxText", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
  app.state.server = server
  _add_error_handlers(app)
  api = fastapi.APIRouter(dependencies=[fastapi.Depends(authorize)])

  @api.post("/v1/completions")
  async def post_completions(request: fastapi.Request):
    return await completions(server, request)

  @api.post("/v1/chat/completions")
  async def post_chat_completions(request: fastapi.Request):
    return await chat_completions(server, request)

  _add_info_routes(api, server)
  app.include_router(api)

  @app.get("/health")
  async def health():  # On the event loop itself: it answers while workers are busy.
    running = getattr(engine, "running", None)  # Engine.running(): its scheduling thread is alive.
    if server.stopping or (callable(running) and not running()):
      raise APIError(503, "the engine is not running", code="engine_stopped")
    return {}

  return app


def _add_info_routes(api: fastapi.APIRouter, server: Server) -> None:
  created = int(time.time())
  tokenizer, options = server.tokenizer, server.options

  @api.get("/v1/models")
  def models():
    card = {"id": options.model_name, "object": "model", "created": created, "owned_by": "maxtext"}
    return {"object": "list", "data": [{**card, "root": options.model_name, "max_model_len": server.engine.max_length}]}

  @api.get("/tokenizer_info")
  def tokenizer_info():
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    specials = {name: tokenizer.special_tokens.get(name) for name in names}
    return {**specials, "chat_template": options.chat_template, "model_max_length": server.engine.max_length}

  @api.post("/tokenize")
  async def tokenize(request: fastapi.Request):
    body = await server.body(request, TokenizeBody)

    def work():
      bos = [tokenizer.bos_id] if body.add_special_tokens and options.add_bos and tokenizer.bos_id >= 0 else []
      tokens = bos + tokenizer.encode_with_specials(body.prompt)
      rest = f', "count": {len(tokens)}, "max_model_len": {server.engine.max_length}}}'
      return responses.Response('{"tokens": ' + _json_ints(tokens) + rest, media_type="application/json")

    return await server.run(work)

  @api.post("/detokenize")
  async def detokenize(request: fastapi.Request):
    body = await server.body(request, DetokenizeBody)

    def work():
      _check_ids(body.tokens, tokenizer.vocab_size, "tokens")
      return responses.JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    return await server.run(work)


def _json_ints(values: list[int], piece: int = 1 << 16) -> str:
  """A JSON array of ints, rendered a piece at a time (json.dumps of a whole long list holds the GIL throughout)."""
  return "[" + ",".join(json.dumps(values[i : i + piece])[1:-1] for i in range(0, len(values), piece) if values) + "]"


# ------------------------------------------------------------------------------------------------ command line
def listen(host: str, port: int) -> socket.socket:
  """A listening socket on host:port; ConfigError (one line) when the address is taken or not this machine's."""
  try:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
  except OSError as e:
    raise ConfigError(
      f"server_host={host} server_port={port}: cannot listen there ({e.strerror or e}); pick another port or host"
    ) from None
  sock.listen(2048)
  return sock


def compile_programs(engine) -> None:
  """engine.warmup(), saying what it compiles and how far it got (a line at least every PROGRESS_SECONDS), since
  the first request may only come after it: every prefill size and generate shape compiled now, so that no
  request waits for a compile."""
  programs = engine.programs()
  prefill = sum(program.name == "prefill" for program in programs)
  cli.log(
    f"Compiling the engine's programs before serving: {counted(prefill, 'prefill size')} and "
    f"{counted(len(programs) - prefill, 'generate shape')} (rows x pages read), {counted(len(programs), 'program')}"
  )
  start = last = time.perf_counter()

  def progress(i: int, program) -> None:
    nonlocal last
    now = time.perf_counter()
    if now - last >= PROGRESS_SECONDS or i == len(programs):
      cli.log(f"  compiled {i}/{len(programs)} ({program}), {now - start:.1f} s so far")
      last = now

  engine.warmup(progress)
  cli.log(f"Compiled the engine's programs in {engine.stats['compile_seconds']:.1f} s")


class TimedH11Protocol(H11Protocol):
  """uvicorn's HTTP/1.1 protocol (h11), with a deadline for each request's headers: uvicorn's only timeout is for
  an idle kept-alive connection, so a client that sends its headers a byte at a time (or nothing after connecting)
  held its socket forever. `read_timeout` seconds after a connection opens or a response ends, a connection whose
  next request the app has not received is answered 408 and closed (the app bounds reading the body itself,
  read_body). Subclassed by `uvicorn_config` with the value."""

  read_timeout = 30.0

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    self._deadline = None
    self._arm()

  def handle_events(self) -> None:
    super().handle_events()
    if self._app_has_it() and self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None

  def on_response_complete(self) -> None:
    super().on_response_complete()
    self._arm()

  def connection_lost(self, exc) -> None:
    if self._deadline is not None:
      self._deadline.cancel()
      self._deadline = None
    super().connection_lost(exc)

  def _app_has_it(self) -> bool:
    return self.cycle is not None and not self.cycle.response_complete

  def _arm(self) -> None:
    if self._deadline is not None:
      self._deadline.cancel()
    closing = self.transport.is_closing()
    self._deadline = None if closing else self.loop.call_later(self.read_timeout, self._expire)

  def _expire(self) -> None:
    self._deadline = None
    if self._app_has_it() or self.transport.is_closing():
      return
    if self.conn.their_state is h11.IDLE:  # its headers did not come (else: the rest of a body already answered)
      self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
    self.transport.close()


def uvicorn_config(app: fastapi.FastAPI, **kw) -> uvicorn.Config:
  """uvicorn's config for an app of create_app: TimedH11Protocol with its options' read_timeout."""
  seconds = app.state.server.options.read_timeout
  protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"read_timeout": seconds})
  return uvicorn.Config(app, http=protocol, **kw)


def serve(config: Config) -> int:
  """Binds first (a taken port fails before the checkpoint loads), then loads the engine and serves until SIGINT or
  SIGTERM; the engine stops as the server does."""
  options = Options.from_config(config)
  if jax.process_count() > 1:
    raise ConfigError(
      f"serve.py runs in one process (this job has {jax.process_count()}): its scheduler and HTTP server are one "
      "process's; serve on one host's devices"
    )
  sock = listen(config.server_host, config.server_port)
  loopback = config.server_host in ("127.0.0.1", "localhost", "::1")
  if not loopback and not options.api_key:
    print(
      f"warning: server_host={config.server_host} with no server_api_key: anyone who reaches it can use it", file=sys.stderr
    )
  cli.log(f"Loading the model and its parameters ({config.load_parameters_path or 'the latest checkpoint of run_name'})")
  engine, tokenizer = engine_lib.Engine.from_config(config, max_queue=config.server_max_queue)
  cli.log(f"Parameters from {engine.loaded_from}")
  app = create_app(engine, tokenizer, options)
  compile_programs(engine)
  engine.start()
  try:
    host, port = sock.getsockname()[:2]
    cli.log(f"Serving {options.model_name!r} at http://{host}:{port}/v1 (GET /health, /v1/models)")
    # SIGINT or SIGTERM: new connections are refused, and streams still open after 5 s are cut (their requests then
    # end as engine.stop() aborts them).
    with _stop_signals_end_quietly():
      uvicorn.Server(uvicorn_config(app, log_level="info", timeout_graceful_shutdown=5)).run(sockets=[sock])
  finally:
    engine.stop()
    sock.close()
  cli.log("Stopped")
  return 0


@contextlib.contextmanager
def _stop_signals_end_quietly():
  """uvicorn stops on SIGINT or SIGTERM, then raises the signal again for the handler it found: with these no-op
  handlers that second raise does nothing, so a stopped server exits 0 (after engine.stop) instead of as killed."""
  if threading.current_thread() is not threading.main_thread():  # Python delivers signals to the main thread only.
    yield
    return
  previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def main(argv) -> int:
  return cli.run_cli(serve, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
