"""The asyncio bridge (server/bridge.py): engine updates, sent from the engine's thread, reach the event loop in
order per choice; a request the engine refuses submits none of its choices; what is unfinished is cancelled."""

import asyncio
import threading

import pytest

from MaxText.inference.request import QueueFull, Request, RequestError, Update
from MaxText.server.bridge import Choice, Submission
from MaxText.server.protocol import APIError


class Engine:
  """Takes requests, and sends their updates from another thread when told to."""

  max_queue = 4

  def __init__(self, refuse: Exception | None = None, refuse_at: int = 0):
    self.callbacks, self.cancelled, self.refuse, self.refuse_at = [], [], refuse, refuse_at

  def check(self, request: Request) -> None:
    if self.refuse is not None and isinstance(self.refuse, RequestError) and request.max_tokens == self.refuse_at:
      raise self.refuse

  def submit(self, request: Request, on_update) -> int:
    if self.refuse is not None and not isinstance(self.refuse, RequestError) and len(self.callbacks) == self.refuse_at:
      raise self.refuse
    self.callbacks.append(on_update)
    return len(self.callbacks) - 1

  def cancel(self, request_id: int) -> None:
    self.cancelled.append(request_id)


def _send(engine: Engine, updates: list[tuple[int, Update]]) -> threading.Thread:
  thread = threading.Thread(target=lambda: [engine.callbacks[i](u) for i, u in updates])
  thread.start()
  return thread


def test_updates_from_the_engines_thread_reach_each_choice_in_order():
  async def run():
    engine = Engine()
    submission = Submission(engine)
    submission.submit([Request((1,), 3), Request((1,), 3)])
    updates = [
      (0, Update([5], "a", None)),
      (1, Update([6], "b", None)),
      (0, Update([7], "c", None, finish_reason="length")),
      (1, Update([], "", None, finish_reason="stop", stop_token=2)),
    ]
    thread = _send(engine, updates)
    choices = [Choice([1]), Choice([1])]
    async for index, update in submission.updates():
      choices[index].take(update)
    thread.join()
    return choices, engine.cancelled

  choices, cancelled = asyncio.run(run())
  assert [(c.tokens, c.text, c.finish_reason) for c in choices] == [([5, 7], "ac", "length"), ([6], "b", "stop")]
  assert cancelled == []  # every choice finished: nothing to cancel


def test_a_refused_choice_submits_none_and_a_full_queue_cancels_those_submitted():
  async def run(engine, n):
    submission = Submission(engine)
    with pytest.raises(APIError) as raised:
      submission.submit([Request((1,), m) for m in range(1, n + 1)])
    return raised.value, engine

  error, engine = asyncio.run(run(Engine(RequestError("max_tokens=2: too many"), refuse_at=2), 3))
  assert (error.status, error.param, engine.callbacks) == (400, "max_tokens", [])
  error, engine = asyncio.run(run(Engine(QueueFull("4 requests wait"), refuse_at=1), 2))
  assert (error.status, error.code, engine.cancelled) == (503, "queue_full", [0])
  error, engine = asyncio.run(run(Engine(), 5))  # more choices than the queue holds: never submittable
  assert (error.status, error.param, engine.callbacks) == (400, "n", [])


def test_choices_left_unfinished_are_cancelled_once():
  async def run():
    engine = Engine()
    submission = Submission(engine)
    submission.submit([Request((1,), 3)] * 3)
    _send(engine, [(1, Update([4], "x", None, finish_reason="length"))]).join()
    async for _ in submission.updates():
      break
    submission.cancel_unfinished()
    submission.cancel_unfinished()
    return engine.cancelled

  assert asyncio.run(run()) == [0, 2]
