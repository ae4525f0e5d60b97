"""Writing checkpoints: a run's, through Orbax's CheckpointManager (the train state, the data iterator's state for
text pipelines, and integrity.record's checksum of every array, one commit), never overwriting one; params-only
checkpoints (save_params); and weight-only quantized parameters (decode.py's save_quantized_params_path, a params
checkpoint written into a folder that holds none yet), which keep their quantization settings beside the arrays
(`<step>/quantization`, committed with them). Checkpoints hold the decoder layers in their natural order, whatever
the run's layout: a circular pipeline's train state holds its pipelined layers stage-major (layers/pipeline.py), so
its saves write them back in the natural order (state.LayerOrder.natural).
"""

import json

import jax

from MaxText import integrity, storage
from MaxText.checkpointing.paths import (
  CHECKSUM_ITEM,
  DATA_ITEM,
  ITEM,
  QUANTIZATION_ITEM,
  check_new_params_dir,
  checkpoint_dir,
)
from MaxText.common_types import Config
from MaxText.layers import quantizations
from MaxText.state import LayerOrder, TrainState


class _DataSnapshot:
  """The data iterator's state captured at save time (the save itself may finish in the background)."""

  def __init__(self, state: dict):
    self.state = state

  def get_state(self) -> bytes:
    return integrity.seal_data(self.state)


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
    state = LayerOrder(config).natural(state)  # a copy while it is written to the host (async saves too)
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


def save_quantized_params(config: Config, params) -> str:
  """Writes weight-only quantized `params` to save_quantized_params_path (a params checkpoint with their
  quantizations.settings beside them, which loading with checkpoint_is_quantized checks); returns its items path."""
  directory = config.save_quantized_params_path  # absolute: a path key (config_parse.PATH_KEYS)
  check_new_params_dir("save_quantized_params_path", directory)
  return save_params(directory, quantizations.widened(params), quantizations.settings(config))


def write_checksums(step_dir: str, recorded: dict) -> None:
  """Writes an integrity.record where a checkpoint saved by the CheckpointManager has it (for one written
  without a manager, such as an imported model)."""
  storage.makedirs(storage.join(step_dir, CHECKSUM_ITEM))
  storage.write_text(storage.join(step_dir, CHECKSUM_ITEM, "metadata"), json.dumps(recorded))
