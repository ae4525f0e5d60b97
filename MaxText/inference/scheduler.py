"""The scheduler: the queue of waiting requests, the decode slots they run in, and the policies between them.

Admission is first come, first served: the request at the head of the queue takes the next idle slot when the KV
cache manager can reserve every page its prompt and max_tokens may need (kv_cache_manager.py); until then the
requests behind it wait too, so a long request is never starved by short ones. Since a running request holds its
whole reservation, no request is ever preempted: a slot is given back only when its request ends or is cancelled.

The queue is shared with the threads that submit and cancel (`lock`); the slots are the engine thread's alone.
While a streamed request runs (Request.stream), a generate call runs only the steps that fit in stream_interval_ms,
as measured per batch shape (`steps_now`), so its client gets its tokens every few tens of ms instead of in bursts.
"""

import collections
import dataclasses
import threading
from collections.abc import Callable

from MaxText.inference.output import RequestOutput
from MaxText.inference.request import QueueFull, Request


@dataclasses.dataclass(eq=False)
class Entry:
  """A request in the scheduler: waiting, then in a slot until it ends."""

  id: int
  request: Request
  output: RequestOutput  # what it has produced, and its caller's callback
  seed: int | None = None  # drawn when its prefill starts, unless the request gives one
  prefilled: int = 0  # prompt tokens in its pages (the prefix cache's included)


class Scheduler:
  def __init__(self, num_slots: int, max_queue: int):
    self.num_slots, self.max_queue = num_slots, max_queue
    self.slots: list[Entry | None] = [None] * num_slots
    self.waiting: collections.deque[Entry] = collections.deque()
    self.lock = threading.Condition()
    self._cancelled: set[int] = set()
    self._next_id = 0
    self.stopping = False

  def add(self, request: Request, output: RequestOutput, bounded: bool = True) -> int:
    """Queues a request (QueueFull past max_queue when `bounded`); returns its id."""
    with self.lock:
      if bounded and len(self.waiting) >= self.max_queue:
        raise QueueFull(f"{len(self.waiting)} requests wait already (the queue holds {self.max_queue})")
      entry = Entry(self._next_id, request, output)
      self._next_id += 1
      self.waiting.append(entry)
      self.lock.notify()
    return entry.id

  def cancel(self, request_id: int) -> None:
    with self.lock:
      self._cancelled.add(request_id)
      self.lock.notify()

  def take_cancelled(self) -> list[int]:
    """Drops the cancelled requests that still wait; returns the slots whose request was cancelled (to free)."""
    with self.lock:
      cancelled, self._cancelled = self._cancelled, set()
      self.waiting = collections.deque(e for e in self.waiting if e.id not in cancelled)
    return [slot for slot, entry in enumerate(self.slots) if entry is not None and entry.id in cancelled]

  def admit(self, reserve: Callable[[int, Entry], bool]) -> None:
    """Moves waiting requests into idle slots in order, while `reserve(slot, entry)` finds their pages."""
    for slot in range(self.num_slots):
      if self.slots[slot] is not None:
        continue
      with self.lock:
        if not self.waiting:
          return
        entry = self.waiting[0]
      if not reserve(slot, entry):
        return  # Waits for pages (first come, first served).
      with self.lock:
        self.waiting.popleft()
      self.slots[slot] = entry

  def prefilling(self) -> list[tuple[int, Entry]]:
    """The slots whose prompt is not all prefilled yet."""
    return [(s, e) for s, e in enumerate(self.slots) if e is not None and e.prefilled < len(e.request.prompt)]

  def release(self, slot: int) -> Entry:
    entry, self.slots[slot] = self.slots[slot], None
    return entry

  def has_waiting(self) -> bool:
    with self.lock:
      return bool(self.waiting)

  def busy(self) -> bool:
    return bool(self.waiting) or any(entry is not None for entry in self.slots)

  def wait_for_work(self) -> bool:
    """Blocks until there is work (a request, a cancellation) or a stop; False on a stop."""
    with self.lock:
      while not self.stopping and not self.busy() and not self._cancelled:
        self.lock.wait()
      return not self.stopping

  def set_stopping(self, stopping: bool) -> None:
    with self.lock:
      self.stopping = stopping
      self.lock.notify()

  def drain(self) -> list[Entry]:
    """Empties the queue; returns what waited."""
    with self.lock:
      waiting, self.waiting = list(self.waiting), collections.deque()
    return waiting

  def steps_now(self, active: list[int], steps: int, per_step: float | None, interval: float) -> int:
    """Steps for the next generate call: `steps`, or while a streaming request runs as many as its measured step
    time (`per_step` seconds for the call's shape, None before it was timed) fits in `interval` seconds (one until
    it has been timed). From this process's clock: streaming is the server's, which runs in one process (a
    multi-process job's calls must agree, and never stream)."""
    if interval <= 0 or not any(self.slots[slot].request.stream for slot in active):
      return steps
    if per_step is None:
      return 1
    return max(1, min(steps, int(interval / per_step)))
