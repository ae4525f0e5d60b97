"""Token embedding and rotary position embedding (RoPE)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from MaxText import common_types as ct
from MaxText.common_types import Config
from MaxText.layers.linears import PRECISIONS, dtypes
from MaxText.sections import layers as section


class Embed(nn.Module):
  """Embedding table [num_embeddings (default vocab_size), embed], initialised N(0, 1) as in MaxText; also the
  learned position table of GPT (num_embeddings=trainable_position_size)."""

  config: Config
  num_embeddings: int | None = None

  def setup(self):
    _, weight_dtype = dtypes(self.config)
    self.embedding = self.param(
      "embedding",
      nn.with_logical_partitioning(nn.initializers.normal(stddev=1.0), (ct.VOCAB, ct.EMBED)),
      (self.num_embeddings or self.config.vocab_size, self.config.emb_dim),
      weight_dtype,
    )

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """tokens [batch, length] int -> [batch, length, embed] in the activation dtype.

    use_iota_embed: a one-hot (iota == token) matmul instead of a gather, as MaxText does for TPUs; the same
    values exactly (each output is 1 x one row plus zeros).
    """
    dtype, _ = dtypes(self.config)
    if self.config.use_iota_embed:
      one_hot = tokens[..., None] == jnp.arange(self.embedding.shape[0], dtype=tokens.dtype)
      return jnp.dot(one_hot.astype(dtype), self.embedding.astype(dtype), precision=jax.lax.Precision.HIGHEST)
    return jnp.take(self.embedding, tokens, axis=0).astype(dtype)

  def attend(self, x: jax.Array, dtype: jnp.dtype | None = None) -> jax.Array:
    """Tied output projection: x [batch, length, embed] -> logits [batch, length, vocab], computed in `dtype`
    (default: the activation dtype)."""
    dtype = dtype or dtypes(self.config)[0]
    return jnp.einsum(
      "ble,ve->blv", x.astype(dtype), self.embedding.astype(dtype), precision=PRECISIONS[self.config.matmul_precision]
    )


ROPE_TYPES = section.ROPE_TYPES  # `rope_type`: RoFormer's frequencies, or scaled as Llama 3.1 or YaRN


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature sqrt(1/t) = 0.1 * mscale * ln(factor) + 1 (Peng et al. 2023, eq. 22)."""
  return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scale(config: Config) -> float:
  """The factor RoPE's outputs are multiplied by: YaRN's yarn_mscale with rope_attention_scaling, else 1."""
  if config.rope_type == "yarn" and config.rope_attention_scaling:
    return yarn_mscale(config.rope_factor, config.mscale)
  return 1.0


def rope_frequencies(config: Config, head_dim: int, theta: float | None = None) -> np.ndarray:
  """Angular frequency of each rotated pair, [head_dim // 2], computed in float64 and returned as float32.

  `theta`: a base other than rope_max_timescale, with RoFormer's frequencies unscaled whatever rope_type says (Gemma
  3's local layers); None: the config's RoPE.

  timescale_i = min * (max / min) ** (2i / head_dim) (RoFormer, Su et al. 2021, arXiv:2104.09864, with
  theta = rope_max_timescale). rope_type=llama3.1 rescales low frequencies as in Llama 3.1 (arXiv:2407.21783,
  and Meta's reference `apply_scaling`): wavelengths above original_len / low_freq_factor are divided by
  `rope_scaling_factor`, those below original_len / high_freq_factor kept, and the band between blended.
  rope_type=yarn (Peng et al. 2023, arXiv:2309.00071, "NTK-by-parts"): pairs that turn fewer than beta_slow
  times over original_max_position_embeddings are interpolated (frequency / rope_factor), those that turn more
  than beta_fast times kept, with a linear ramp between (bounds rounded outwards with rope_truncate).
  The frequencies depend only on the config, so they are constants of the compiled program.
  """
  fraction = 2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim
  lo, hi = float(config.rope_min_timescale), float(config.rope_max_timescale if theta is None else theta)
  freq = 1.0 / (lo * (hi / lo) ** fraction)
  if theta is not None:
    return freq.astype(np.float32)
  if config.rope_type == "llama3.1":
    old_len = float(config.rope_original_max_position)
    low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_scaling_factor
    wavelen = 2.0 * np.pi / freq
    smooth = (old_len / wavelen - low) / max(high - low, 1e-12)  # equal factors (Llama 4 Scout): no band to blend
    blended = (1.0 - smooth) * freq / factor + smooth * freq
    freq = np.where(wavelen < old_len / high, freq, np.where(wavelen > old_len / low, freq / factor, blended))
  if config.rope_type == "yarn":
    old_len, base = float(config.original_max_position_embeddings), hi / lo

    def pair_turning(rotations):  # the pair index that turns `rotations` times over old_len
      return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.beta_fast), pair_turning(config.beta_slow)
    if config.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / max(high - low, 0.001), 0.0, 1.0)
    freq = freq / config.rope_factor * ramp + freq * (1.0 - ramp)
  return freq.astype(np.float32)


def apply_rope(
  x: jax.Array, positions: jax.Array, freq: jax.Array, scale: float = 1.0, interleaved: bool = False
) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by positions [batch, length], times `scale` (rope_scale).

  Pairs are (i, i + head_dim/2), the "rotate half" layout of Hugging Face's Llama, computed in float32. With
  `interleaved` (DeepSeek's layout, rope_interleave) the pairs are (2i, 2i + 1); the rotated pairs are then
  returned in the rotate-half layout, as transformers' DeepSeek-V3 does. Queries and keys are permuted alike,
  so their dot products are those of the interleaved rotation.
  """
  angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [batch, length, 1, head_dim/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  if scale != 1.0:
    sin, cos = sin * scale, cos * scale
  if interleaved:
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  return _rotate(x, cos, sin)


# x1 cos - x2 sin, x2 cos + x1 sin for x = (x1, x2), in float32, rounded once to x's dtype. The forward is written as
# x cos + rotate_half(x) sin, rotate_half (x1, x2) -> (-x2, x1) taken in x's dtype (exact) and each operand widened
# where it is used: widening x first made XLA keep float32 copies of the queries and keys (on TPU it widened the
# projections' outputs; the 32B v5e-256 flash compile needed 0.6 GiB more temporaries per device). Its own VJP
# would round the two terms of each gradient to x's dtype before adding them; the backward below is the float32
# rotation by minus the angle, rounded once, as differentiating the float32 formula gives.
@jax.custom_vjp
def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  cos2, sin2 = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)
  return (x.astype(jnp.float32) * cos2 + rotated.astype(jnp.float32) * sin2).astype(x.dtype)


def _rotate_fwd(x, cos, sin):
  return _rotate(x, cos, sin), (cos, sin, jnp.zeros((), x.dtype))


def _rotate_bwd(residuals, g):
  cos, sin, like = residuals
  g1, g2 = jnp.split(g.astype(jnp.float32), 2, axis=-1)
  dx = jnp.concatenate([g1 * cos + g2 * sin, g2 * cos - g1 * sin], axis=-1)
  return dx.astype(like.dtype), None, None  # cos and sin come from positions and constants: no gradient


_rotate.defvjp(_rotate_fwd, _rotate_bwd)
