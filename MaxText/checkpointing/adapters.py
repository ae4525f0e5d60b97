"""LoRA adapters where checkpoints meet the config: whether a checkpoint stores adapters, the params that
load_parameters_path restores under LoRA (from a base model without adapters, all but the adapters, which then start
fresh), and the adapters of a Hugging Face PEFT folder (hf_lora_adapter_path), read and placed with the layout's
shardings.
"""

import jax

from MaxText import integrity, lora
from MaxText.checkpointing.damage import _metadata
from MaxText.common_types import Config
from MaxText.layers import decoders
from MaxText.state import StateLayout


def stores_adapters(path: str) -> bool:
  """Whether the checkpoint at `path` (its items) holds LoRA adapters."""
  return any(
    lora.is_adapter(tuple(integrity.leaf_name(p).split(".")))
    for p, _ in jax.tree_util.tree_leaves_with_path(_metadata(path))
  )


def _start_params(config: Config, layout: StateLayout, path: str):
  """The abstract params load_parameters_path restores: all of them, or under LoRA from a checkpoint without
  adapters (a base model), all but the adapters, which then start fresh."""
  if config.lora_rank > 0 and not stores_adapters(path):
    return lora.partition(layout.abstract.params)[1]
  return layout.abstract.params


def _with_peft_adapter(config: Config, layout: StateLayout, params: dict) -> dict:
  """`params` with the adapters of the PEFT folder hf_lora_adapter_path, placed with the layout's shardings."""
  from MaxText import families
  from MaxText.convert import peft

  adapters, shardings = lora.partition(layout.abstract.params)[0], lora.partition(layout.shardings.params)[0]
  where = lambda path, i: decoders.param_path(config, path, i)  # noqa: E731
  read = peft.read_adapter(config.hf_lora_adapter_path, config, families.hf_mapping(config), adapters, where)
  placed = jax.tree_util.tree_map(lambda x, a, s: jax.device_put(x.astype(a.dtype), s), read, adapters, shardings)
  return lora.combine(placed, lora.partition(params)[1])
