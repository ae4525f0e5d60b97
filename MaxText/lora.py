"""LoRA (Hu et al. 2021, arXiv:2106.09685): low-rank adapters on the dense projections, the base weights frozen.

With lora_rank = r > 0, each projection named in lora_target_modules (attention query, key, value, out; MLP
wi_0, wi_1, wo) gains two parameters beside its kernel W [*in, *out]:

  lora_a [*in, r]   PEFT's init: uniform in +-1/sqrt(fan_in)
  lora_b [r, *out]  zeros, so a fresh adapter leaves the model as it was

and computes x W + (lora_alpha / r) (x A) B. Training differentiates only the adapters (`partition`), the
optimizer state covers only them (state.py), and the base weights stay bit for bit. DPO under LoRA takes the base
(the adapters off, `adapters_off`) as its reference model, with no copy of the weights. `merge` folds the
adapters into the kernels, for export and serving.
"""

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from MaxText.common_types import Config, ConfigError, cut, shown

ADAPTERS = ("lora_a", "lora_b")
# hf_lora_export: how convert_to_hf_checkpoint.py writes a LoRA checkpoint: "merged" (the adapters folded into the
# kernels), "adapter" (a PEFT adapter folder), "base" (the model without its adapters).
HF_EXPORTS = ("merged", "adapter", "base")
# Our projection names -> the Hugging Face / PEFT module names of the Llama-like families.
HF_NAMES = {
  "query": "q_proj",
  "key": "k_proj",
  "value": "v_proj",
  "out": "o_proj",
  "wi_0": "gate_proj",
  "wi_1": "up_proj",
  "wo": "down_proj",
}


def check(values: Mapping) -> None:
  """pyconfig's checks of the LoRA keys; raises ConfigError. lora_target_modules is checked with lora_rank=0 too:
  a wrong name there is a mistake the user meets once they turn LoRA on, so it is reported now."""
  rank, targets = values["lora_rank"], values["lora_target_modules"]
  if rank < 0:
    raise ConfigError(f"lora_rank={rank} is negative; give the adapters' rank (0 turns LoRA off)")
  unknown = [t for t in targets if t not in HF_NAMES and t not in HF_NAMES.values()]
  if unknown or not targets:
    raise ConfigError(
      f"lora_target_modules={shown(list(targets))}: {cut(unknown[0]) if unknown else 'empty'} is not a projection with "
      f"adapters; choose from {list(HF_NAMES)} (or PEFT's {list(HF_NAMES.values())})"
    )
  if rank == 0:
    if values["hf_lora_adapter_path"]:
      raise ConfigError("hf_lora_adapter_path is set but lora_rank=0; set lora_rank (and lora_alpha) to the adapter's")
    if values["hf_lora_export"] != "merged":
      raise ConfigError(
        f"hf_lora_export={values['hf_lora_export']} exports a LoRA checkpoint's adapters; give the run's lora_rank, "
        "lora_alpha and lora_target_modules"
      )
    return
  if values["lora_alpha"] <= 0:
    raise ConfigError(f"lora_alpha={values['lora_alpha']} must be > 0 (an adapter adds lora_alpha / lora_rank x A B)")
  smallest = min(values["emb_dim"], values["head_dim"], values["mlp_dim"])
  if rank >= smallest:
    raise ConfigError(
      f"lora_rank={rank} is not below the model's smallest projection width ({smallest}); a low-rank adapter "
      f"needs lora_rank < {smallest}"
    )


def targets(config: Config) -> tuple[str, ...]:
  """lora_target_modules in our names."""
  ours = {hf: name for name, hf in HF_NAMES.items()}
  return tuple(ours.get(t, t) for t in config.lora_target_modules)


def applies(config: Config, name: str | None) -> bool:
  """Whether the projection `name` (query, ..., wo) has adapters."""
  return config.lora_rank > 0 and name in targets(config)


def scale(config: Config) -> float:
  return config.lora_alpha / config.lora_rank


def is_adapter(path: tuple) -> bool:
  return path[-1] in ADAPTERS


def partition(params: dict) -> tuple[dict, dict]:
  """(the adapters, the rest): two nested dicts with the params' structure, each holding its own leaves."""
  flat = traverse_util.flatten_dict(params)
  adapters = {k: v for k, v in flat.items() if is_adapter(k)}
  base = {k: v for k, v in flat.items() if not is_adapter(k)}
  return traverse_util.unflatten_dict(adapters), traverse_util.unflatten_dict(base)


def combine(adapters: dict, base: dict) -> dict:
  """The inverse of partition."""
  return traverse_util.unflatten_dict(traverse_util.flatten_dict(base) | traverse_util.flatten_dict(adapters))


def adapters_off(params: dict) -> dict:
  """The params with every lora_b zero: the base model, exactly (DPO's reference under LoRA)."""
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: jnp.zeros_like(v) if k[-1] == "lora_b" else v for k, v in flat.items()})


def merge(params: dict, config: Config) -> dict:
  """The params with each adapter folded into its kernel, W + (lora_alpha / r) A B (in float32, then the kernel's
  dtype), and no adapter leaves: a model for lora_rank=0. Host (NumPy) params are merged on the host, a kernel at
  a time; jax.Arrays (jitted, sharded) by JAX."""
  flat = traverse_util.flatten_dict(params)
  merged = {}
  for path, value in flat.items():
    if is_adapter(path):
      continue
    a, b = flat.get((*path[:-1], "lora_a")), flat.get((*path[:-1], "lora_b"))
    if path[-1] == "kernel" and a is not None:
      xp = np if all(isinstance(x, np.ndarray) for x in (value, a, b)) else jnp
      f32 = [xp.asarray(x, xp.float32) for x in (value, a, b)]
      merged[path] = (f32[0] + scale(config) * _product(*f32[1:], value.ndim, xp)).astype(value.dtype)
    else:
      merged[path] = value
  return traverse_util.unflatten_dict(merged)


def _product(a, b, kernel_ndim: int, xp=jnp):
  """A [*in, r] B [r, *out] -> [*in, *out] in float32; scanned stacks (a leading layers axis on all three) layer by
  layer (a batched matmul)."""
  scanned = (a.ndim - 1) + (b.ndim - 1) == kernel_ndim + 1
  lead = a.shape[:1] if scanned else ()
  in_shape, out_shape = a.shape[len(lead) : -1], b.shape[len(lead) + 1 :]
  a2 = a.reshape(*lead, math.prod(in_shape), a.shape[-1])
  b2 = b.reshape(*lead, b.shape[len(lead)], math.prod(out_shape))
  product = xp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST) if xp is jnp else xp.matmul(a2, b2)
  return product.reshape(*lead, *in_shape, *out_shape)
