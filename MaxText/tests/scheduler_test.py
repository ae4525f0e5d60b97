"""The scheduler (inference/scheduler.py): first come, first served admission into idle slots, the bounded queue,
cancellation, and how many steps a generate call runs while a client streams."""

import pytest

from MaxText.inference.output import RequestOutput
from MaxText.inference.request import QueueFull, Request
from MaxText.inference.scheduler import Scheduler


def _add(scheduler: Scheduler, max_tokens: int, stream: bool = False, bounded: bool = True) -> int:
  request = Request((1, 2), max_tokens, stream=stream)
  return scheduler.add(request, RequestOutput(request, lambda update: None), bounded)


def test_requests_take_idle_slots_in_order_and_the_head_blocks_the_rest():
  """Three slots, one busy; pages for requests of max_tokens <= 5 only: the first waiting (3) is admitted, the
  second (9) does not fit, so the third (2), which would, waits behind it (no overtaking: none starves)."""
  scheduler = Scheduler(num_slots=3, max_queue=8)
  busy = _add(scheduler, 1)
  scheduler.admit(lambda slot, entry: True)
  ids = [_add(scheduler, n) for n in (3, 9, 2)]
  tried = []

  def reserve(slot, entry):
    tried.append((slot, entry.id))
    return entry.request.max_tokens <= 5

  scheduler.admit(reserve)
  assert [e.id if e else None for e in scheduler.slots] == [busy, ids[0], None]
  assert tried == [(1, ids[0]), (2, ids[1])] and [e.id for e in scheduler.waiting] == ids[1:]
  assert [slot for slot, _ in scheduler.prefilling()] == [0, 1]


def test_the_queue_is_bounded_but_for_the_callers_own_batch():
  scheduler = Scheduler(num_slots=1, max_queue=2)
  _add(scheduler, 1)
  _add(scheduler, 1)
  with pytest.raises(QueueFull, match="2 requests wait already"):
    _add(scheduler, 1)
  _add(scheduler, 1, bounded=False)  # Engine.generate queues its whole batch
  assert len(scheduler.waiting) == 3


def test_a_cancelled_request_leaves_the_queue_or_names_its_slot():
  scheduler = Scheduler(num_slots=2, max_queue=8)
  running, waiting, other = _add(scheduler, 1), _add(scheduler, 1), _add(scheduler, 1)
  scheduler.admit(lambda slot, entry: entry.id == running)
  scheduler.cancel(running)
  scheduler.cancel(waiting)
  assert scheduler.take_cancelled() == [0]
  assert [e.id for e in scheduler.waiting] == [other] and scheduler.take_cancelled() == []


def test_a_streaming_request_shortens_the_calls_to_the_interval():
  """8 steps a call; with a streamed request and 20 ms: 1 step until the shape is timed, then 20 ms / 3 ms = 6,
  at least 1 (50 ms per step) and at most 8 (1 ms); no streamed request, or an interval of 0: all 8."""
  scheduler = Scheduler(num_slots=2, max_queue=8)
  _add(scheduler, 4)
  _add(scheduler, 4, stream=True)
  scheduler.admit(lambda slot, entry: True)
  assert scheduler.steps_now([0], 8, 0.003, 0.02) == 8
  assert scheduler.steps_now([0, 1], 8, 0.003, 0.0) == 8
  assert [scheduler.steps_now([0, 1], 8, s, 0.02) for s in (None, 0.003, 0.05, 0.001)] == [1, 6, 1, 8]
