"""A full disk. A local save never starts on a disk that cannot hold it (check_room: the newest checkpoint's size, or
the state's for the first); one that runs out of space all the same, however Orbax or TensorStore wrapped the error
(out_of_space), ends the run with one line naming the checkpoint to resume from (full_disk_stops_the_run). Orbax
writes into a temporary folder, so earlier checkpoints stay intact. A multi-process job, whose processes would have
to agree on the room check, has only that error path; a bucket has neither (its errors are the storage layer's).
"""

import contextlib
import errno
import math
import os
import shutil

import jax
import numpy as np

from MaxText import metrics, storage
from MaxText.checkpointing.paths import checkpoint_dir, complete_steps
from MaxText.common_types import Config, TrainingError
from MaxText.state import StateLayout, TrainState


def out_of_space(error: BaseException | None) -> bool:
  """Whether `error`, or an error it was raised from, is a full disk (ENOSPC), however Orbax or TensorStore
  wrapped it (some carry only the system's text)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if (isinstance(error, OSError) and error.errno == errno.ENOSPC) or "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


@contextlib.contextmanager
def full_disk_stops_the_run(config: Config, layout: StateLayout):
  """A save that fails for want of space ends the run with one line (check_room refuses to start one that
  cannot fit; this catches what it cannot foresee, at once: the loop checks Orbax's background save after every
  step). Orbax writes into a temporary folder, so earlier checkpoints stay intact. A metrics output that cannot
  be written (TensorBoard's events or the metrics file, on the same full disk) ends it with its own line."""
  try:
    yield
  except metrics.WriteError as e:
    raise TrainingError(str(e)) from None
  except Exception as e:
    directory = checkpoint_dir(config)
    if not out_of_space(e) or storage.is_remote(directory):
      raise
    while not os.path.isdir(directory):  # (no save has made it yet)
      directory = os.path.dirname(directory)
    free = shutil.disk_usage(directory).free
    raise TrainingError(_full_disk(config, _checkpoint_bytes(config, layout.abstract), free)) from None


def check_room(config: Config, manager, state: TrainState) -> None:
  """Refuses to start a local save that the disk cannot hold (measured against the newest checkpoint, or the
  state's size for the first), so a full disk never leaves a half-written save behind. A save still in flight
  has not taken all its space yet: when space is short, it is waited for and the disk measured again. In a
  multi-process job the processes would have to agree, so only the error path of full_disk_stops_the_run applies."""
  directory = checkpoint_dir(config)
  if storage.is_remote(directory) or jax.process_count() > 1:
    return
  need = _checkpoint_bytes(config, state)
  os.makedirs(directory, exist_ok=True)  # The first save makes the folder (nothing is written before the run fits).
  if shutil.disk_usage(directory).free < 2 * need:
    manager.wait_until_finished()
    free = shutil.disk_usage(directory).free
    if free < need:
      raise TrainingError(_full_disk(config, need, free))


def _checkpoint_bytes(config: Config, state) -> int:
  """What the next checkpoint will take: the space the newest complete one takes on disk, else the state's
  bytes plus 64 KiB of metadata; and 1% more."""
  steps = complete_steps(config)
  if steps:
    newest = os.path.join(checkpoint_dir(config), str(steps[-1]))
    size = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(newest) for f in files)
  else:
    size = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)) + 2**16
  return int(size * 1.01)


def _full_disk(config: Config, need: int, free: int) -> str:
  steps = complete_steps(config)
  then = f"resume from checkpoint {steps[-1]}" if steps else "start afresh (no checkpoint is complete)"
  return (
    f"no space left on device for a checkpoint in {checkpoint_dir(config)} (it needs about "
    f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free); free space, then run the same command again to {then}"
  )
