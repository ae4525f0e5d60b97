"""Every checkpoint rule in one place: where they live, when they are written, what a run starts from.

A run's checkpoints are `{base_output_directory}/{run_name}/checkpoints/<step>/items`, where <step> is the
number of completed optimizer steps. Orbax writes each one into a temporary folder and renames it when
complete, so a save cut short (even by kill -9) is never listed as a checkpoint; leftovers are removed
when the run restarts. What a run starts from, first match wins:

  1. the latest checkpoint of its own run directory (resume: params, optimizer, step, and for text
     pipelines the Grain iterator's state, one JSON file per process under `<step>/data`; the synthetic
     data position and the dropout RNG are functions of the step),
  2. load_full_state_path (a whole train state),
  3. load_parameters_path (params only; fresh optimizer at step 0),
  4. a fresh init from init_weights_seed.
"""

import dataclasses
import errno
import json
import os
import re

import jax
import numpy as np

from MaxText.common_types import Config, ConfigError
from MaxText.layers import models
from MaxText.state import StateLayout, TrainState, init_state, params_layout, state_from_params

ITEM = "items"
DATA_ITEM = "data"


class _DataSnapshot:
  """The data iterator's state captured at save time (the save itself may finish in the background)."""

  def __init__(self, state: dict):
    self.state = state

  def get_state(self) -> bytes:
    return json.dumps(self.state).encode()


def run_dir(config: Config) -> str:
  """{base_output_directory}/{run_name}: what a run writes (checkpoints, tensorboard, config.yml)."""
  if not config.run_name:
    raise ConfigError("run_name is empty; pass run_name=NAME (output goes to base_output_directory/NAME)")
  return os.path.join(config.base_output_directory, config.run_name)  # Absolute: pyconfig.parse made it so.


def checkpoint_dir(config: Config) -> str:
  return os.path.join(run_dir(config), "checkpoints")


def check_shared_run_dir(config: Config) -> None:
  """In a multi-process job every process writes its shards of each checkpoint into the run directory, so all of
  them must see one folder: process 0 writes a marker there, and every process must find it."""
  if jax.process_count() == 1 or not config.enable_checkpointing:
    return
  from jax.experimental import multihost_utils

  directory = run_dir(config)
  token = int(multihost_utils.broadcast_one_to_all(np.int32(np.random.default_rng().integers(2**31 - 1))))
  marker = os.path.join(directory, f".shared_by_all_processes_{token}")
  if jax.process_index() == 0:
    os.makedirs(directory, exist_ok=True)
    with open(marker, "w", encoding="utf-8"):
      pass
  multihost_utils.sync_global_devices("marker written")
  seen = multihost_utils.process_allgather(np.bool_(os.path.exists(marker)))
  multihost_utils.sync_global_devices("marker checked")
  if jax.process_index() == 0:
    os.remove(marker)
  if not np.all(seen):
    blind = [int(i) for i in np.flatnonzero(~np.asarray(seen))]
    raise ConfigError(
      f"base_output_directory={config.base_output_directory}: process(es) {blind} of {jax.process_count()} do not "
      "see what process 0 writes there; checkpoints of a multi-process job need a folder every host shares "
      "(NFS, a mounted bucket), or set enable_checkpointing=false"
    )


def create_manager(config: Config):
  """The run's orbax.checkpoint.CheckpointManager, or None when enable_checkpointing=false."""
  if not config.enable_checkpointing:
    return None
  import orbax.checkpoint as ocp  # Lazy, here and below: a run without checkpoints never imports Orbax.

  options = ocp.CheckpointManagerOptions(
    max_to_keep=config.max_num_checkpoints_to_keep or None,
    enable_async_checkpointing=config.async_checkpointing,
    create=True,
    cleanup_tmp_directories=True,
  )
  return ocp.CheckpointManager(checkpoint_dir(config), options=options, item_names=(ITEM, DATA_ITEM))


def save(manager, state: TrainState, data_state: dict | None = None) -> bool:
  """Starts saving `state` (and the data iterator's state, if given) as checkpoint <state.step>; never
  overwrites an existing checkpoint."""
  import orbax.checkpoint as ocp

  step = int(jax.device_get(state.step))
  if step in manager.all_steps():
    return False
  items = {ITEM: ocp.args.StandardSave(state)}
  if data_state is not None:
    import grain.checkpoint  # Only text pipelines have an iterator state, and they need Grain anyway.

    items[DATA_ITEM] = grain.checkpoint.CheckpointSave(_DataSnapshot(data_state))
  return manager.save(step, args=ocp.args.Composite(**items), force=True)


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


def complete_steps(config: Config) -> list[int]:
  """The steps of the run's complete checkpoints, oldest first (a save in progress or cut short is still in
  Orbax's temporary folder, whose name is not a number)."""
  directory = checkpoint_dir(config)
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def reached_preemption(manager, step: int) -> bool:
  """Whether a SIGTERM (a preemption or maintenance notice) to any process of a multi-process job means every
  process saves and stops after `step`; JAX's preemption service runs only in such a job."""
  return manager is not None and jax.distributed.is_initialized() and manager.reached_preemption(step)


def restore_data(config: Config, manager, step: int, iterator) -> None:
  """Sets a text pipeline's iterator to its state saved in checkpoint <step> (exact resume)."""
  import grain.checkpoint
  import orbax.checkpoint as ocp

  where = os.path.join(checkpoint_dir(config), str(step))
  if not os.path.isdir(os.path.join(where, DATA_ITEM)):
    raise ConfigError(
      f"checkpoint {where} has no data iterator state (saved with dataset_type=synthetic?); resume with the "
      "dataset_type it was saved with, or start a new run_name with load_parameters_path"
    )
  try:
    manager.restore(step, args=ocp.args.Composite(**{DATA_ITEM: grain.checkpoint.CheckpointRestore(iterator)}))
  except (ValueError, FileNotFoundError) as e:  # e.g. saved by another number of processes
    raise ConfigError(
      f"checkpoint {where} has no data state for process {jax.process_index()} of {jax.process_count()} "
      f"({' '.join(str(e).split())[:160]}); resume with the process count it was saved with"
    ) from None


def items_path(key: str, path: str) -> str:
  """Accepts a checkpoint's `items` folder or its step folder; rejects anything else in one line."""
  path = os.path.expanduser(path)
  if os.path.isdir(os.path.join(path, ITEM)):
    path = os.path.join(path, ITEM)
  if not os.path.isdir(path):
    raise ConfigError(f"{key}={path} does not exist; give a checkpoint's items folder, e.g. RUN/checkpoints/100/items")
  if ".orbax-checkpoint-tmp" in path:
    raise ConfigError(f"{key}={path} is an unfinished checkpoint (its save was interrupted); pick a complete one")
  return path


def _restore_error(where: str, error: Exception) -> ConfigError:
  detail = " ".join(str(error).split())[:300]
  return ConfigError(
    f"checkpoint {where} does not match this config ({type(error).__name__}: {detail}); "
    "use the model config it was saved with, or a new run_name"
  )


def leaf_name(path) -> str:
  """Orbax's name of a pytree leaf: its keys joined by dots (e.g. params.decoder_norm.scale)."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _metadata(path: str):
  import orbax.checkpoint as ocp

  try:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(path).item_metadata.tree
  except Exception as e:  # noqa: BLE001 (any failure to read means unreadable)
    raise ConfigError(f"checkpoint {path} is unreadable ({type(e).__name__}); is it a complete Orbax checkpoint?") from None


def check_compatible(path: str, target) -> None:
  """Raises ConfigError unless every leaf of `target` is stored at `path` with the same shape.

  Checked from the checkpoint's metadata before restoring, so a mismatch is one clear line rather than a
  failure inside Orbax's restore.
  """
  stored = {leaf_name(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(_metadata(path))}
  for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(target):
    name = leaf_name(leaf_path)
    if name not in stored:
      raise ConfigError(
        _layer_layout_mismatch(path, name, stored)
        or f"checkpoint {path} has no {name}; use the model config it was saved with, or a new run_name"
      )
    if tuple(stored[name]) != tuple(leaf.shape):
      raise ConfigError(
        f"checkpoint {path} stores {name} with shape {tuple(stored[name])} but this config needs "
        f"{tuple(leaf.shape)}; use the model config it was saved with, or a new run_name"
      )


def _layer_layout_mismatch(path: str, missing: str, stored) -> str | None:
  """The message for a checkpoint whose decoder layers are stacked (scan_layers=true: params.layers) while the
  config wants them one by one (params.layers_0, ...), or the reverse; None if that is not why `missing` is."""
  scanned, unrolled = re.compile(r"(^|\.)layers\."), re.compile(r"(^|\.)layers_\d+\.")
  if scanned.search(missing) and any(unrolled.search(name) for name in stored):
    return (
      f"checkpoint {path} stores the decoder layers one by one (params.layers_0, ...) but scan_layers=true needs "
      "them stacked (params.layers); run with scan_layers=false, the layout it was saved with (a Hugging Face "
      "import can also be redone with scan_layers=true)"
    )
  if unrolled.search(missing) and any(scanned.search(name) for name in stored):
    return (
      f"checkpoint {path} stores the decoder layers stacked (params.layers, saved with scan_layers=true) but "
      "scan_layers=false needs them one by one (params.layers_0, ...); run with scan_layers=true, or write an "
      "unscanned copy with `python3 MaxText/generate_param_only_checkpoint.py ... force_unroll=true` (or import "
      "the Hugging Face model again with scan_layers=false)"
    )
  return None


def _restore_tree(path: str, target):
  """Restores the parts of the pytree at `path` named by `target` (abstract, with shardings); callers have
  already run check_compatible on it."""
  import orbax.checkpoint as ocp

  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  try:
    return checkpointer.restore(
      path,
      args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True
      ),
    )
  except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
    raise _restore_error(path, e) from None


def check_start_paths(config: Config, layout: StateLayout) -> None:
  """Validates load_full_state_path / load_parameters_path against the model, before anything is written."""
  if config.load_full_state_path:
    check_compatible(items_path("load_full_state_path", config.load_full_state_path), layout.abstract)
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    check_compatible(path, {"params": layout.abstract.params})


def latest_step(config: Config) -> int | None:
  """The run's latest complete checkpoint step, read from the folder names (unfinished saves are skipped)."""
  where = checkpoint_dir(config)
  steps = [int(n) for n in os.listdir(where) if n.isdigit()] if os.path.isdir(where) else []
  return max(steps, default=None)


def params_path(config: Config) -> str:
  """Where restore_params reads: load_parameters_path (or load_full_state_path), else the run's latest checkpoint."""
  key = "load_parameters_path" if config.load_parameters_path else "load_full_state_path"
  given = config.load_parameters_path or config.load_full_state_path
  if given:
    return items_path(key, given)
  if not config.run_name:
    raise ConfigError(
      "no parameters to load: give load_parameters_path=PATH/checkpoints/STEP/items (or the run_name of a run)"
    )
  step = latest_step(config)
  if step is None:
    raise ConfigError(
      f"no parameters to load: load_parameters_path is empty and run_name={config.run_name} has no checkpoint "
      f"in {checkpoint_dir(config)}; give load_parameters_path=PATH/checkpoints/STEP/items"
    )
  return os.path.join(checkpoint_dir(config), str(step), ITEM)


def restore_host_params(config: Config, abstract_params) -> tuple[dict, str]:
  """Parameters as host numpy arrays in their stored dtype, from params_path(config), checked against
  `abstract_params` (conversion, which needs no devices); returns (params, where they came from)."""
  import orbax.checkpoint as ocp

  path = params_path(config)
  check_compatible(path, {"params": abstract_params})
  target = {"params": jax.tree_util.tree_map(lambda _: 0, abstract_params)}
  args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  try:
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True))
  except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
    raise _restore_error(path, e) from None
  return restored["params"], path


def restore_params(config: Config, abstract_params) -> tuple[dict, str]:
  """Parameters for decoding or export, from params_path(config); returns (params, where they came from)."""
  path = params_path(config)
  check_compatible(path, {"params": abstract_params})
  return _restore_tree(path, {"params": abstract_params})["params"], path


def load_params(config: Config, mesh, dtype) -> tuple[dict, str]:
  """The parameters of params_path(config), sharded on `mesh` and cast to `dtype` (decoding, benchmarks);
  returns (params, where they came from)."""
  abstract, shardings = params_layout(models.Transformer(config, mesh), config, mesh)
  params, where = restore_params(config, abstract)
  cast = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x.astype(dtype), p), out_shardings=shardings)
  return cast(params), where


@dataclasses.dataclass(frozen=True)
class StartingPoint:
  state: TrainState
  source: str  # where the state came from, for the log
  resumed: bool = False  # from this run's own latest checkpoint


def restore_or_init(config: Config, manager, model, tx, layout: StateLayout) -> StartingPoint:
  """The state a run starts from, by the rules in this module's docstring (after check_start_paths)."""
  latest = manager.latest_step() if manager is not None else None
  if latest is not None:
    import orbax.checkpoint as ocp

    check_compatible(os.path.join(checkpoint_dir(config), str(latest), ITEM), layout.abstract)
    target = ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(layout.abstract)})
    try:
      state = manager.restore(latest, args=target)[ITEM]
    except (ValueError, KeyError, TypeError) as e:
      raise _restore_error(os.path.join(checkpoint_dir(config), str(latest)), e) from None
    return StartingPoint(state, f"resumed from {checkpoint_dir(config)}/{latest}", resumed=True)
  if config.load_full_state_path:
    path = items_path("load_full_state_path", config.load_full_state_path)
    return StartingPoint(_restore_tree(path, layout.abstract), f"full state from {path}")
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    params = _restore_tree(path, {"params": layout.abstract.params})["params"]
    return StartingPoint(state_from_params(params, tx, layout), f"params from {config.load_parameters_path}")
  return StartingPoint(init_state(model, config, tx, layout), f"fresh init (seed {config.init_weights_seed})")
