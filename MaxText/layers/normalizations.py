"""RMSNorm (Zhang and Sennrich 2019, arXiv:1910.07467), computed in float32."""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText.layers.linears import dtypes
from MaxText.pyconfig import Config


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale. x: [..., embed] -> same shape, activation dtype."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dtype, weight_dtype = dtypes(self.config)
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, (ct.NORM,)), (x.shape[-1],), weight_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.normalization_layer_epsilon)
    return y.astype(dtype) * scale.astype(dtype)
