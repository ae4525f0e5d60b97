"""The OpenAI protocol's side of the server: request bodies (pydantic, typed strictly), the sizes a request may have,
validation in the order that keeps it cheap (sizes by len() first, then lone surrogates, then types), and errors in
OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, naming the field."""

import asyncio
import dataclasses
import json
import re
from typing import Any

import fastapi
import pydantic
from fastapi import responses
from pydantic import Field

from MaxText.common_types import shown

MAX_BODY_BYTES = 32 << 20  # A request body past this is refused (413): prompts are at most a few MB of token ids.
MAX_CHOICES = 1024  # prompts x n in one request, so that one request cannot allocate without bound.
MAX_STOP = 64  # stop strings or stop token ids in one request.
MAX_STOP_CHARS = 256  # characters of one stop string: each round looks for the end of a stop string in the text.
MAX_MESSAGES = 4096  # messages, and content parts, of one conversation.
MAX_LOGPROBS = 5  # the engine's limit (OpenAI's for completions).
# Bodies up to this size are parsed by json's C scanner, which holds the GIL throughout (at most ~0.1 s for 1 MB of
# the slowest shape, `[[],[],...`); larger ones by its Python scanner, which the event loop can interrupt.
FAST_JSON_BYTES = 1 << 20


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


def param_of(message: str) -> str | None:
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


def validation_error(first: dict) -> APIError:
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


class Body(pydantic.BaseModel):
  """Fields are typed strictly (a known field of the wrong type is a 400); unknown ones are ignored."""

  model_config = pydantic.ConfigDict(extra="ignore", strict=True)

  @pydantic.model_validator(mode="before")
  @classmethod
  def _null_is_default(cls, data):
    """A field given as null takes its default, as OpenAI's API does (clients send nulls for what they omit)."""
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
  include_usage: bool = False


class SamplingBody(Body):
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


class CompletionBody(SamplingBody):
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int = Field(16, ge=0)  # OpenAI's default
  echo: bool = False
  logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ContentPart(Body):
  type: str
  text: str | None = None


class Message(Body):
  role: str
  content: str | list[ContentPart] | None = None


class ChatBody(SamplingBody):
  messages: list[Message] = Field(min_length=1)
  max_tokens: int | None = Field(None, ge=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeBody(Body):
  prompt: str
  add_special_tokens: bool = True


class DetokenizeBody(Body):
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


def validate(body: dict, model: type[Body], limits: Limits) -> Any:
  """`body` checked for size, then for text, then as `model` (a 400 naming the field for each); on a worker thread."""
  check_sizes(body, limits)
  check_text(body, model.model_fields)
  try:
    return model.model_validate(body)
  except pydantic.ValidationError as e:
    raise validation_error(e.errors(include_url=False)[0]) from None


def stop_of(body: SamplingBody, vocab_size: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
  stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
  if len(stop) > MAX_STOP:
    raise APIError(400, f"stop has {len(stop)} strings; give at most {MAX_STOP}", param="stop")
  if "" in stop:
    raise APIError(400, f"stop[{stop.index('')}] is empty; a stop string needs a character", param="stop")
  ids = list(body.stop_token_ids or [])
  check_ids(ids, vocab_size, "stop_token_ids")
  return tuple(stop), tuple(ids)


def check_ids(ids: list[int], vocab_size: int, name: str) -> None:
  for i, token in enumerate(ids):
    if not 0 <= token < vocab_size:
      raise APIError(400, f"{name}[{i}]={token} is not a token id of this model (0 to {vocab_size - 1})", param=name)
