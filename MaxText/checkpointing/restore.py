"""What a run starts from, and the parameters that decoding, export and conversion load. First match wins:

  1. the latest checkpoint of its own run directory (resume: params, optimizer, step, and for text
     pipelines the Grain iterator's state, one JSON file per process under `<step>/data`; the synthetic
     data position and the dropout RNG are functions of the step),
  2. load_full_state_path (a whole train state),
  3. load_parameters_path (params only; fresh optimizer at step 0),
  4. a fresh init from init_weights_seed.

A checkpoint is checked against the config first (compatible.py), restored in its stored dtypes, verified against
its checksums (damage.py), then cast; on resume a checkpoint that cannot be read or fails verification is skipped, with
the reason in the log, for the newest one that verifies. Every restore into a circular pipeline's train state
permutes its pipelined layers into their stored, stage-major order (state.LayerOrder.stored), so checkpoints move
freely between pipelined and plain runs.
"""

import dataclasses

import jax
import numpy as np

from MaxText import integrity, lora, storage
from MaxText.checkpointing.adapters import _start_params, _with_peft_adapter, stores_adapters
from MaxText.checkpointing.compatible import _check_quantization, check_compatible
from MaxText.checkpointing.damage import (
  Damaged,
  _metadata,
  _read_arrays,
  _recorded_checksums,
  _set_aside,
  _verify_data_file,
  verify,
)
from MaxText.checkpointing.paths import DATA_ITEM, ITEM, checkpoint_dir, items_path, params_path
from MaxText.checkpointing.processes import _all_processes_agree
from MaxText.common_types import Config, ConfigError
from MaxText.layers import models, quantizations
from MaxText.state import (
  LayerOrder,
  StateLayout,
  TrainState,
  init_adapters,
  init_state,
  params_layout,
  state_from_params,
)


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
    return StartingPoint(LayerOrder(config).stored(_restore_tree(path, layout.abstract)), f"full state from {path}")
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    params = _restore_tree(path, {"params": _start_params(config, layout, path)})["params"]
    source = f"params from {config.load_parameters_path}"
    if config.lora_rank > 0 and not stores_adapters(path):
      params = lora.combine(init_adapters(model, config, layout), params)
      source += f" and fresh LoRA adapters (rank {config.lora_rank})"
    if config.hf_lora_adapter_path:
      params, source = _with_peft_adapter(config, layout, params), source + f", adapters from {config.hf_lora_adapter_path}"
    return StartingPoint(state_from_params(params, tx, layout, config), source)
  state = init_state(model, config, tx, layout)
  source = f"fresh init (seed {config.init_weights_seed})"
  if config.hf_lora_adapter_path:
    params = _with_peft_adapter(config, layout, LayerOrder(config).natural(state.params))
    state, source = state_from_params(params, tx, layout, config), source + f", adapters from {config.hf_lora_adapter_path}"
  return StartingPoint(state, source)


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
  return LayerOrder(config).stored(_cast_like(state, layout.abstract)), verified


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


class _VerifiedRestore:
  """What Grain's checkpoint handler restores into: verifies the stored text, then sets the iterator's state."""

  def __init__(self, iterator):
    self.iterator = iterator

  def set_state(self, stored: bytes) -> None:
    self.iterator.set_state(integrity.open_data(stored))

  def start_prefetch(self) -> None:
    getattr(self.iterator, "start_prefetch", lambda: None)()


def restore_params(config: Config, abstract_params) -> tuple[dict, str]:
  """Parameters for decoding or export, from params_path(config); returns (params, where they came from)."""
  path = params_path(config)
  _check_quantization(config, path)
  check_compatible(path, {"params": abstract_params})
  return _restore_tree(path, {"params": abstract_params})["params"], path


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
