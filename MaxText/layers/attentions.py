"""Grouped-query causal self-attention with segment masking and RoPE."""

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.layers.embeddings import apply_rope, rope_frequencies
from MaxText.layers.linears import PRECISIONS, DenseGeneral
from MaxText.pyconfig import Config

# Added to masked logits: large but finite, so a row never becomes NaN (MaxText's DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
  """[batch, 1, 1, q_len, kv_len] bool: causal, and only within the same segment (packed document)."""
  length = segment_ids.shape[1]
  causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
  same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_segment)[:, None, None]


def dot_product_attention(q, k, v, segment_ids, precision):
  """softmax(q k^T + mask) v with grouped heads; the softmax runs in float32.

  q: [batch, length, heads, head_dim] (already scaled); k, v: [batch, length, kv_heads, head_dim];
  returns [batch, length, heads, head_dim].
  """
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32)
  logits = jnp.where(attention_mask(segment_ids), logits, MASK_VALUE)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", weights, v, precision=precision)
  return out.reshape(b, t, h, d)


def cached_attention(q, k, v, cache_k, cache_v, cache_mask, precision):
  """One new token per row attending to the KV cache and to itself (autoregressive decoding).

  q: [batch, 1, heads, head_dim] (scaled); k, v: [batch, 1, kv_heads, head_dim], the new token's;
  cache_k, cache_v: [batch, cache_len, kv_heads, head_dim]; cache_mask: [batch, cache_len] bool, the slots
  holding this row's earlier tokens. The cache is read in place (the new token is not written into it
  here): one softmax over [cache slots, new token].
  """
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  past = jnp.einsum("btkgd,bskd->bkgts", q, cache_k, precision=precision, preferred_element_type=jnp.float32)
  past = jnp.where(cache_mask[:, None, None, None, :], past, MASK_VALUE)
  own = jnp.einsum("btkgd,btkd->bkgt", q, k, precision=precision, preferred_element_type=jnp.float32)[..., None]
  weights = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", weights[..., :-1], cache_v, precision=precision)
  out = out + jnp.einsum("bkgt,btkd->btkgd", weights[..., -1], v, precision=precision)
  return out.reshape(b, t, h, d)


class Attention(nn.Module):
  """Multi-head attention with num_kv_heads <= num_query_heads (GQA, Ainslie et al. 2023).

  x [batch, length, embed], segment_ids and positions [batch, length] -> (out [batch, length, embed], kv).
  In train mode kv is None. In prefill mode kv is this layer's (keys, values) [batch, length, kv_heads,
  head_dim], keys after RoPE, for the cache. In autoregressive mode length is 1, `cache` is this layer's
  (keys, values) [batch, cache_len, kv_heads, head_dim] with `cache_mask` [batch, cache_len], and kv is the
  new token's (keys, values), which the caller writes into the cache.
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  model_mode: str = ct.MODEL_MODE_TRAIN

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, cache=None, cache_mask=None):
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    q = DenseGeneral((heads, head_dim), (ct.EMBED, ct.HEADS, ct.HEAD_DIM), cfg, name="query")(x)
    k = DenseGeneral((kv_heads, head_dim), (ct.EMBED, ct.KV_HEADS, ct.HEAD_DIM), cfg, name="key")(x)
    v = DenseGeneral((kv_heads, head_dim), (ct.EMBED, ct.KV_HEADS, ct.HEAD_DIM), cfg, name="value")(x)
    q, k, v = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    q = sharding.constrain(q, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    k = sharding.constrain(k, (ct.BATCH, ct.LENGTH, ct.ACT_KV_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    v = sharding.constrain(v, (ct.BATCH, ct.LENGTH, ct.ACT_KV_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)

    freq = rope_frequencies(cfg, head_dim)
    q = apply_rope(q, positions, freq) * jnp.asarray(head_dim**-0.5, q.dtype)
    k = apply_rope(k, positions, freq)
    precision = PRECISIONS[cfg.matmul_precision]
    if self.model_mode == ct.MODEL_MODE_AUTOREGRESSIVE:
      cache_k, cache_v = (sharding.constrain(c, ct.CACHE_AXES, self.mesh, cfg) for c in cache)
      out = cached_attention(q, k, v, cache_k, cache_v, cache_mask, precision)
    else:
      out = dot_product_attention(q, k, v, segment_ids, precision)
    out = sharding.constrain(out, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    out = DenseGeneral((cfg.emb_dim,), (ct.HEADS, ct.HEAD_DIM, ct.EMBED), cfg, num_in=2, name="out")(out)
    kv = None if self.model_mode == ct.MODEL_MODE_TRAIN else (k, v)
    return checkpoint_name(out, "out_proj"), kv
