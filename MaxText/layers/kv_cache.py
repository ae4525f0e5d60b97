"""The KV cache as the attention layers read it: contiguous rows, or fixed-size pages behind a page table.

A contiguous cache is a pair (keys, values) of [batch, cache_len, kv_heads, head_dim] per layer (MLA: its latent
and RoPE key, [..., 1, kv_lora_rank] and [..., 1, qk_rope_head_dim]). A paged cache (`Paged`) holds a pool of
pages, [pages, page_size, kv_heads, head_dim], and a page table [batch, pages_per_row]: row b's token at position
p lives in page table[b, p // page_size] at offset p % page_size, so a row holds only the pages its tokens fill
and rows can share the pages of a common prompt prefix (inference/engine.py hands pages out). The decoder's cache
carries a leading layers axis on every leaf, the page table included (the same table repeated: a scan over the
layers slices it with the pools), so the layers take either kind alike and read it through `rows`.
"""

import jax
from flax import struct


@struct.dataclass
class Paged:
  keys: jax.Array  # [(layers,) pages, page_size, kv_heads, head_dim]
  values: jax.Array  # [(layers,) pages, page_size, kv_heads, head_dim]
  table: jax.Array  # [(layers,) batch, pages_per_row] int32: the pages of each row, in position order


def rows(cache) -> tuple[jax.Array, jax.Array]:
  """One layer's cache as (keys, values) [batch, cache_len, ...]: a contiguous cache as it is, a paged one gathered
  through its table (cache_len = pages_per_row * page_size; slot s of a row holds position s)."""
  if not isinstance(cache, Paged):
    return tuple(cache)

  def gather(pool):
    batch, per_row = cache.table.shape
    return pool[cache.table].reshape(batch, per_row * pool.shape[1], *pool.shape[2:])

  return gather(cache.keys), gather(cache.values)
