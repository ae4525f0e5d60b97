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

Every checkpoint also records a checksum of each array, and its data state carries its own (integrity.py);
restoring verifies them. A checkpoint without checksums is damaged too when it was saved with them (its Orbax
metadata names them, or its folder for them is there) or when an earlier checkpoint of its folder has them;
only a checkpoint of a run older than checksums (none before it has any) is restored unverified, and the log
says so. Likewise a data state without its seal in a checkpoint with checksums (the two came together) is
damaged. On resume a checkpoint that cannot be read or fails verification is skipped, with the reason in the log,
for the newest one that verifies; a damaged load_parameters_path or load_full_state_path is an error.

Weight-only quantized parameters (decode.py's save_quantized_params_path, a params checkpoint written into a folder
that holds none yet) keep their quantization settings beside the arrays (`<step>/quantization`, committed with
them); they load only with checkpoint_is_quantized=true and the same settings, and a float checkpoint never does.

Checkpoints hold the decoder layers in their natural order, whatever the run's layout: a circular pipeline's
train state holds its pipelined layers stage-major (layers/pipeline.py), so its saves write them back in the
natural order and every restore into it permutes them (state.in_natural_order / in_stored_order); checkpoints move
freely between pipelined and plain runs.

A local save never starts on a disk that cannot hold it (check_room); one that runs out of space all the same
ends the run with one line naming the checkpoint to resume from (full_disk_stops_the_run).
"""

import contextlib
import dataclasses
import errno
import gc
import json
import math
import os
import re
import shutil
import sys
import traceback

import jax
import numpy as np

from MaxText import integrity, lora, metrics, storage
from MaxText.common_types import Config, ConfigError, TrainingError
from MaxText.layers import models, quantizations
from MaxText.state import (
  StateLayout,
  TrainState,
  in_natural_order,
  in_stored_order,
  init_adapters,
  init_state,
  params_layout,
  state_from_params,
)

ITEM = "items"
DATA_ITEM = "data"
CHECKSUM_ITEM = "checksums"  # integrity.record of the items, as JSON (Orbax's JsonSave writes it to a file "metadata")
QUANTIZATION_ITEM = "quantization"  # a quantized params checkpoint's quantizations.settings, as JSON (likewise)


class _DataSnapshot:
  """The data iterator's state captured at save time (the save itself may finish in the background)."""

  def __init__(self, state: dict):
    self.state = state

  def get_state(self) -> bytes:
    return integrity.seal_data(self.state)


class _VerifiedRestore:
  """What Grain's checkpoint handler restores into: verifies the stored text, then sets the iterator's state."""

  def __init__(self, iterator):
    self.iterator = iterator

  def set_state(self, stored: bytes) -> None:
    self.iterator.set_state(integrity.open_data(stored))

  def start_prefetch(self) -> None:
    getattr(self.iterator, "start_prefetch", lambda: None)()


def run_dir(config: Config) -> str:
  """{base_output_directory}/{run_name}: what a run writes (checkpoints, tensorboard, config.yml)."""
  if not config.run_name:
    raise ConfigError("run_name is empty; pass run_name=NAME (output goes to base_output_directory/NAME)")
  return storage.join(config.base_output_directory, config.run_name)  # Absolute or a URL: pyconfig.parse saw to it.


def checkpoint_dir(config: Config) -> str:
  return storage.join(run_dir(config), "checkpoints")


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


def create_manager(config: Config):
  """The run's orbax.checkpoint.CheckpointManager, or None when enable_checkpointing=false."""
  if not config.enable_checkpointing:
    return None
  import orbax.checkpoint as ocp  # Lazy, here and below: a run without checkpoints never imports Orbax.

  options = ocp.CheckpointManagerOptions(
    max_to_keep=config.max_num_checkpoints_to_keep or None,
    enable_async_checkpointing=config.async_checkpointing,
    create=False,  # `save` makes the folder: nothing is written before a run is known to fit.
    cleanup_tmp_directories=True,
  )
  return ocp.CheckpointManager(checkpoint_dir(config), options=options, item_names=(ITEM, DATA_ITEM, CHECKSUM_ITEM))


def save(manager, state: TrainState, data_state: dict | None = None, config: Config | None = None) -> bool:
  """Starts saving `state` (and the data iterator's state, if given) as checkpoint <state.step>; never
  overwrites an existing checkpoint. `config`: the run's, whose train state may hold a circular pipeline's layers
  stage-major (they are written in the natural order); None for a state in the natural order."""
  import orbax.checkpoint as ocp

  step = int(jax.device_get(state.step))
  if step in manager.all_steps():
    return False
  if config is not None:
    state = in_natural_order(config, state)  # a copy while it is written to the host (async saves too)
  storage.makedirs(str(manager.directory))
  items = {ITEM: ocp.args.StandardSave(state), CHECKSUM_ITEM: ocp.args.JsonSave(integrity.record(state))}
  if data_state is not None:
    import grain.checkpoint  # Only text pipelines have an iterator state, and they need Grain anyway.

    items[DATA_ITEM] = grain.checkpoint.CheckpointSave(_DataSnapshot(data_state))
  return manager.save(step, args=ocp.args.Composite(**items), force=True)


def save_params(directory: str, params, quantization: dict | None = None) -> str:
  """Writes `params` as checkpoint 0 of `directory`, a params-only checkpoint with its checksums (and with
  `quantization`, the settings of quantized params, beside them: one commit, so a save cut short leaves neither);
  returns the path of its items folder (what load_parameters_path takes)."""
  import orbax.checkpoint as ocp

  items = {
    ITEM: ocp.args.StandardSave({"params": params}),
    CHECKSUM_ITEM: ocp.args.JsonSave(integrity.record({"params": params})),
  }
  if quantization is not None:
    items[QUANTIZATION_ITEM] = ocp.args.JsonSave(quantization)
  options = ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)  # an earlier save's leftovers, cut short
  with ocp.CheckpointManager(directory, options=options, item_names=tuple(items)) as manager:
    manager.save(0, args=ocp.args.Composite(**items))
    manager.wait_until_finished()
  return storage.join(directory, "0", ITEM)


def check_new_params_dir(key: str, directory: str) -> None:
  """ConfigError when `directory` (where save_params would write) already holds a checkpoint: none is overwritten."""
  if storage.isdir(directory) and any(name.isdigit() for name in storage.listdir(directory)):
    raise ConfigError(f"{key}={directory} already holds a checkpoint; give a new folder (none is ever overwritten)")


def save_quantized_params(config: Config, params) -> str:
  """Writes weight-only quantized `params` to save_quantized_params_path (a params checkpoint with their
  quantizations.settings beside them, which loading with checkpoint_is_quantized checks); returns its items path."""
  directory = config.save_quantized_params_path  # absolute: a path key (config_parse.PATH_KEYS)
  check_new_params_dir("save_quantized_params_path", directory)
  return save_params(directory, quantizations.widened(params), quantizations.settings(config))


def _saved_quantization(items: str) -> dict | None:
  """The quantizations.settings recorded beside a checkpoint's items folder; None for float parameters."""
  path = storage.join(storage.dirname(items), QUANTIZATION_ITEM, "metadata")
  if not storage.exists(path):
    return None
  try:
    return json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise Damaged(storage.dirname(items), f"its quantization record cannot be read ({_error_text(e)})") from None


def _check_quantization(config: Config, path: str) -> None:
  """Quantized parameters load only as such, with the settings they were saved with; float ones only as float."""
  where = f"load_parameters_path={path}" if config.load_parameters_path else f"checkpoint {path}"
  quantizations.check_saved(config, _saved_quantization(path), where)


def write_checksums(step_dir: str, recorded: dict) -> None:
  """Writes an integrity.record where a checkpoint saved by the CheckpointManager has it (for one written
  without a manager, such as an imported model)."""
  storage.makedirs(storage.join(step_dir, CHECKSUM_ITEM))
  storage.write_text(storage.join(step_dir, CHECKSUM_ITEM, "metadata"), json.dumps(recorded))


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
  return sorted(int(n) for n in storage.listdir(directory) if n.isdigit() and storage.isdir(storage.join(directory, n)))


def reached_preemption(manager, step: int) -> bool:
  """Whether a SIGTERM (a preemption or maintenance notice) to any process of a multi-process job means every
  process saves and stops after `step`; JAX's preemption service runs only in such a job."""
  return manager is not None and jax.distributed.is_initialized() and manager.reached_preemption(step)


def restore_data(config: Config, manager, step: int, iterator) -> None:
  """Sets a text pipeline's iterator to its state saved in checkpoint <step> (exact resume)."""
  import grain.checkpoint
  import orbax.checkpoint as ocp

  where = storage.join(checkpoint_dir(config), str(step))
  if not storage.isdir(storage.join(where, DATA_ITEM)):
    raise ConfigError(
      f"checkpoint {where} has no data iterator state (saved with dataset_type=synthetic?); resume with the "
      "dataset_type it was saved with, or start a new run_name with load_parameters_path"
    )
  try:
    restore = grain.checkpoint.CheckpointRestore(_VerifiedRestore(iterator))
    manager.restore(step, args=ocp.args.Composite(**{DATA_ITEM: restore}))
  except integrity.Mismatch as e:
    raise Damaged(where, str(e)) from None
  except (ValueError, FileNotFoundError) as e:  # e.g. saved by another number of processes
    raise ConfigError(
      f"checkpoint {where} has no data state for process {jax.process_index()} of {jax.process_count()} "
      f"({' '.join(str(e).split())[:160]}); resume with the process count it was saved with"
    ) from None


def items_path(key: str, path: str) -> str:
  """Accepts a checkpoint's `items` folder or its step folder; rejects anything else in one line."""
  path = storage.expand(path)
  if storage.isdir(storage.join(path, ITEM)):
    path = storage.join(path, ITEM)
  if not storage.isdir(path):
    raise ConfigError(f"{key}={path} does not exist; give a checkpoint's items folder, e.g. RUN/checkpoints/100/items")
  if ".orbax-checkpoint-tmp" in path:
    raise ConfigError(f"{key}={path} is an unfinished checkpoint (its save was interrupted); pick a complete one")
  if not any(storage.exists(storage.join(path, name)) for name in ("_METADATA", "manifest.ocdbt", "_sharding")):
    raise ConfigError(
      f"{key}={path} holds no Orbax checkpoint (no _METADATA or manifest.ocdbt); give a checkpoint's items folder, "
      "e.g. RUN/checkpoints/100/items"
    )
  return path


class Damaged(ConfigError):
  """A checkpoint that cannot be read, or whose arrays or data state differ from what was recorded at its save."""

  def __init__(self, where: str, reason: str):
    super().__init__(f"checkpoint {where} is damaged: {reason}")
    self.where, self.reason = where, reason


def _error_text(error: BaseException) -> str:
  # Orbax's read error formats TensorStore's spec method instead of calling it ("<bound method ...spec of ...>").
  text = re.sub(r"\s*See full TensorStore details: <bound method .*", "", " ".join(str(error).split()))
  return f"{type(error).__name__}: {text[:200]}"


def _root_cause(error: BaseException) -> BaseException:
  """The innermost error `error` was raised from (TensorStore's, under Orbax's wrapper)."""
  seen = {id(error)}
  while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
    seen.add(id(inner))
    error = inner
  return error


# TensorStore's read error: `OUT_OF_RANGE: Error reading "params.x.kernel/0.1" in OCDBT database at local file
# "RUN/checkpoints/5/items/": Requested byte range [38372, 40308) is not valid for value of size 27705`.
_STORE_READ = re.compile(
  r'(?:(?P<code>[A-Z_]+): )?Error reading "(?P<key>[^"]+)" in \w+ database at (?P<store>.+?): (?P<why>.*)'
)


def _metadata(path: str):
  import orbax.checkpoint as ocp

  try:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(path).item_metadata.tree
  except Exception as e:  # noqa: BLE001 (any failure to read means unreadable)
    where = storage.dirname(path) if path.rstrip("/").endswith("/" + ITEM) else path
    raise Damaged(where, f"its metadata cannot be read ({_error_text(e)})") from None


def _recorded_checksums(items: str) -> dict | None:
  """The integrity.record saved beside the checkpoint's `items` folder; None for a checkpoint saved without one
  (one older than checksums). Damaged when it lacks them although it was saved with them (see _saved_with_checksums)."""
  step_dir = storage.dirname(items)
  path = storage.join(step_dir, CHECKSUM_ITEM, "metadata")
  if not storage.exists(path):
    evidence = _saved_with_checksums(step_dir)
    if evidence:
      raise Damaged(step_dir, f"its checksums ({CHECKSUM_ITEM}/metadata) are missing, though {evidence}")
    return None
  try:
    return json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise Damaged(storage.dirname(items), f"its checksums cannot be read ({_error_text(e)})") from None


def _saved_with_checksums(step_dir: str) -> str | None:
  """Why checkpoint `step_dir` must have checksums, or None: its own Orbax metadata names a checksums item, or its
  checksums folder exists, or an earlier checkpoint of the same folder has checksums (saved by a version that
  records them, as every later one is). A run older than checksums has none anywhere; a run that was upgraded has
  them only from some step on, so only earlier steps count."""
  if storage.isdir(storage.join(step_dir, CHECKSUM_ITEM)):
    return f"its {CHECKSUM_ITEM} folder exists"
  try:
    handlers = json.loads(storage.read_text(storage.join(step_dir, "_CHECKPOINT_METADATA"))).get("item_handlers") or {}
  except (OSError, ValueError, AttributeError):
    handlers = {}  # None written (an imported model) or unreadable: the other evidence decides.
  if CHECKSUM_ITEM in handlers:
    return "its _CHECKPOINT_METADATA says it was saved with them"
  step = _step_of(step_dir.rstrip("/").rsplit("/", 1)[-1])
  if step is None:
    return None
  parent = storage.dirname(step_dir)
  earlier = sorted((s, n) for n in storage.listdir(parent) if (s := _step_of(n)) is not None and s < step)
  for _, other in reversed(earlier):  # the nearest first: on a bucket each look is a request
    if storage.exists(storage.join(parent, other, CHECKSUM_ITEM, "metadata")):
      return f"the earlier checkpoint {storage.join(parent, other)} has them"
  return None


def _step_of(name: str) -> int | None:
  """The step of a checkpoint folder's name: <step>, or <step>.damaged once set aside."""
  head = name.split(".", 1)[0]
  return int(head) if head.isdigit() else None


def verify(items: str, tree) -> str:
  """Checks the restored `tree` against the checksums recorded when the checkpoint at `items` was saved; raises
  Damaged on a difference. Returns what was verified, for the log."""
  recorded = _recorded_checksums(items)
  if recorded is None:
    return "saved without checksums, not verified"
  try:
    return f"{integrity.verify(recorded, tree)} arrays verified"
  except integrity.Mismatch as e:
    raise Damaged(storage.dirname(items), str(e)) from None


def _model_keys_hint(path: str, resuming: bool) -> str:
  """How to get the model keys a checkpoint's `items` folder (`path`) was saved with: the model.yml an import wrote
  beside it, else its run's config.yml (RUN/checkpoints/STEP/items), which loads back as a config file."""
  step_dir = storage.dirname(path.rstrip("/"))
  model_yml = storage.join(step_dir, "model.yml")
  run_config = storage.join(storage.dirname(storage.dirname(step_dir)), "config.yml")
  if storage.isfile(model_yml):
    hint = f"use the model config it was saved with: model_name={model_yml}"
  elif storage.isfile(run_config):
    hint = f"use the model config it was saved with: its run's {run_config} (pass it as the config file)"
  else:
    hint = "use the model config it was saved with"
  return hint + (", or start a new run_name" if resuming else "")


def check_compatible(path: str, target, resuming: bool = False) -> None:
  """Raises ConfigError unless every leaf of `target` is stored at `path` with the same shape; `resuming`: `path` is
  the run's own checkpoint (the fix may be a new run_name).

  Checked from the checkpoint's metadata before restoring, so a mismatch is one clear line rather than a
  failure inside Orbax's restore.
  """
  stored = {integrity.leaf_name(p): leaf.shape for p, leaf in jax.tree_util.tree_leaves_with_path(_metadata(path))}
  wanted = {integrity.leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
  unread = sorted(n for n in stored if n.startswith("params.") and n.endswith(lora.ADAPTERS) and n not in wanted)
  if unread:  # Restoring without them would silently give the base model.
    raise ConfigError(
      f"checkpoint {path} holds LoRA adapters ({unread[0]}) that this config has none for; give the run's "
      "lora_rank, lora_alpha and lora_target_modules (generate_param_only_checkpoint.py with them merges the adapters)"
    )
  for leaf_path, leaf in jax.tree_util.tree_leaves_with_path(target):
    name = integrity.leaf_name(leaf_path)
    if name not in stored:
      raise ConfigError(
        _layer_layout_mismatch(path, name, stored) or f"checkpoint {path} has no {name}; {_model_keys_hint(path, resuming)}"
      )
    if tuple(stored[name]) != tuple(leaf.shape):
      raise ConfigError(
        f"checkpoint {path} stores {name} with shape {tuple(stored[name])} but this config needs "
        f"{tuple(leaf.shape)}; {_model_keys_hint(path, resuming)}"
      )


def _layer_layout_mismatch(path: str, missing: str, stored) -> str | None:
  """The message for a checkpoint whose decoder layers are stacked (scan_layers=true: params.layers) while the
  config wants them one by one (params.layers_0, ...), or the reverse; None if that is not why `missing` is."""
  # A layer stack's name is `layers`, or DeepSeek's dense_layers / moe_layers (families.layer_stacks).
  scanned, unrolled = re.compile(r"(^|\.)(\w+_)?layers\."), re.compile(r"(^|\.)(\w+_)?layers_\d+\.")
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
  as_stored = _in_stored_dtypes(path, target)
  args = ocp.args.PyTreeRestore(
    item=as_stored, restore_args=ocp.checkpoint_utils.construct_restore_args(as_stored), partial_restore=True
  )
  restored, damage = _read_arrays(storage.dirname(path), lambda: checkpointer.restore(path, args=args))
  if damage:
    raise damage
  verify(path, restored)
  return _cast_like(restored, target)


def _in_stored_dtypes(items: str, target):
  """`target` (abstract, with shardings) in the dtypes its leaves are stored in at `items`: restored as saved, a
  state can be verified against its checksums, then cast (a bfloat16 import fine-tuned in float32, say)."""
  stored = {integrity.leaf_name(p): leaf.dtype for p, leaf in jax.tree_util.tree_leaves_with_path(_metadata(items))}

  def as_stored(path, leaf):
    dtype = stored.get(integrity.leaf_name(path), leaf.dtype)
    return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=getattr(leaf, "sharding", None))

  return jax.tree_util.tree_map_with_path(as_stored, target)


def _cast_like(tree, target):
  """`tree` in `target`'s dtypes and shardings; `tree` itself when the dtypes already match."""
  pairs = zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(target), strict=True)
  if all(x.dtype == t.dtype for x, t in pairs):
    return tree
  shardings = jax.tree_util.tree_map(lambda t: t.sharding, target)
  cast = jax.jit(lambda tr: jax.tree_util.tree_map(lambda x, t: x.astype(t.dtype), tr, target), out_shardings=shardings)
  return cast(tree)


def _read_arrays(where: str, restore):
  """(restore(), None), or (None, Damaged) when Orbax cannot read the arrays of checkpoint `where` (its metadata
  matched the config, so a failure to read is damage)."""
  drop_abandoned_io()  # (before: some are printed while Orbax is still failing)
  try:
    return restore(), None
  except Exception as e:  # noqa: BLE001 (its metadata matched the config: a failure to read is damage)
    damage = _unreadable(where, e)
  gc.collect()  # Orbax's abandoned reads are closed now that the error is let go, not at some later moment.
  return None, damage


def drop_abandoned_io() -> None:
  """When one array read or write fails, Orbax leaves the others: each pending read raises again as it is closed
  (it catches BaseException), and each TensorStore callback of a finished one finds its event loop closed. Python
  prints every one as `Exception ignored in: ...`, hundreds of lines with TensorStore specs for one damaged file,
  from Orbax's and TensorStore's threads at any later moment; and a full disk's error comes again from writers
  that flush at exit (TensorBoard's). So from the first restore (or the start of a command) on, a
  sys.unraisablehook drops those echoes (the failure itself is reported in one line) and hands anything else to
  the hook it replaced."""
  previous = sys.unraisablehook
  if getattr(previous, "drops_abandoned_io", False):
    return

  def abandoned(unraisable) -> bool:
    code = getattr(unraisable.object, "cr_code", None)
    if code is not None:
      return "orbax" in code.co_filename
    if out_of_space(unraisable.exc_value):
      return True
    frames = traceback.extract_tb(unraisable.exc_traceback)
    closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    return unraisable.object is None and closed and bool(frames) and frames[0].name == "call_soon_threadsafe"

  def hook(unraisable):
    if not abandoned(unraisable):
      previous(unraisable)

  hook.drops_abandoned_io = True
  sys.unraisablehook = hook


def _unreadable(where: str, error: Exception) -> "Damaged":
  """Damaged, naming the array whose stored bytes could not be read and where they are stored, when TensorStore
  says (a data file cut short or overwritten)."""
  root = _root_cause(error)
  read = _STORE_READ.search(" ".join(str(root).split()))
  if read is None:
    return Damaged(where, f"its arrays cannot be read ({_error_text(root)})")
  name, why = read["key"].rsplit("/", 1)[0], f"{read['code']}: {read['why']}" if read["code"] else read["why"]
  return Damaged(
    where, f"its array {name} cannot be read from {read['store']}: a data file is truncated or damaged ({why[:160]})"
  )


def check_start_paths(config: Config, layout: StateLayout) -> None:
  """Validates load_full_state_path / load_parameters_path against the model, before anything is written."""
  if config.load_full_state_path:
    check_compatible(items_path("load_full_state_path", config.load_full_state_path), layout.abstract)
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    _check_quantization(config, path)
    check_compatible(path, {"params": _start_params(config, layout, path)})
  trained_adapters = config.hf_lora_adapter_path or (config.load_parameters_path and _stores_adapters(path))
  compares = config.use_dpo or (config.use_rl and config.grpo_beta > 0)
  if compares and config.lora_rank > 0 and trained_adapters:
    what = "use_dpo=true" if config.use_dpo else f"use_rl=true with grpo_beta={config.grpo_beta}"
    raise ConfigError(
      f"{what} under LoRA compares with the base model (the adapters off), but this run starts from trained "
      "adapters; merge them first (generate_param_only_checkpoint.py with their LoRA keys) and start from the merge"
    )


def _stores_adapters(path: str) -> bool:
  return any(
    lora.is_adapter(tuple(integrity.leaf_name(p).split(".")))
    for p, _ in jax.tree_util.tree_leaves_with_path(_metadata(path))
  )


def _start_params(config: Config, layout: StateLayout, path: str):
  """The abstract params load_parameters_path restores: all of them, or under LoRA from a checkpoint without
  adapters (a base model), all but the adapters, which then start fresh."""
  if config.lora_rank > 0 and not _stores_adapters(path):
    return lora.partition(layout.abstract.params)[1]
  return layout.abstract.params


def latest_step(config: Config) -> int | None:
  """The run's latest complete checkpoint step, read from the folder names (unfinished saves are skipped)."""
  where = checkpoint_dir(config)
  steps = [int(n) for n in storage.listdir(where) if n.isdigit()]
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
  return storage.join(checkpoint_dir(config), str(step), ITEM)


def restore_host_params(config: Config, abstract_params) -> tuple[dict, str]:
  """Parameters as host numpy arrays in their stored dtype, from params_path(config), checked against
  `abstract_params` (conversion, which needs no devices); returns (params, where they came from)."""
  import orbax.checkpoint as ocp

  path = params_path(config)
  _check_quantization(config, path)
  check_compatible(path, {"params": abstract_params})
  target = {"params": jax.tree_util.tree_map(lambda _: 0, abstract_params)}
  args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  restore = ocp.args.PyTreeRestore(item=target, restore_args=args, partial_restore=True)
  restored, damage = _read_arrays(storage.dirname(path), lambda: checkpointer.restore(path, args=restore))
  if damage:
    raise damage
  verify(path, restored)
  return restored["params"], path


def restore_params(config: Config, abstract_params) -> tuple[dict, str]:
  """Parameters for decoding or export, from params_path(config); returns (params, where they came from)."""
  path = params_path(config)
  _check_quantization(config, path)
  check_compatible(path, {"params": abstract_params})
  return _restore_tree(path, {"params": abstract_params})["params"], path


def load_params(config: Config, mesh, dtype) -> tuple[dict, str]:
  """The parameters of params_path(config), sharded on `mesh` and cast to `dtype` (decoding, benchmarks);
  returns (params, where they came from). With checkpoint_is_quantized, the weight-only quantized parameters
  save_quantized_params wrote, restored as they are (their floats, scales included, cast to `dtype`)."""
  if config.checkpoint_is_quantized:
    return _load_quantized_params(config, mesh, dtype)
  abstract, shardings = params_layout(models.Transformer(config, mesh), config, mesh)
  params, where = restore_params(config, abstract)
  cast = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: x.astype(dtype), p), out_shardings=shardings)
  return cast(params), where


def _load_quantized_params(config: Config, mesh, dtype) -> tuple[dict, str]:
  path = params_path(config)
  _check_quantization(config, path)
  model = quantizations.quantize_model(models.Transformer(config, mesh), config)
  abstract, _ = params_layout(model, config, mesh)

  def in_dtype(x):  # the floats in `dtype`; the quantized values stay integers
    floating = jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
    return jax.ShapeDtypeStruct(x.shape, dtype if floating else x.dtype, sharding=x.sharding)

  abstract = jax.tree_util.tree_map(in_dtype, abstract)
  check_compatible(path, {"params": abstract})
  return _restore_tree(path, {"params": abstract})["params"], path


@dataclasses.dataclass(frozen=True)
class StartingPoint:
  state: TrainState
  source: str  # where the state came from, for the log
  resumed: bool = False  # from this run's own latest checkpoint that verifies
  skipped: tuple[str, ...] = ()  # newer checkpoints of the run that were damaged, with the reason


def restore_or_init(config: Config, manager, model, tx, layout: StateLayout) -> StartingPoint:
  """The state a run starts from, by the rules in this module's docstring (after check_start_paths)."""
  if manager is not None and manager.all_steps():
    start = _resume(config, manager, layout)
    if config.hf_lora_adapter_path:
      start = dataclasses.replace(start, source=f"{start.source}; hf_lora_adapter_path unused: the run has its own")
    return start
  if config.load_full_state_path:
    path = items_path("load_full_state_path", config.load_full_state_path)
    return StartingPoint(in_stored_order(config, _restore_tree(path, layout.abstract)), f"full state from {path}")
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    params = _restore_tree(path, {"params": _start_params(config, layout, path)})["params"]
    source = f"params from {config.load_parameters_path}"
    if config.lora_rank > 0 and not _stores_adapters(path):
      params = lora.combine(init_adapters(model, config, layout), params)
      source += f" and fresh LoRA adapters (rank {config.lora_rank})"
    if config.hf_lora_adapter_path:
      params, source = _with_peft_adapter(config, layout, params), source + f", adapters from {config.hf_lora_adapter_path}"
    return StartingPoint(state_from_params(params, tx, layout, config), source)
  state = init_state(model, config, tx, layout)
  source = f"fresh init (seed {config.init_weights_seed})"
  if config.hf_lora_adapter_path:
    params = _with_peft_adapter(config, layout, in_natural_order(config, state.params))
    state, source = state_from_params(params, tx, layout, config), source + f", adapters from {config.hf_lora_adapter_path}"
  return StartingPoint(state, source)


def _with_peft_adapter(config: Config, layout: StateLayout, params: dict) -> dict:
  """`params` with the adapters of the PEFT folder hf_lora_adapter_path, placed with the layout's shardings."""
  from MaxText import families
  from MaxText.convert import peft

  adapters, shardings = lora.partition(layout.abstract.params)[0], lora.partition(layout.shardings.params)[0]
  where = lambda path, i: families.param_path(config, path, i)  # noqa: E731
  read = peft.read_adapter(config.hf_lora_adapter_path, config, families.hf_mapping(config), adapters, where)
  placed = jax.tree_util.tree_map(lambda x, a, s: jax.device_put(x.astype(a.dtype), s), read, adapters, shardings)
  return lora.combine(placed, lora.partition(params)[1])


def _resume(config: Config, manager, layout: StateLayout) -> StartingPoint:
  """The newest of the run's checkpoints that can be read and verifies. The damaged newer ones are named, and
  set aside as <step>.damaged (kept for inspection; the run saves those steps again); when none verifies, nothing
  is moved and the run stops."""
  damaged = []
  for step in sorted(manager.all_steps(), reverse=True):
    where = storage.join(checkpoint_dir(config), str(step))
    try:
      state, verified = _restore_step(config, manager, step, where, layout)
    except Damaged as e:
      damaged.append((where, str(e)))
      continue
    skipped = tuple(f"{reason}; set aside as {_set_aside(where)}" for where, reason in damaged)
    if damaged:
      manager.reload()
    return StartingPoint(state, f"resumed from {where} ({verified})", resumed=True, skipped=skipped)
  raise ConfigError(
    f"no checkpoint in {checkpoint_dir(config)} can be resumed from ({'; '.join(r for _, r in damaged)}); move them "
    "out of that folder to start the run over, or use a new run_name"
  )


def _restore_step(config: Config, manager, step: int, where: str, layout: StateLayout):
  """(state, what was verified) of checkpoint <step>: restored in its stored dtypes, verified, cast to the
  layout's. Damaged, on every process alike, when any process cannot read its part or it does not verify (the
  processes agree after each stage, so none is left waiting in a collective the others skipped)."""
  import orbax.checkpoint as ocp

  items = storage.join(where, ITEM)

  def agree(damage: Damaged | None) -> None:
    if not _all_processes_agree(damage is None):
      raise damage or Damaged(where, "another process of the job cannot read it")

  damage = None
  try:
    check_compatible(items, layout.abstract, resuming=True)  # A config that does not match is an error, not damage.
    _recorded_checksums(items)  # Checksums it should have but lacks: damaged, found before reading its arrays.
    if config.dataset_type != "synthetic":
      _verify_data_file(where)
  except Damaged as e:
    damage = e
  agree(damage)
  as_stored = _in_stored_dtypes(items, layout.abstract)
  args = ocp.args.Composite(**{ITEM: ocp.args.StandardRestore(as_stored)})
  restored, damage = _read_arrays(where, lambda: manager.restore(step, args=args))
  agree(damage)
  state = restored[ITEM]
  verified = verify(items, state)  # A global computation: the same verdict on every process.
  return in_stored_order(config, _cast_like(state, layout.abstract)), verified


def _set_aside(where: str) -> str:
  """Renames a damaged checkpoint folder to <step>.damaged (not a step number, so no longer a checkpoint);
  process 0 does it, the others wait."""
  target = f"{where}.damaged"
  if jax.process_index() == 0:
    suffix = 1
    while storage.exists(target):
      suffix += 1
      target = f"{where}.damaged{suffix}"
    storage.rename(where, target)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("damaged checkpoint set aside")
  return target


def _verify_data_file(where: str) -> None:
  """Checks this process's data state in checkpoint `where` against its checksum (before restoring anything)."""
  path = storage.join(where, DATA_ITEM, f"process_{jax.process_index()}-of-{jax.process_count()}.json")
  if storage.exists(path):  # A missing one is restore_data's error: another process count, or synthetic data.
    sealed_when_saved = storage.exists(storage.join(where, CHECKSUM_ITEM, "metadata"))  # (the two came together)
    try:
      integrity.open_data(storage.read_bytes(path), sealed_when_saved)
    except (OSError, integrity.Mismatch) as e:
      raise Damaged(where, str(e)) from None


def _all_processes_agree(ok: bool) -> bool:
  """Whether `ok` holds on every process (each reads its own shards and data state)."""
  if jax.process_count() == 1:
    return ok
  from jax.experimental import multihost_utils

  return bool(np.all(multihost_utils.process_allgather(np.bool_(ok))))


# ---------------------------------------------------------------------------------------------- a full disk
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
