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

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from MaxText.common_types import Config
from MaxText.sections.adapters import HF_NAMES  # our projection names -> the Hugging Face / PEFT module names

ADAPTERS = ("lora_a", "lora_b")


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
