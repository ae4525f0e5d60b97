"""Token embedding and rotary position embedding (RoPE)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from MaxText import common_types as ct
from MaxText.common_types import Config
from MaxText.layers.linears import PRECISIONS, dtypes


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


ROPE_TYPES = ("default", "llama3.1")  # `rope_type`: RoFormer's frequencies, or with Llama 3.1's scaling (below)


def rope_frequencies(config: Config, head_dim: int) -> np.ndarray:
  """Angular frequency of each rotated pair, [head_dim // 2], computed in float64 and returned as float32.

  timescale_i = min * (max / min) ** (2i / head_dim) (RoFormer, Su et al. 2021, arXiv:2104.09864, with
  theta = rope_max_timescale). rope_type=llama3.1 rescales low frequencies as in Llama 3.1 (arXiv:2407.21783,
  and Meta's reference `apply_scaling`): wavelengths above original_len / low_freq_factor are divided by
  `rope_scaling_factor`, those below original_len / high_freq_factor kept, and the band between blended.
  The frequencies depend only on the config, so they are constants of the compiled program.
  """
  fraction = 2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim
  lo, hi = float(config.rope_min_timescale), float(config.rope_max_timescale)
  freq = 1.0 / (lo * (hi / lo) ** fraction)
  if config.rope_type == "llama3.1":
    old_len = float(config.rope_original_max_position)
    low, high, factor = config.rope_low_freq_factor, config.rope_high_freq_factor, config.rope_scaling_factor
    wavelen = 2.0 * np.pi / freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1.0 - smooth) * freq / factor + smooth * freq
    freq = np.where(wavelen < old_len / high, freq, np.where(wavelen > old_len / low, freq / factor, blended))
  return freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, freq: jax.Array) -> jax.Array:
  """Rotates x [batch, length, heads, head_dim] by positions [batch, length].

  Pairs are (i, i + head_dim/2), the "rotate half" layout of Hugging Face's Llama, computed in float32.
  """
  angle = positions[:, :, None, None].astype(jnp.float32) * freq  # [batch, length, 1, head_dim/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
