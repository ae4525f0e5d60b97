"""The app's state (`Server`): the engine, the tokenizer, the options and the compiled chat template, and the worker
threads that do a request's CPU work (parsing, validating, tokenizing, rendering), so that the event loop only moves
bytes; with what every route shares: reading a body, the sampling fields, the engine Requests of a body."""

import asyncio
import concurrent.futures
import dataclasses
import functools
from typing import Any

import fastapi

from MaxText.inference import request as request_lib
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.server.options import Options
from MaxText.server.protocol import (
  MAX_CHOICES,
  APIError,
  Body,
  Limits,
  SamplingBody,
  parse_json,
  read_body,
  stop_of,
  validate,
)

WORKERS = 4  # threads that parse, validate, tokenize and render requests, off the event loop


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

  async def body(self, request: fastapi.Request, model: type[Body]) -> Any:
    """The request's body, read within server_read_timeout, parsed and validated as `model` on a worker thread."""
    raw = await read_body(request, self.options.read_timeout)
    return await self.run(lambda: validate(parse_json(raw), model, self.limits))

  def sampling(self, body: SamplingBody, **fields) -> dict:
    stop, stop_ids = stop_of(body, self.tokenizer.vocab_size)
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

  def requests(self, prompts: list[list[int]], body: SamplingBody, max_tokens: list[int], **fields) -> list:
    """n engine Requests per prompt, choice i*n+j (seeds seed, seed+1, ... when a seed is given)."""
    if len(prompts) * body.n > MAX_CHOICES:
      raise APIError(400, f"{len(prompts)} prompts x n={body.n} is over {MAX_CHOICES} choices; send fewer", param="n")
    sampling = self.sampling(body, **fields)
    return [
      request_lib.Request(
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

  def check_model(self, body: SamplingBody) -> None:
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
