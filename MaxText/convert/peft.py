"""PEFT's LoRA adapter folders (adapter_config.json + adapter_model.safetensors) <-> our lora_a / lora_b.

PEFT names an adapter's tensors base_model.model.{module}.lora_A.weight [r, in] and .lora_B.weight [out, r], where
{module} is the Hugging Face name of the adapted linear layer (model.layers.3.self_attn.q_proj); it scales B A x by
lora_alpha / r, as we do (MaxText/lora.py). The linear groups of hf_families carry the conversion of their adapters
(Group.adapter): A converts as the kernel's inputs do, B as its outputs.

`where(path, layer)` is decoders.param_path bound to the config: where a per-layer path of ours lives in the
params (a scanned stack and an index, or a layer of its own).
"""

import json
import os
from collections.abc import Callable, Iterator

import numpy as np

from MaxText import lora
from MaxText.common_types import Config, ConfigError
from MaxText.convert import get, hf_families, new_file_mode, put

PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
Where = Callable[[str, int | None], tuple[str, int | None]]


def _adapter_groups(config: Config, mapping: hf_families.HFMapping) -> Iterator[tuple[hf_families.Group, int | None]]:
  """(lora_A or lora_B group, layer index or None) of every projection lora_target_modules names."""
  model_groups, layer_groups = mapping.layout(config)
  instances = [(g, None) for g in model_groups]
  instances += [(g, i) for i in range(config.num_decoder_layers) for g in hf_families.layer_groups(layer_groups, i)]
  for group, i in instances:
    module = group.ours[0].removesuffix(".kernel").rsplit(".", 1)[-1]
    if group.adapter is not None and lora.applies(config, module):
      for adapter_group in group.adapter(config.lora_rank):
        yield adapter_group, i


def _present(tree: dict, where: Where, group: hf_families.Group, i: int | None) -> tuple[str, int | None] | None:
  """Where the group's parameter is in `tree`, or None when this model has no adapter there (MLA's out)."""
  dotted, index = where(group.ours[0], i)
  try:
    get(tree, dotted)
  except (KeyError, TypeError):
    return None
  return dotted, index


def write_adapter(folder: str, config: Config, mapping: hf_families.HFMapping, adapters: dict, where: Where) -> int:
  """Writes `adapters` (our lora_a / lora_b leaves, host arrays) as a PEFT folder; returns the tensor count."""
  from safetensors.numpy import save_file

  tensors = {}
  for group, i in _adapter_groups(config, mapping):
    found = _present(adapters, where, group, i)
    if found is None:
      continue
    value = np.asarray(get(adapters, found[0]))
    (array,) = group.to_hf(value if found[1] is None else value[found[1]])
    tensors[PREFIX + group.hf[0].format(i=i)] = np.ascontiguousarray(array)
  if not tensors:
    raise ConfigError(f"lora_target_modules={list(config.lora_target_modules)}: this model has no adapters to export")
  modules = sorted({name.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for name in tensors})
  save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
  os.chmod(os.path.join(folder, WEIGHTS_FILE), new_file_mode())  # as open() makes adapter_config.json
  settings = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "r": config.lora_rank,
    "lora_alpha": config.lora_alpha,
    "lora_dropout": 0.0,
    "bias": "none",
    "use_rslora": False,
    "use_dora": False,
    "fan_in_fan_out": False,
    "init_lora_weights": True,
    "target_modules": modules,  # exact module names: PEFT matches an entry as a suffix of a module's name
    "base_model_name_or_path": None,
    "inference_mode": True,
  }
  with open(os.path.join(folder, CONFIG_FILE), "w") as f:
    json.dump(settings, f, indent=2)
  return len(tensors)


def read_adapter(folder: str, config: Config, mapping: hf_families.HFMapping, abstract: dict, where: Where) -> dict:
  """The adapters of the PEFT folder as host arrays shaped like `abstract` (our lora_a / lora_b leaves); raises
  ConfigError when the folder's rank, alpha or modules differ from the config's."""
  from safetensors.numpy import load_file

  folder = os.path.expanduser(folder)
  paths = [os.path.join(folder, name) for name in (CONFIG_FILE, WEIGHTS_FILE)]
  if not all(os.path.isfile(p) for p in paths):
    raise ConfigError(f"hf_lora_adapter_path={folder} has no {CONFIG_FILE} and {WEIGHTS_FILE}; give a PEFT adapter folder")
  with open(paths[0], encoding="utf-8") as f:
    settings = json.load(f)
  _check_settings(settings, config, folder)
  stored = load_file(paths[1])
  stored = {
    name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v for name, v in stored.items()
  }
  out, used = {}, set()
  for group, i in _adapter_groups(config, mapping):
    found = _present(abstract, where, group, i)
    if found is None:
      continue
    name = PREFIX + group.hf[0].format(i=i)
    if name not in stored:
      raise ConfigError(
        f"hf_lora_adapter_path={folder} has no {name}; set lora_target_modules to the adapter's modules "
        f"({sorted({n.removeprefix(PREFIX).rsplit('.lora_', 1)[0].rsplit('.', 1)[-1] for n in stored})})"
      )
    dotted, index = found
    leaf = get(abstract, dotted)
    want = leaf.shape[1:] if index is not None else leaf.shape
    try:
      (value,) = group.to_ours(stored[name])
    except ValueError:
      value = None
    if value is None or tuple(value.shape) != tuple(want):
      raise ConfigError(
        f"hf_lora_adapter_path={folder}: {name} has shape {tuple(stored[name].shape)}, which does not fit this "
        "model; give the adapter of this base model"
      )
    try:
      target = get(out, dotted)
    except KeyError:
      target = np.zeros(leaf.shape, value.dtype) if index is not None else None
    if index is None:
      target = value
    else:
      target[index] = value
    put(out, dotted, target)
    used.add(name)
  extra = sorted(set(stored) - used)
  if extra:
    raise ConfigError(
      f"hf_lora_adapter_path={folder} holds {extra[0]} (and {len(extra) - 1} more) that lora_target_modules="
      f"{list(config.lora_target_modules)} has no adapter for; add its module to lora_target_modules"
    )
  return out


def _check_settings(settings: dict, config: Config, folder: str) -> None:
  if settings.get("peft_type") != "LORA":
    raise ConfigError(f"hf_lora_adapter_path={folder} is a {settings.get('peft_type')} adapter; only LORA is supported")
  for key, ours in (("r", "lora_rank"), ("lora_alpha", "lora_alpha")):
    if float(settings.get(key, -1)) != float(getattr(config, ours)):
      raise ConfigError(
        f"hf_lora_adapter_path={folder} has {key}={settings.get(key)} but {ours}={getattr(config, ours)}; "
        f"set {ours}={settings.get(key)}"
      )
  for key in ("use_rslora", "use_dora"):
    if settings.get(key):
      raise ConfigError(f"hf_lora_adapter_path={folder} sets {key}=true, which is not supported")
  if settings.get("bias", "none") != "none" or settings.get("modules_to_save"):
    raise ConfigError(f"hf_lora_adapter_path={folder} trains biases or whole modules; only LoRA's A and B are supported")
  if settings.get("rank_pattern") or settings.get("alpha_pattern"):
    raise ConfigError(f"hf_lora_adapter_path={folder} gives some modules their own rank or alpha; not supported")
