"""Whether a checkpoint fits the config, decided from its metadata before any array is read, so that a mismatch is
one line naming the leaf and the fix (the model keys it was saved with, scan_layers, the LoRA keys) rather than a
failure inside Orbax's restore: every leaf the config needs is stored with its shape, LoRA adapters are never dropped
silently, and weight-only quantized parameters load only with checkpoint_is_quantized=true and the settings they
were saved with (a float checkpoint never does). check_start_paths applies these checks to load_full_state_path and
load_parameters_path before a run writes anything.
"""

import json
import re

import jax

from MaxText import integrity, lora, storage
from MaxText.checkpointing.adapters import _start_params
from MaxText.checkpointing.damage import Damaged, _error_text, _metadata
from MaxText.checkpointing.paths import QUANTIZATION_ITEM, items_path
from MaxText.common_types import Config, ConfigError
from MaxText.layers import quantizations
from MaxText.state import StateLayout


def check_start_paths(config: Config, layout: StateLayout) -> None:
  """Validates load_full_state_path / load_parameters_path against the model, before anything is written."""
  if config.load_full_state_path:
    check_compatible(items_path("load_full_state_path", config.load_full_state_path), layout.abstract)
  if config.load_parameters_path:
    path = items_path("load_parameters_path", config.load_parameters_path)
    _check_quantization(config, path)
    check_compatible(path, {"params": _start_params(config, layout, path)})


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


def _layer_layout_mismatch(path: str, missing: str, stored) -> str | None:
  """The message for a checkpoint whose decoder layers are stacked (scan_layers=true: params.layers) while the
  config wants them one by one (params.layers_0, ...), or the reverse; None if that is not why `missing` is."""
  # A layer stack's name is `layers`, or DeepSeek's dense_layers / moe_layers (decoders.layer_stacks).
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


def _check_quantization(config: Config, path: str) -> None:
  """Quantized parameters load only as such, with the settings they were saved with; float ones only as float."""
  where = f"load_parameters_path={path}" if config.load_parameters_path else f"checkpoint {path}"
  quantizations.check_saved(config, _saved_quantization(path), where)


def _saved_quantization(items: str) -> dict | None:
  """The quantizations.settings recorded beside a checkpoint's items folder; None for float parameters."""
  path = storage.join(storage.dirname(items), QUANTIZATION_ITEM, "metadata")
  if not storage.exists(path):
    return None
  try:
    return json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    raise Damaged(storage.dirname(items), f"its quantization record cannot be read ({_error_text(e)})") from None
