"""The KV cache as the attention layers read it: contiguous rows, or fixed-size pages behind a page table.

A contiguous cache is a pair (keys, values) of [batch, cache_len, kv_heads, head_dim] per layer (MLA: its latent
and RoPE key, [..., 1, kv_lora_rank] and [..., 1, qk_rope_head_dim]). A paged cache (`Paged`) holds a pool of
pages, [pages, page_size, kv_heads, head_dim], and a page table [batch, pages_per_row]: row b's token at position
p lives in page table[b, p // page_size] at offset p % page_size, so a row holds only the pages its tokens fill
and rows can share the pages of a common prompt prefix (inference/kv_cache_manager.py hands pages out). The decoder's cache
carries a leading layers axis on every leaf, the page table included (the same table repeated: a scan over the
layers slices it with the pools), so the layers take either kind alike and read it through `rows`.

Quantized cache (quantize_kvcache=true, MaxText's keys): keys and values are stored as `Quantized`, kv_quant_dtype
(int8) values and a scale per token and kv_quant_axis group, so the pool takes about a quarter (float32) or half
(bfloat16) of the bytes. kv_quant_axis=dkv: one scale per token and head, over its head_dim; heads_and_dkv: one per
token, over all its heads. Symmetric absmax: scale = max|x| / 127 (kept in the keys' dtype), value = x / scale
rounded half to even and clipped to [-127, 127]; x is read back as value * scale. MLA's latent and RoPE key are one
"head" each, so both axes give a scale per token there. The engine quantizes what it writes into the pool
(`stored`); `rows` dequantizes what the layers read, and attention computes in the keys' dtype as before.

Which tokens a query sees quantized: those of earlier calls only. A call (a prefill chunk, a decode step) attends
to its own new tokens' exact keys and values, and to the cache, which holds the earlier calls' tokens quantized; as
in MaxText, a prompt prefilled in one chunk sees only exact keys (its logits, echo's logprobs and the first
generated token are the unquantized cache's), and each generated token then sees the prompt and the tokens before
it through the quantized cache. A prompt prefilled in chunks (use_chunked_prefill) or after a cached prefix sees the
earlier chunks quantized, so its logits can differ slightly from a one-chunk prefill's.
"""

import jax
import jax.numpy as jnp
from flax import struct

from MaxText.common_types import Config


@struct.dataclass
class Quantized:
  """Keys or values as stored with quantize_kvcache: x ~ values * scales (broadcast over the group each scale covers)."""

  values: jax.Array  # kv_quant_dtype [..., tokens, kv_heads, head_dim]
  scales: jax.Array  # the keys' dtype: [..., tokens, kv_heads, 1] (dkv) or [..., tokens, 1, 1] (heads_and_dkv)


@struct.dataclass
class Paged:
  keys: jax.Array | Quantized  # [(layers,) pages, page_size, kv_heads, head_dim]
  values: jax.Array | Quantized  # [(layers,) pages, page_size, kv_heads, head_dim]
  table: jax.Array  # [(layers,) batch, pages_per_row] int32: the pages of each row, in position order


def quantize(x: jax.Array, axis: str, dtype: str = "int8") -> Quantized:
  """x [..., heads, head_dim] -> its Quantized (module docstring): a scale per head (axis dkv) or per token over
  every head (heads_and_dkv). A group of zeros (padding, an empty slot) gets scale 0 and values 0."""
  qdtype = jnp.dtype(dtype)
  qmax = jnp.iinfo(qdtype).max
  reduced = (-1,) if axis == "dkv" else (-2, -1)
  wide = x.astype(jnp.float32)
  # absmax / 127 as XLA computes a division by a constant: times its float32 reciprocal (written out, so that every
  # program, eager or compiled, and a NumPy reference get the same bits).
  scales = (jnp.max(jnp.abs(wide), axis=reduced, keepdims=True) * jnp.float32(1 / qmax)).astype(x.dtype)
  # Divided by the scale as stored, so that values * scales is the closest the stored pair can give.
  divisor = jnp.where(scales == 0, 1, scales).astype(jnp.float32)
  values = jnp.clip(jnp.round(wide / divisor), -qmax, qmax).astype(qdtype)
  return Quantized(values, scales)


def dequantize(q: Quantized) -> jax.Array:
  """values * scales, in the scales' dtype (the keys' own)."""
  return q.values.astype(q.scales.dtype) * q.scales


def stored(kv, config: Config):
  """What the cache stores of new keys and values `kv` (a tree of [..., heads, head_dim] arrays): the arrays
  themselves, or each one's Quantized with quantize_kvcache."""
  if not config.quantize_kvcache:
    return kv
  return jax.tree_util.tree_map(lambda x: quantize(x, config.kv_quant_axis, config.kv_quant_dtype), kv)


def shardings(cache, axes: tuple, sharding_of):
  """The shardings of a cache as stored (`cache`, arrays or their shapes) whose keys and values have logical `axes`:
  sharding_of(axes) for plain and quantized values, and for scales the same axes but those the scales reduce (size
  1: head_dim, and with heads_and_dkv the heads), which are not split."""

  def of(leaf):
    if not isinstance(leaf, Quantized):
      return sharding_of(axes)
    scale_axes = tuple(None if n == 1 else a for a, n in zip(axes, leaf.scales.shape, strict=True))
    return Quantized(sharding_of(axes), sharding_of(scale_axes))

  return jax.tree_util.tree_map(of, cache, is_leaf=lambda x: isinstance(x, Quantized))


def _read(x):
  return dequantize(x) if isinstance(x, Quantized) else x


def rows(cache) -> tuple[jax.Array, jax.Array]:
  """One layer's cache as (keys, values) [batch, cache_len, ...] in the keys' float dtype (a quantized cache
  dequantized): a contiguous cache as it is, a paged one gathered through its table (cache_len = pages_per_row *
  page_size; slot s of a row holds position s)."""
  if not isinstance(cache, Paged):
    return tuple(_read(c) for c in cache)

  def gather(pool):
    batch, per_row = cache.table.shape
    return pool[cache.table].reshape(batch, per_row * pool.shape[1], *pool.shape[2:])

  return tuple(_read(jax.tree_util.tree_map(gather, c)) for c in (cache.keys, cache.values))
