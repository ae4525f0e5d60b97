"""What the processes of a multi-process job must agree on: one run directory that every process sees (each writes
its shards of every checkpoint there), one verdict on a checkpoint's damage (each reads its own shards and data
state, and none may be left waiting in a collective the others skipped), and a preemption notice to any process
meaning that every process saves and stops. In a single-process run each is answered without a collective.
"""

import jax
import numpy as np

from MaxText import storage
from MaxText.checkpointing.paths import run_dir
from MaxText.common_types import Config, ConfigError


def check_shared_run_dir(config: Config) -> None:
  """In a multi-process job every process writes its shards of each checkpoint into the run directory, so all of
  them must see one folder: process 0 writes a marker there, and every process must find it."""
  if jax.process_count() == 1 or not config.enable_checkpointing:
    return
  from jax.experimental import multihost_utils

  directory = run_dir(config)
  token = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.default_rng().integers(2**31 - 1))))
  marker = storage.join(directory, f".shared_by_all_processes_{token}")
  if jax.process_index() == 0:
    storage.makedirs(directory)
    storage.write_text(marker, "")
  multihost_utils.sync_global_devices("marker written")
  seen = multihost_utils.process_allgather(np.bool_(storage.exists(marker)))
  multihost_utils.sync_global_devices("marker checked")
  if jax.process_index() == 0:
    storage.remove(marker)
  if not np.all(seen):
    blind = [int(i) for i in np.flatnonzero(~np.asarray(seen))]
    raise ConfigError(
      f"base_output_directory={config.base_output_directory}: process(es) {blind} of {jax.process_count()} do not "
      "see what process 0 writes there; checkpoints of a multi-process job need a folder every host shares "
      "(NFS, a mounted bucket), or set enable_checkpointing=false"
    )


def _all_processes_agree(ok: bool) -> bool:
  """Whether `ok` holds on every process (each reads its own shards and data state)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  return bool(np.all(multihost_utils.process_allgather(np.bool_(ok))))


def reached_preemption(manager, step: int) -> bool:
  """Whether a SIGTERM (a preemption or maintenance notice) to any process of a multi-process job means every
  process saves and stops after `step`; JAX's preemption service runs only in such a job."""
  return manager is not None and jax.distributed.is_initialized() and manager.reached_preemption(step)
