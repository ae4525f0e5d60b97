"""Grouped-query causal self-attention with segment masking and RoPE; the kernels behind it are in attention_kernels."""

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers import context_parallel, kv_cache
from MaxText.layers.attention_masks import (
  MASK_VALUE,
  AttentionSettings,
  dense_scores,
  sink_softmax,
  within_chunk,
  within_window,
)
from MaxText.layers.embeddings import apply_rope, rope_frequencies, rope_scale
from MaxText.layers.linears import DenseGeneral, fused_projection
from MaxText.layers.normalizations import RMSNorm


def cached_attention(q, k, v, cache, cache_mask, settings: AttentionSettings, positions, cache_positions):
  """New tokens attending to the KV cache and to each other (decoding: one token per row; a prompt's later chunks).

  q: [batch, t, heads, head_dim] (scaled); k, v: [batch, t, kv_heads, head_dim], the new tokens'; cache: (keys,
  values) [batch, cache_len, kv_heads, head_dim]; cache_mask: [batch, cache_len] bool, the slots holding this row's
  earlier tokens; positions [batch, t] and cache_positions [batch, cache_len], the token positions (a new token sees
  the new tokens at or before its position, and the window and chunk apply to both parts); settings: window,
  chunk, sinks, cap, precision, and the score dtype (float32_qk_product, float32_logits) as dot_product's, so a
  decode step computes what the full forward does. The cache is read in place (the new tokens are not written into
  it here): one softmax over [cache slots, new tokens]. Local (windowed, chunked) layers keep every slot too: the
  cache is one array stacked over the scanned layers, so no layer can hold a shorter ring buffer (README, Attention
  kernels); the masks here keep the answer exact.
  """
  cache_k, cache_v = cache
  precision, window = settings.precision, settings.window
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)

  def visible(k_pos):  # [batch, t, keys]: which keys at positions k_pos [batch, keys] each new token may see
    q_pos = positions[:, :, None]
    k_pos = k_pos[:, None, :]
    return within_window(q_pos, k_pos, window) & within_chunk(q_pos, k_pos, settings.chunk)

  past = dense_scores("btkgd,bskd->bkgts", q, cache_k, settings)
  past_mask = cache_mask[:, None, :] & visible(cache_positions)
  past = jnp.where(past_mask[:, None, None], past, MASK_VALUE)
  own = dense_scores("btkgd,bukd->bkgtu", q, k, settings)
  own_mask = (positions[:, :, None] >= positions[:, None, :]) & visible(positions)
  own = jnp.where(own_mask[:, None, None], own, MASK_VALUE)
  sinks = None if settings.sinks is None else settings.sinks.reshape(kv, h // kv)
  weights = sink_softmax(jnp.concatenate([past, own], axis=-1), sinks).astype(v.dtype)
  slots = cache_k.shape[1]
  out = jnp.einsum("bkgts,bskd->btkgd", weights[..., :slots], cache_v, precision=precision)
  out = out + jnp.einsum("bkgtu,bukd->btkgd", weights[..., slots:], v, precision=precision)
  return out.reshape(b, t, h, -1)


class Attention(nn.Module):
  """Multi-head attention with num_kv_heads <= num_query_heads (GQA, Ainslie et al. 2023).

  x [batch, length, embed], segment_ids and positions [batch, length] -> (out [batch, length, embed], kv).
  In train mode kv is None. In prefill mode kv is this layer's (keys, values) [batch, length, kv_heads,
  head_dim], keys after RoPE, for the cache. In autoregressive mode the tokens are new ones after those in `cache`,
  this layer's cache (layers/kv_cache.py: contiguous or paged) with `cache_mask` [batch, cache_len] and the slots'
  `cache_positions`, and kv is the new tokens' (keys, values), which the caller writes into the cache.

  Family options: use_bias (GPT), use_qkv_bias (Qwen 2: biases on the query, key and value projections only),
  use_rope (all but GPT, which has learned positions), use_qk_norm (Qwen 3: RMSNorm of each query and key head
  before RoPE), use_sinks (gpt-oss: a learned sink logit per head, the parameter `sinks` [heads], see
  attention_masks.sink_softmax), and from the config query_pre_attn_scalar (Gemma 2: queries scaled by its inverse
  square root instead of head_dim's) and attn_logits_soft_cap (Gemma 2). `sliding_window` (Mistral, Gemma 2's
  local layers) is a call argument because it may differ by layer, as may what the two hooks below decide from
  `layer_index` (an int, or traced inside a scan): `rotate` (queries' and keys' norms and RoPE; Gemma 3's two RoPE
  bases, Llama 4's NoPE layers override it) and `settings` (the kernel's window, chunk, sinks and cap; Llama 4's
  chunked layers override it).
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  model_mode: str = ct.MODEL_MODE_TRAIN
  use_bias: bool = False
  use_qkv_bias: bool = False
  use_rope: bool = True
  use_qk_norm: bool = False
  use_sinks: bool = False

  def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array, layer_index) -> tuple[jax.Array, jax.Array]:
    """Queries and keys [batch, length, heads, head_dim] before scaling: each head RMS-normalised (use_qk_norm),
    then rotated by RoPE (use_rope). A family whose layers differ here overrides it."""
    del layer_index
    cfg = self.config
    if self.use_qk_norm:
      q = RMSNorm(cfg, name="query_norm")(q)
      k = RMSNorm(cfg, name="key_norm")(k)
    if self.use_rope:
      freq = rope_frequencies(cfg, cfg.head_dim)
      scale = rope_scale(cfg)
      q, k = apply_rope(q, positions, freq, scale), apply_rope(k, positions, freq, scale)
    return q, k

  def settings(self, sliding_window, layer_index) -> AttentionSettings:
    """What the kernel computes in this layer: the window, the soft cap, the sinks (use_sinks) and the config's
    precision and tiles. A family with chunked layers overrides it."""
    del layer_index
    cfg = self.config
    sinks = None
    if self.use_sinks:
      init = nn.with_logical_partitioning(nn.initializers.zeros, (ct.HEADS,))
      sinks = self.param("sinks", init, (cfg.num_query_heads,), jnp.float32)
    return AttentionSettings.from_config(cfg, window=sliding_window, cap=cfg.attn_logits_soft_cap, sinks=sinks)

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    cache=None,
    cache_mask=None,
    cache_positions=None,
    sliding_window=0,
    layer_index=0,
  ):
    cfg = self.config
    heads, kv_heads, head_dim = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    bias = self.use_bias or self.use_qkv_bias
    projections = [
      DenseGeneral((heads, head_dim), (ct.EMBED, ct.HEADS, ct.HEAD_DIM), cfg, use_bias=bias, adapter=True, name="query"),
      DenseGeneral((kv_heads, head_dim), (ct.EMBED, ct.KV_HEADS, ct.HEAD_DIM), cfg, use_bias=bias, adapter=True, name="key"),
      DenseGeneral(
        (kv_heads, head_dim), (ct.EMBED, ct.KV_HEADS, ct.HEAD_DIM), cfg, use_bias=bias, adapter=True, name="value"
      ),
    ]
    # fused_qkv needs kv_heads == heads (checked by pyconfig), as in MaxText.
    q, k, v = fused_projection(x, projections) if cfg.fused_qkv else [p(x) for p in projections]
    q, k, v = checkpoint_name(q, "query_proj"), checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    q = sharding.constrain(q, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    k = sharding.constrain(k, (ct.BATCH, ct.LENGTH, ct.ACT_KV_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    v = sharding.constrain(v, (ct.BATCH, ct.LENGTH, ct.ACT_KV_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)

    q, k = self.rotate(q, k, positions, layer_index)
    q = q * jnp.asarray((cfg.query_pre_attn_scalar or head_dim) ** -0.5, q.dtype)
    settings = self.settings(sliding_window, layer_index)
    if self.model_mode == ct.MODEL_MODE_AUTOREGRESSIVE:
      cache = tuple(sharding.constrain(c, ct.CACHE_AXES, self.mesh, cfg) for c in kv_cache.rows(cache))
      out = cached_attention(q, k, v, cache, cache_mask, settings, positions, cache_positions)
    else:
      mode = self.model_mode
      out = context_parallel.attend(q, k, v, segment_ids, positions, settings, mesh=self.mesh, model_mode=mode)
    out = sharding.constrain(out, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    out = checkpoint_name(out, "context")  # What remat_policy=minimal_flash saves.
    out = DenseGeneral(
      (cfg.emb_dim,), (ct.HEADS, ct.HEAD_DIM, ct.EMBED), cfg, num_in=2, use_bias=self.use_bias, adapter=True, name="out"
    )(out)
    kv = None if self.model_mode == ct.MODEL_MODE_TRAIN else (k, v)
    return checkpoint_name(out, "out_proj"), kv
