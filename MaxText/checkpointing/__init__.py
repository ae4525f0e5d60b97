"""Every checkpoint rule, one module per reason to change; callers use this package's names (`checkpointing.save`).

paths.py       where a run's checkpoints live, which of them are complete, the checkpoint paths a config names
save.py        writing checkpoints: a run's (Orbax's CheckpointManager), params-only and quantized ones
restore.py     what a run starts from (resume, full state, params, fresh init); parameters for decoding and export
compatible.py  whether a checkpoint fits the config, from its metadata, before anything is read
damage.py      checksums verified on restore; what makes a checkpoint damaged, and setting it aside
adapters.py    LoRA adapters: which checkpoints hold them, fresh ones under a base model, a PEFT folder's
processes.py   what the processes of a multi-process job agree on (one run folder, damage, preemption)
disk.py        a full disk: no save starts that cannot fit, and one that runs out of space ends the run in one line
"""

from MaxText.checkpointing.adapters import stores_adapters
from MaxText.checkpointing.compatible import check_compatible, check_start_paths
from MaxText.checkpointing.damage import drop_abandoned_io, verify
from MaxText.checkpointing.disk import check_room, full_disk_stops_the_run, out_of_space
from MaxText.checkpointing.paths import (
  CHECKSUM_ITEM,
  DATA_ITEM,
  ITEM,
  check_new_params_dir,
  checkpoint_dir,
  items_path,
  latest_step,
  params_path,
  run_dir,
)
from MaxText.checkpointing.processes import check_shared_run_dir, reached_preemption
from MaxText.checkpointing.restore import (
  StartingPoint,
  load_params,
  restore_data,
  restore_host_params,
  restore_or_init,
  restore_params,
)
from MaxText.checkpointing.save import create_manager, save, save_params, save_quantized_params, write_checksums

__all__ = [
  "CHECKSUM_ITEM",
  "DATA_ITEM",
  "ITEM",
  "StartingPoint",
  "check_compatible",
  "check_new_params_dir",
  "check_room",
  "check_shared_run_dir",
  "check_start_paths",
  "checkpoint_dir",
  "create_manager",
  "drop_abandoned_io",
  "full_disk_stops_the_run",
  "items_path",
  "latest_step",
  "load_params",
  "out_of_space",
  "params_path",
  "reached_preemption",
  "restore_data",
  "restore_host_params",
  "restore_or_init",
  "restore_params",
  "run_dir",
  "save",
  "save_params",
  "save_quantized_params",
  "stores_adapters",
  "verify",
  "write_checksums",
]
