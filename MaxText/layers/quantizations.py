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
  matmul dequantizes them; `quantize_params` turns a float params tree into that form. The routed experts' kernels,
  which PTQ cannot find (quantize_experts), are quantized alike, per expert, and dequantized by MoeBlock (`dense`).

`quantization_targets` picks the matmuls: `TARGETS` maps each to a rule's module path (the router of a mixture of
experts, normalisation, embedding lookup and attention's own score and value products are never quantized).
"""

import contextlib
import importlib
import re
import traceback
from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from MaxText.common_types import Config, ConfigError
from MaxText.layers import decoders
from MaxText.sections import implement
from MaxText.sections import quantize as section

# quantization -> (weight, activation, gradient) dtypes of quantized training (MaxText's definitions).
TRAINING = implement(
  section.TRAINING,
  {
    "int8": (jnp.int8, jnp.int8, jnp.int8),
    "fp8": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    "fp8_full": (jnp.float8_e4m3fn, jnp.float8_e4m3fn, jnp.float8_e5m2),
  },
)
# quantization -> the weights' dtype of weight-only quantization (inference only).
WEIGHT_ONLY = implement(section.WEIGHT_ONLY, {"int8w": jnp.int8, "int4w": jnp.int4})
QUANTIZATIONS = section.QUANTIZATIONS

# quantization_targets -> the module paths (regular expressions, matched in full against the path of the module
# that calls dot_general or ragged_dot, e.g. "layers/self_attention/query", "layers_3/mlp/wo" unrolled,
# "layers/layer_1/mlp/wi_0" in a period of layers). The rules name those two ops only: the attention's score and
# value products and the experts' dispatch and combine (one-hot gathers) are jnp.einsum, which qwix then leaves alone.
#   attention: the projections, and fused_qkv's one matmul, which runs in self_attention itself;
#   mlp: a dense MLP's projections, and fused_mlp's, in mlp itself (an MoE block, also named mlp, has no matmul of its
#     own: its router is mlp/gate, its experts' matmuls run in moe.RoutedExperts, mlp/experts);
#   moe: the routed experts (mlp/experts; weight-only: their kernels, see quantize_experts) and the shared ones
#     (mlp/shared, an MLP), never the router (mlp/gate);
#   head: the untied output projection, in the Transformer or in the loss's vocabulary tiles (models.OutputHead).
_LAYER = r"(.*/)?"
TARGETS = implement(
  section.TARGETS,
  {
    "attention": _LAYER + r"self_attention(/[^/]+)?",
    "mlp": _LAYER + r"mlp(/(wi_\d+|wo))?",
    "moe": _LAYER + r"mlp/(experts|shared(/(wi_\d+|wo))?)",
    "head": r"logits_dense",
  },
)
OPS = ("dot_general", "ragged_dot")  # the ops the rules name (see TARGETS)
KV_QUANT_DTYPES = {name: getattr(jnp, name) for name in section.KV_QUANT_DTYPES}
KV_QUANT_AXES = section.KV_QUANT_AXES


def _qwix(module: str = ""):
  """qwix, or one of its modules, imported when a run quantizes (an unquantized run needs no qwix installed)."""
  return importlib.import_module(f"qwix.{module}" if module else "qwix")


def is_training(config: Config) -> bool:
  return config.quantization in TRAINING


def is_weight_only(config: Config) -> bool:
  return config.quantization in WEIGHT_ONLY


def _module_path(config: Config) -> str:
  return "|".join(f"({TARGETS[t]})" for t in config.quantization_targets)


def quantizes(config: Config, target: str) -> bool:
  """Whether training quantizes the matmuls of `target` (a TARGETS key)."""
  return is_training(config) and target in config.quantization_targets


def check_devices(config: Config, device) -> None:
  """Refuses, in one line naming the key, quantized training that `device`'s platform cannot run as asked:
  - fp8 on a GPU below compute capability 8.9 (Ada, Hopper and later have fp8 matmuls). The CPU converts fp8 dots
    to float; every TPU generation's compiler accepts them (libtpu 0.0.42.1 compiles f8 dots for v2 to v6e).
  - MoE experts by megablox on TPU: its Pallas kernel takes no quantized operands, and qwix reaches no matmul inside
    a Pallas call, so the experts would stay in float unseen; ragged_dot (megablox=false) is what qwix quantizes."""
  if not is_training(config):
    return
  if config.quantization.startswith("fp8") and device.platform == "gpu":
    capability = str(getattr(device, "compute_capability", ""))
    # CUDA reports "major.minor"; anything else (another vendor's GPU) is not judged here.
    if re.fullmatch(r"\d+\.\d+", capability) and tuple(map(int, capability.split("."))) < (8, 9):
      raise ConfigError(
        f"quantization={config.quantization} needs fp8 matmuls, which {device.device_kind} (compute capability "
        f"{capability}) does not have (8.9 or later: Ada, Hopper, Blackwell); use quantization=int8 or none"
      )
  if quantizes(config, "moe") and config.num_experts > 1 and config.sparse_matmul and config.capacity_factor <= 0:
    if device.platform == "tpu" and config.megablox:
      raise ConfigError(
        f"megablox=true with quantization={config.quantization} and moe in quantization_targets: the megablox kernel "
        "takes no quantized operands; set megablox=false (XLA's ragged_dot, which qwix quantizes), or drop moe from "
        "quantization_targets"
      )


def training_rules(config: Config) -> list:
  qwix = _qwix()
  weight, act, bwd = TRAINING[config.quantization]
  shards = config.quantization_local_shard_count
  shards = config.num_slices if shards == -1 else shards
  return [
    qwix.QtRule(
      module_path=_module_path(config),
      op_names=OPS,
      weight_qtype=weight,
      act_qtype=act,
      bwd_qtype=bwd,
      bwd_weight_grad_tile_size=1 / shards,
      weight_calibration_method=config.weight_quantization_calibration_method,
      act_calibration_method=config.act_quantization_calibration_method,
      bwd_calibration_method=config.bwd_quantization_calibration_method,
    )
  ]


_READ_WHOLE = r"(.*/)?wkv_b"  # weights a layer reads whole in some mode (see weight_only_rules)


def weight_only_rules(config: Config) -> list:
  """qwix's PTQ rule: the targets' weights in WEIGHT_ONLY's type, one scale per output channel or per
  quantization_group_size inputs of one (qwix's tile_size, on the innermost contraction axis). PTQ quantizes a
  weight only where the module that owns it as a parameter multiplies by it, so the routed experts' kernels, which
  MoeBlock owns and moe.RoutedExperts multiplies by (by ragged_dot too, which qwix 0.1.8's PtqProvider lacks), are
  not found by this rule: quantize_experts marks them in the layout, MoeBlock dequantizes them. Nor can a quantized
  weight be read whole (DenseGeneral(weights_only=True)), so the one a decode step reads so, MLA's wkv_b (folded into
  the query and the output), stays float, and fused_qkv / fused_mlp are refused (check)."""
  return [
    _qwix().QuantizationRule(
      module_path=rf"(?!{_READ_WHOLE}$)({_module_path(config)})",
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


# The routed experts' kernels as MoeBlock (always named mlp) owns them, [experts, in, out] per layer: the leaf itself is
# mlp/wi_<i> or mlp/wo (a dense MLP's are mlp/wi_0/kernel; the experts' biases mlp/wi_<i>_bias, mlp/wo_bias).
_EXPERT_KERNEL = re.compile(r"(.*/)?mlp/(wi_\d+|wo)")


def quantize_experts(boxed, model: nn.Module, config: Config):
  """The weight-only model's boxed params (its init under jax.eval_shape) with the routed experts' kernels marked
  for quantization as PTQ marks the weights it finds: qwix's WithAux of an int8/int4 value laid out like the kernel
  and a scale per expert and output channel (or per quantization_group_size inputs of one), in the kernel's dtype,
  from weight_quantization_calibration_method. PTQ finds none of them (the module multiplying by them,
  moe.RoutedExperts, does not own them), so its init leaves them float; marked here, quantize_params, the layout and
  a quantized checkpoint treat them as any other quantized weight, and MoeBlock dequantizes them (`dense`). The
  float tree (checkpoints, Hugging Face) keeps the kernels as they are. Only with `moe` in quantization_targets, and
  only for `model` made by quantize_model (a float model under the same config keeps float kernels)."""
  if not (is_weight_only(config) and "moe" in config.quantization_targets and _is_ptq(model)):
    return boxed
  qarray, ptq = _qwix("_src.core.qarray"), _qwix("_src.providers.ptq")
  how = qarray.HowToQuantize(
    qtype=WEIGHT_ONLY[config.quantization],
    channelwise_axes=[0, 2],  # the expert and the output channel
    tiled_axes={1: config.quantization_group_size} if config.quantization_group_size else {},
    calibration_method=config.weight_quantization_calibration_method,
  )
  scanned = _scanned(config)
  out = {}
  for path, leaf in flax.traverse_util.flatten_dict(boxed).items():
    out[path] = leaf
    lead = 1 if path[0] in scanned else 0  # a scanned stack's leading layers axis
    if not (isinstance(leaf, nn.Partitioned) and _EXPERT_KERNEL.fullmatch("/".join(path)) and leaf.value.ndim == 3 + lead):
      continue
    shape = leaf.value.shape
    _check_group(path, shape[lead:], how)
    quantized = jax.eval_shape(lambda w: qarray.quantize(w, how), jax.ShapeDtypeStruct(shape[lead:], leaf.value.dtype))

    def stacked(x, box=leaf):  # boxed with the kernel's logical names (unsplit_scales unsplits the scale's reduced axes)
      return box.replace(value=jax.ShapeDtypeStruct(shape[:lead] + x.shape, x.dtype))

    out[path] = ptq.WithAux(quantized.replace(qvalue=stacked(quantized.qvalue), scale=stacked(quantized.scale)), how)
  return flax.traverse_util.unflatten_dict(out)


def _is_ptq(model: nn.Module) -> bool:
  """Whether `model` is quantize_model's weight-only model (qwix marks the class it makes with _unquantized_type)."""
  return getattr(type(model), "_unquantized_type", None) is not None


def dense(w, dtype):
  """An expert kernel in `dtype` for matmuls that take it as an operand (moe.RoutedExperts): a float one cast, a
  weight-only quantized one (the WithAux quantize_experts marks, which PTQ's self.param returns as it is) dequantized,
  its values times their scales in the scales' dtype, then cast: the float model's matmul on the dequantized weights,
  on every path (dropless, capacity, dense, megablox), while the params stay int8 / int4 in memory."""
  if isinstance(w, jax.Array | np.ndarray):
    return w.astype(dtype)
  return _qwix("_src.core.qarray").dequantize(w.array).astype(dtype)


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


# ---------------------------------------------------------------------------------------------- serving int8w / int4w
# The keys that shape a quantized params checkpoint's arrays: a load must give the values it was saved with.
SAVED_KEYS = ("quantization", "quantization_group_size", "quantization_targets")


def is_quantized(params) -> bool:
  """Whether `params` holds weight-only quantized leaves (quantize_params' output, or a quantized checkpoint's)."""
  ptq = _qwix("_src.providers.ptq")
  leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, ptq.WithAux))
  return any(isinstance(leaf, ptq.WithAux) for leaf in leaves)


def unsplit_scales(boxed):
  """The weight-only model's boxed params (its init under jax.eval_shape) with each scale's reduced axes unsplit.
  A scale keeps the logical axis of every output channel it has one value per (split like the weight's, so each
  device dequantizes its own columns), but not of an axis it reduces: a contraction axis (size 1; qwix already
  drops those names) or a tiled one (one value per group, a count a mesh axis need not divide; small, so replicated)."""
  ptq = _qwix("_src.providers.ptq")

  def unsplit(leaf):
    if not isinstance(leaf, ptq.WithAux):
      return leaf
    qvalue, scale = leaf.array.qvalue, leaf.array.scale
    names = tuple(
      name if s == q else None for name, s, q in zip(scale.names, scale.value.shape, qvalue.value.shape, strict=True)
    )
    return leaf.replace(array=leaf.array.replace(scale=scale.replace(names=names)))

  return jax.tree_util.tree_map(unsplit, boxed, is_leaf=lambda x: isinstance(x, ptq.WithAux))


@contextlib.contextmanager
def group_size_errors(config: Config):
  """qwix's error for a group (tile) that does not divide the input axis of a weight it quantizes, raised while the
  weight-only model initialises, as the one-line ConfigError naming quantization_group_size and the weight."""
  try:
    yield
  except ValueError as e:
    found = re.match(r"\((.*?),?\) cannot be tiled as \{(\d+): (\d+)\}", str(e))
    if found is None:
      raise
    shape = tuple(int(n) for n in found[1].split(","))
    axis = int(found[2])
    modules = [
      frame.f_locals["self"]
      for frame, _ in traceback.walk_tb(e.__traceback__)
      if isinstance(frame.f_locals.get("self"), nn.Module) and frame.f_locals["self"].scope is not None
    ]
    weight = f"{'/'.join(modules[-1].scope.path)}'s kernel" if modules else f"a weight of shape {shape}"
    raise ConfigError(
      f"quantization_group_size={config.quantization_group_size} does not divide the input dimension {shape[axis]} "
      f"of {weight}; give a divisor of every quantized matmul's input dimensions, or 0 for one scale per channel"
    ) from None


def quantize_on_mesh(params, abstract, shardings, config: Config):
  """quantize_params of `params` (float, on the mesh) into `shardings` (the weight-only params' layout), on the
  devices where each shard lives: no host ever holds the whole tree."""
  return jax.jit(lambda p: quantize_params(p, abstract, config), out_shardings=shardings)(params)


def widened(params):
  """Quantized params with int4 values widened to int8: the same integers (qwix dequantizes either), as a checkpoint
  stores them (Orbax and the checksums read whole bytes; restoring casts them back to the layout's int4)."""
  return jax.tree_util.tree_map(lambda x: x.astype(jnp.int8) if x.dtype == jnp.int4 else x, params)


def settings(config: Config) -> dict:
  """What a quantized params checkpoint records beside its arrays (SAVED_KEYS, and the calibration for the record)."""
  return {
    "quantization": config.quantization,
    "quantization_group_size": config.quantization_group_size,
    "quantization_targets": list(config.quantization_targets),
    "weight_quantization_calibration_method": config.weight_quantization_calibration_method,
  }


def check_saved(config: Config, recorded: dict | None, where: str) -> None:
  """Refuses, in one line naming the key, to load a checkpoint as what it is not: quantized parameters (`recorded`,
  their settings) without checkpoint_is_quantized or with other SAVED_KEYS, float ones (None) with it."""
  if recorded is None:
    if config.checkpoint_is_quantized:
      raise ConfigError(
        f"checkpoint_is_quantized=true but {where} holds float parameters (no quantization record beside them); "
        f"drop checkpoint_is_quantized to quantize them as they load, or give a checkpoint written by "
        "save_quantized_params_path"
      )
    return
  saved = " ".join(f"{key}={_shown(recorded.get(key))}" for key in SAVED_KEYS)
  if not config.checkpoint_is_quantized:
    raise ConfigError(
      f"checkpoint_is_quantized=false but {where} holds weight-only quantized parameters (saved by "
      f"save_quantized_params_path with {saved}); load them with checkpoint_is_quantized=true {saved}, or give the "
      "float checkpoint they were quantized from"
    )
  for key in SAVED_KEYS:
    value = list(getattr(config, key)) if key == "quantization_targets" else getattr(config, key)
    if recorded.get(key) != value:
      raise ConfigError(
        f"{key}={_shown(value)} but {where} was saved with {key}={_shown(recorded.get(key))}; load it with {saved}"
      )


def _shown(value) -> str:
  """A value as it is given on the command line (a list as YAML: quantization_targets='[attention, mlp]')."""
  return f"'[{', '.join(map(str, value))}]'" if isinstance(value, list | tuple) else str(value)
