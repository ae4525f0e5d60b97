"""Quantization through qwix (Google's JAX quantization library, MaxText's current path), applied to the model's
matmuls by interception: qwix wraps the Transformer and replaces the `jax.lax.dot_general` calls of the modules a
rule names, so no layer has a quantized copy.

- Quantized training (`quantization` = int8, fp8, fp8_full; MaxText's values): qwix's QT. Each matched matmul
  quantizes both operands on the fly, per channel (the weight per output channel, the activation per row) with a
  scale from `*_quantization_calibration_method`, multiplies in the quantized type and rescales; the backward pass
  quantizes the incoming gradient the same way (bwd dtype), its weight gradient in quantization_local_shard_count
  tiles of the contraction axis. The parameters stay in weight_dtype: checkpoints are those of an unquantized run.
- Weight-only serving (`quantization` = int8w, int4w): qwix's PTQ. The parameters a rule names are stored quantized
  (an int8/int4 value and a float scale per output channel, or per quantization_group_size inputs of each) and the
  matmul dequantizes them; `quantize_params` turns a float params tree into that form.

`quantization_targets` picks the matmuls: `TARGETS` maps each to a rule's module path (the router of a mixture of
experts, normalisation, embedding lookup and attention's own score and value products are never quantized).
"""

import importlib
from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText.common_types import Config, ConfigError
from MaxText.layers import decoders

# quantization -> (weight, activation, gradient) dtypes of quantized training (MaxText's definitions).
TRAINING = {
  "int8": (jnp.int8, jnp.int8, jnp.int8),
  "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
  "fp8_full": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2),
}
# quantization -> the weights' dtype of weight-only quantization (inference only).
WEIGHT_ONLY = {"int8w": jnp.int8, "int4w": jnp.int4}
QUANTIZATIONS = ("", *TRAINING, *WEIGHT_ONLY)

# quantization_targets -> the module paths (regular expressions, matched in full against the path of the module
# that calls dot_general, e.g. "layers/self_attention/query", "layers_3/mlp/wo" unrolled, "layers/layer_1/mlp/wi_0"
# in a period of layers).
_LAYER = r"(.*/)?"
TARGETS = {
  "attention": _LAYER + r"self_attention/[^/]+",
  "mlp": _LAYER + r"mlp/(wi_\d+|wo)",
  "moe": _LAYER + r"mlp/(shared/[^/]+|experts)",
  "head": r"logits_dense",
}
KV_QUANT_DTYPES = {"int8": jnp.int8}
KV_QUANT_AXES = ("dkv", "heads_and_dkv")


def _qwix(module: str = ""):
  """qwix, or one of its modules, imported when a run quantizes (an unquantized run needs no qwix installed)."""
  return importlib.import_module(f"qwix.{module}" if module else "qwix")


def check(values: Mapping) -> None:
  """The quantization keys' own checks (config_validate calls this with the raw values)."""
  name = values["quantization"]
  if name and not values["use_qwix_quantization"]:
    raise ConfigError(
      f"use_qwix_quantization=false with quantization={name}: AQT, MaxText's older path, is not supported; "
      "set use_qwix_quantization=true"
    )
  unknown = [t for t in values["quantization_targets"] if t not in TARGETS]
  if unknown:
    raise ConfigError(f"quantization_targets contains {unknown[0]!r}; choose among {', '.join(TARGETS)}")
  group = values["quantization_group_size"]
  if group < 0:
    raise ConfigError(f"quantization_group_size={group} is negative; give 0 (one scale per channel) or a group size")
  if group and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"quantization_group_size={group} applies to weight-only quantization; set quantization to int8w or int4w"
    )
  if values["save_quantized_params_path"] and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"save_quantized_params_path={values['save_quantized_params_path']} writes weight-only quantized parameters; "
      "set quantization to int8w or int4w"
    )
  if values["checkpoint_is_quantized"] and name not in WEIGHT_ONLY:
    raise ConfigError(
      f"checkpoint_is_quantized=true with quantization={name or '(none)'}: quantized parameters load only into "
      "their weight-only model; set quantization to the int8w or int4w they were saved with"
    )


def is_training(config: Config) -> bool:
  return config.quantization in TRAINING


def is_weight_only(config: Config) -> bool:
  return config.quantization in WEIGHT_ONLY


def _module_path(config: Config) -> str:
  return "|".join(f"({TARGETS[t]})" for t in config.quantization_targets)


def training_rules(config: Config) -> list:
  qwix = _qwix()
  weight, act, bwd = TRAINING[config.quantization]
  shards = config.quantization_local_shard_count
  shards = config.num_slices if shards == -1 else shards
  return [
    qwix.QtRule(
      module_path=_module_path(config),
      op_names=("dot_general",),
      weight_qtype=weight,
      act_qtype=act,
      bwd_qtype=bwd,
      bwd_weight_grad_tile_size=1 / shards,
      weight_calibration_method=config.weight_quantization_calibration_method,
      act_calibration_method=config.act_quantization_calibration_method,
      bwd_calibration_method=config.bwd_quantization_calibration_method,
    )
  ]


def weight_only_rules(config: Config) -> list:
  return [
    _qwix().QuantizationRule(
      module_path=_module_path(config),
      op_names=("dot_general",),
      weight_qtype=WEIGHT_ONLY[config.quantization],
      tile_size=config.quantization_group_size or None,
      weight_calibration_method=config.weight_quantization_calibration_method,
    )
  ]


def quantize_model(model: nn.Module, config: Config) -> nn.Module:
  """`model` with the config's quantization (the model itself without one). The quantized-training model takes the
  float parameters; the weight-only one takes quantize_params' tree."""
  qwix = _qwix() if config.quantization else None
  if is_training(config):
    return qwix.quantize_model(model, qwix.QtProvider(training_rules(config)))
  if is_weight_only(config):
    return qwix.quantize_model(model, qwix.PtqProvider(weight_only_rules(config)))
  return model


def _scanned(config: Config) -> set[str]:
  """The top-level parameter collections whose leaves carry a leading layers axis (scanned stacks)."""
  return {stack.name for stack in decoders.layer_stacks(config)} if config.scan_layers else set()


def quantize_params(params: Mapping, abstract: Mapping, config: Config) -> dict:
  """Float params (unboxed, as training keeps them) -> the weight-only model's params: each leaf the abstract
  tree (the quantized model's init, under jax.eval_shape) marks for quantization becomes qwix's quantized array,
  the others pass through. A scanned stack's leaves are quantized layer by layer (their scales per layer)."""
  qarray, ptq = _qwix("_src.core.qarray"), _qwix("_src.providers.ptq")
  scanned = _scanned(config)
  out = {}
  for path, leaf in flax.traverse_util.flatten_dict(params).items():
    target = abstract
    for key in path:
      target = target[key]
    out[path] = leaf
    if isinstance(target, ptq.WithAux):
      _check_group(path, leaf.shape[1:] if path[0] in scanned else leaf.shape, target.how)

      def quantize(w, how=target.how):
        return qarray.quantize(w, how)

      out[path] = target.replace(array=(jax.vmap(quantize) if path[0] in scanned else quantize)(leaf))
  return flax.traverse_util.unflatten_dict(out)


def _check_group(path: tuple, shape: tuple, how) -> None:
  """A group size must divide the input axis it tiles."""
  for axis, size in how.tiled_axes.items():
    if isinstance(size, int) and shape[axis] % size:
      raise ConfigError(
        f"quantization_group_size={size} does not divide {'/'.join(map(str, path))}'s input dimension "
        f"{shape[axis]}; give a divisor of it, or 0 for one scale per channel"
      )
