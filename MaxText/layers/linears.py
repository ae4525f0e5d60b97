"""Dense projections and the gated MLP."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import lora, sharding
from MaxText.common_types import Config
from MaxText.sections import implement
from MaxText.sections import layers as section

# The names are the section's (sections/layers.py), which the config is checked against.
DTYPES = {name: getattr(jnp, name) for name in section.DTYPES}
PRECISIONS = {name: jax.lax.Precision[name.upper()] for name in section.PRECISIONS}
ACTIVATIONS = implement(
  section.ACTIVATIONS,
  {"silu": nn.silu, "gelu": nn.gelu, "relu": nn.relu, "tanh": jnp.tanh, "sigmoid": nn.sigmoid, "linear": lambda x: x},
)
# gpt-oss's clamped SwiGLU (mlp_activations_limit > 0): its activations, and the gain of its sigmoid (OpenAI's
# reference implementation, and MaxText's, fix it at 1.702: x * sigmoid(1.702 x) approximates GELU).
CLAMPED_SWIGLU = section.CLAMPED_SWIGLU
SWIGLU_ALPHA = section.SWIGLU_ALPHA


def dtypes(config: Config) -> tuple[jnp.dtype, jnp.dtype]:
  """(activation dtype, weight dtype) of a config."""
  return DTYPES[config.dtype], DTYPES[config.weight_dtype]


class DenseGeneral(nn.Module):
  """y = x . W contracting the last `num_in` axes of x with the first `num_in` axes of W.

  W has shape in_features + features and logical axes `kernel_axes`; it is stored in weight_dtype and
  used in the activation dtype. Initialised by LeCun-normal (truncated, fan-in over all input axes), as
  MaxText's `nd_dense_init(1.0, "fan_in", "truncated_normal")`. use_bias adds b [features] (zeros at init).
  A projection whose name is in lora_target_modules (with lora_rank > 0) adds a LoRA adapter (MaxText/lora.py).
  """

  features: Sequence[int]
  kernel_axes: Sequence[str]
  config: Config
  num_in: int = 1
  use_bias: bool = False
  compute_dtype: jnp.dtype | None = None  # Overrides the activation dtype (logits_dot_in_fp32).
  adapter: bool = False  # Whether this projection may take a LoRA adapter (attention and MLP projections).

  @nn.compact
  def __call__(self, x: jax.Array, weights_only: bool = False):
    """x . W (+ b); with weights_only, (W, b or None) in the compute dtype instead, for fused_projection."""
    dtype, weight_dtype = dtypes(self.config)
    dtype = self.compute_dtype or dtype
    in_shape = x.shape[-self.num_in :]
    features = tuple(self.features)
    n_out = len(features)
    init = nn.initializers.variance_scaling(
      1.0,
      "fan_in",
      "truncated_normal",
      in_axis=tuple(range(self.num_in)),
      out_axis=tuple(range(self.num_in, self.num_in + n_out)),
    )
    kernel = self.param(
      "kernel", nn.with_logical_partitioning(init, tuple(self.kernel_axes)), in_shape + features, weight_dtype
    )
    bias = None
    if self.use_bias:
      bias_axes = tuple(self.kernel_axes)[self.num_in :]
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, bias_axes), features, weight_dtype)
      bias = bias.astype(dtype)
    adapter = (
      self._adapter(in_shape, features, weight_dtype) if self.adapter and lora.applies(self.config, self.name) else None
    )
    if weights_only:
      if adapter is not None:  # merged for the fused matmul, in float32: the same sum, W + s A B
        a, b = (w.astype(jnp.float32) for w in adapter)
        low = jnp.tensordot(a, b, axes=([-1], [0]), precision=PRECISIONS[self.config.matmul_precision])
        kernel = kernel.astype(jnp.float32) + lora.scale(self.config) * low
      return kernel.astype(dtype), bias
    # jnp.asarray, not .astype: under weight-only quantization (qwix PTQ) the kernel is a quantized array, which
    # qwix's asarray keeps quantized.
    y = _contract(x.astype(dtype), jnp.asarray(kernel, dtype), self.num_in, self.config)
    if adapter is not None:
      a, b = (w.astype(dtype) for w in adapter)
      low = _contract(_contract(x.astype(dtype), a, self.num_in, self.config), b, 1, self.config)
      y = y + (lora.scale(self.config) * low).astype(dtype)
    return y if bias is None else y + bias

  def _adapter(self, in_shape, features, weight_dtype):
    """(lora_a [*in, r], lora_b [r, *out]) with PEFT's init: A uniform in +-1/sqrt(fan_in), B zeros."""
    rank, n_in = self.config.lora_rank, len(in_shape)
    in_axes, out_axes = tuple(self.kernel_axes)[:n_in], tuple(self.kernel_axes)[n_in:]
    a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform", in_axis=tuple(range(n_in)), out_axis=n_in)
    a = self.param("lora_a", nn.with_logical_partitioning(a_init, (*in_axes, ct.LORA_RANK)), (*in_shape, rank), weight_dtype)
    b = self.param(
      "lora_b",
      nn.with_logical_partitioning(nn.initializers.zeros, (ct.LORA_RANK, *out_axes)),
      (rank, *features),
      weight_dtype,
    )
    return a, b


def _contract(x: jax.Array, kernel: jax.Array, num_in: int, config: Config) -> jax.Array:
  """x [..., *in] . kernel [*in, *out] -> [..., *out]."""
  contract_x = tuple(range(x.ndim - num_in, x.ndim))
  return jax.lax.dot_general(
    x, kernel, ((contract_x, tuple(range(num_in))), ((), ())), precision=PRECISIONS[config.matmul_precision]
  )


def fused_projection(x: jax.Array, layers: Sequence[DenseGeneral]) -> list[jax.Array]:
  """[layer(x) for layer in layers] as one matmul (fused_qkv, fused_mlp), with the same parameters.

  The layers' kernels (same input and output shapes) are stacked on a new axis after the input axes, so the
  stacked kernel keeps each one's sharding; each output column is the same dot product as unfused.
  """
  weights = [layer(x, weights_only=True) for layer in layers]
  num_in = layers[0].num_in
  kernel = jnp.stack([w for w, _ in weights], axis=num_in)  # [*in, n, *out]
  y = _contract(x.astype(kernel.dtype), kernel, num_in, layers[0].config)  # [..., n, *out]
  outs = [jnp.take(y, i, axis=x.ndim - num_in) for i in range(len(layers))]
  return [out if b is None else out + b for out, (_, b) in zip(outs, weights, strict=True)]


def gated_activation(projections: Sequence[jax.Array], config: Config) -> jax.Array:
  """A gated MLP's hidden layer from its input projections, one per mlp_activations entry (each named "mlpwi" for
  remat): prod_i act_i(projection_i), e.g. SwiGLU for [silu, linear].

  With mlp_activations_limit > 0, gpt-oss's clamped SwiGLU over mlp_activations [sigmoid, linear] (OpenAI's
  reference `swiglu`; MaxText's apply_ffn_activation): the gate g clamped above at the limit, the linear input u to
  [-limit, limit], then g * sigmoid(1.702 g) * (u + 1). Clamping passes no gradient beyond the limits, as torch's.
  """
  projections = [checkpoint_name(p, "mlpwi") for p in projections]
  limit = config.mlp_activations_limit
  if limit > 0:  # pyconfig has checked the activations are CLAMPED_SWIGLU's
    gate, up = projections
    gate = jnp.minimum(gate, limit)
    return gate * nn.sigmoid(SWIGLU_ALPHA * gate) * (jnp.clip(up, -limit, limit) + 1)
  hidden = None
  for projection, act in zip(projections, config.mlp_activations, strict=True):
    h = ACTIVATIONS[act](projection)
    hidden = h if hidden is None else hidden * h
  return hidden


class MlpBlock(nn.Module):
  """Gated MLP: wo(prod_i act_i(wi_i x)), e.g. SwiGLU for mlp_activations=[silu, linear] (Shazeer 2020), GeGLU
  for [gelu, linear] (Gemma), or one GELU projection for [gelu] (GPT-2/3, with use_bias); see gated_activation.

  x: [batch, length, embed] -> [batch, length, embed].
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  use_bias: bool = False
  mlp_dim: int | None = None  # The hidden width; None is the config's mlp_dim (MoE shared experts set their own).

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    wi = [
      DenseGeneral(
        (self.mlp_dim or cfg.mlp_dim,), (ct.EMBED, ct.MLP), cfg, use_bias=self.use_bias, adapter=True, name=f"wi_{i}"
      )
      for i in range(len(cfg.mlp_activations))
    ]
    fused = cfg.fused_mlp and len(wi) > 1
    projections = fused_projection(x, wi) if fused else [layer(x) for layer in wi]
    hidden = sharding.constrain(gated_activation(projections, cfg), (ct.BATCH, ct.LENGTH, ct.ACT_MLP), self.mesh, cfg)
    out = DenseGeneral((cfg.emb_dim,), (ct.MLP, ct.EMBED), cfg, use_bias=self.use_bias, adapter=True, name="wo")(hidden)
    return checkpoint_name(out, "mlpwo")
