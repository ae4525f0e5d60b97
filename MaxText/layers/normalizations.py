"""Normalization layers, computed in float32: RMSNorm (Zhang and Sennrich 2019, arXiv:1910.07467) and LayerNorm
(Ba et al. 2016, arXiv:1607.06450)."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText.common_types import Config
from MaxText.layers.linears import dtypes


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * (scale_offset + scale). x: [..., embed] -> same shape, activation dtype.

  Gemma stores its scale as an offset from 1 (scale_offset=1, scale initialised to 0), so its published
  weights load unchanged.
  """

  config: Config
  scale_offset: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype, weight_dtype = dtypes(self.config)
    init = nn.initializers.zeros if self.scale_offset else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, (ct.NORM,)), (x.shape[-1],), weight_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.normalization_layer_epsilon)
    if self.scale_offset:  # Gemma multiplies in float32 before casting, as its reference does.
      return (y * (self.scale_offset + scale.astype(jnp.float32))).astype(dtype)
    return y.astype(dtype) * scale.astype(dtype)


class LayerNorm(nn.Module):
  """y = (x - mean) / sqrt(var + eps) * scale + bias over the last axis (GPT-2/3)."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype, weight_dtype = dtypes(self.config)
    size = (x.shape[-1],)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ct.NORM,)), size, weight_dtype)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, (ct.NORM,)), size, weight_dtype)
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + self.config.normalization_layer_epsilon)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(dtype)
