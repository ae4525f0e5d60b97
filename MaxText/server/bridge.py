"""The asyncio bridge between an HTTP request and the engine: the engine's Updates (sent on its thread) reach the
event loop through a queue, each into its `Choice`; the requests of a client that goes are cancelled."""

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator
from typing import Any

import fastapi

from MaxText.inference import request as request_lib
from MaxText.server.protocol import APIError, param_of

POLL_SECONDS = 0.25  # how often a non-streamed request looks for its client's disconnect.
ABORTED = "the engine stopped or failed before the request finished; retry it"


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
    except request_lib.RequestError as e:
      self.cancel_unfinished()
      raise APIError(400, str(e), param=param_of(str(e))) from None
    except request_lib.QueueFull as e:
      self.cancel_unfinished()
      raise APIError(503, f"the server is busy ({e}); retry later", code="queue_full") from None
    except request_lib.EngineFailed as e:
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
    check_not_aborted(choices)

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


def check_not_aborted(choices: list["Choice"]) -> None:
  if any(choice.finish_reason == "abort" for choice in choices):
    raise APIError(500, ABORTED, code="engine_aborted", kind="server_error")
