"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv:2405.04434, sec. 2.1, and DeepSeek-V3), attention_type=mla.

Keys and values come from one compressed latent per token: c = RMSNorm(x W_kv_a[:, :kv_lora_rank]), plus one
RoPE key per token shared by every head, k_pe = RoPE(x W_kv_a[:, kv_lora_rank:]). Per head, the key is
[c W_k, k_pe] and the value c W_v, where W_kv_b = [W_k, W_v]. Queries are [q_nope, RoPE(q_pe)] from x (or from
a compressed query: wq_a -> q_norm -> wq_b when q_lora_rank > 0).

The KV cache holds what DeepSeek's inference holds: (c, k_pe) per token, [batch, length, 1, kv_lora_rank] and
[batch, length, 1, qk_rope_head_dim], instead of every head's keys and values. A new token attends to it with
W_k absorbed into its query (q_nope W_k^T . c = q_nope . c W_k) and W_v applied after the weighted sum of
latents, so the cache is never expanded.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers import context_parallel, kv_cache
from MaxText.layers.attention_masks import MASK_VALUE, AttentionSettings
from MaxText.layers.embeddings import apply_rope, rope_frequencies, rope_scale, yarn_mscale
from MaxText.layers.linears import PRECISIONS, DenseGeneral
from MaxText.layers.normalizations import RMSNorm


def softmax_scale(config: Config) -> float:
  """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times YaRN's temperature squared when the context was
  extended (rope_type=yarn and max_position_embeddings > original_max_position_embeddings): DeepSeek's
  `softmax_scale`, transformers' mscale_all_dim (our mscale) and MaxText's rule."""
  scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
  if config.rope_type == "yarn" and config.max_position_embeddings > config.original_max_position_embeddings:
    scale *= yarn_mscale(config.rope_factor, config.mscale) ** 2
  return scale


def _pad_last(x: jax.Array, size: int) -> jax.Array:
  return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def latent_cached_attention(q_latent, q_pe, latent, k_pe, *, cache, cache_mask, positions, settings: AttentionSettings):
  """New tokens attending to the latent cache and to each other; returns the weighted latents.

  q_latent [batch, t, heads, kv_lora_rank] (the query's no-RoPE part times W_k^T) and q_pe [batch, t, heads,
  rope_dim], both scaled; latent [batch, t, 1, kv_lora_rank] and k_pe [batch, t, 1, rope_dim], the new tokens';
  cache (latent, k_pe) [batch, cache_len, 1, ...] with cache_mask [batch, cache_len]; positions [batch, t] (a new
  token sees the new tokens at or before its position); settings: the precision and the score dtype
  (float32_qk_product, float32_logits), as the full forward's dot_product (attention_masks.dense_scores). Returns
  sum_s w_s c_s, [batch, t, heads, kv_lora_rank], in the latent's dtype: one softmax over [cache slots, new tokens].
  """
  precision = settings.precision

  def scores(c, pe):  # [batch, heads, t, slots]: the two parts of one q.k, summed in float32 and rounded once
    nope = jnp.einsum("bthr,bsr->bhts", q_latent, c[:, :, 0], precision=precision, preferred_element_type=jnp.float32)
    rope = jnp.einsum("bthp,bsp->bhts", q_pe, pe[:, :, 0], precision=precision, preferred_element_type=jnp.float32)
    logits = nope + rope
    if not settings.float32_qk_product:
      logits = logits.astype(q_latent.dtype)
    return logits.astype(jnp.float32) if settings.float32_logits else logits

  cache_latent, cache_pe = cache
  past = jnp.where(cache_mask[:, None, None, :], scores(cache_latent, cache_pe), MASK_VALUE)
  causal = positions[:, :, None] >= positions[:, None, :]
  own = jnp.where(causal[:, None], scores(latent, k_pe), MASK_VALUE)
  weights = jax.nn.softmax(jnp.concatenate([past, own], axis=-1), axis=-1).astype(latent.dtype)
  slots = cache_latent.shape[1]
  out = jnp.einsum("bhts,bsr->bthr", weights[..., :slots], cache_latent[:, :, 0], precision=precision)
  return out + jnp.einsum("bhtu,bur->bthr", weights[..., slots:], latent[:, :, 0], precision=precision)


class MLA(nn.Module):
  """Multi-head latent attention: x [batch, length, embed] -> (out [batch, length, embed], kv).

  Parameters (MaxText's names): query [embed, heads, qk_head_dim] when q_lora_rank is 0, else wq_a [embed,
  q_lora_rank], q_norm, wq_b [q_lora_rank, heads, qk_head_dim]; wkv_a [embed, kv_lora_rank + qk_rope_head_dim],
  kv_norm, wkv_b [kv_lora_rank, heads, qk_nope_head_dim + v_head_dim]; out [heads, v_head_dim, embed]. Each head's
  query and key are [no-RoPE part, RoPE part]. kv, outside train mode, is the cache's (latent, k_pe) of the
  module docstring; in autoregressive mode `cache` holds (latent, k_pe), contiguous or paged (layers/kv_cache.py).
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  model_mode: str = ct.MODEL_MODE_TRAIN

  @nn.compact
  def __call__(  # noqa: PLR0913 (Attention's call)
    self, x, segment_ids, positions, cache=None, cache_mask=None, cache_positions=None, sliding_window=0, layer_index=0
  ):
    del cache_positions, sliding_window, layer_index  # DeepSeek attends to the whole context, alike in every layer.
    cfg = self.config
    heads, nope, rope, v_dim = cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rank = cfg.kv_lora_rank
    qk_dim = nope + rope
    if cfg.q_lora_rank == 0:
      q = DenseGeneral((heads, qk_dim), (ct.EMBED, ct.HEADS, ct.HEAD_DIM), cfg, name="query")(x)
    else:
      q = DenseGeneral((cfg.q_lora_rank,), (ct.EMBED, ct.Q_LORA), cfg, name="wq_a")(x)
      q = RMSNorm(cfg, name="q_norm")(q)
      q = DenseGeneral((heads, qk_dim), (ct.Q_LORA, ct.HEADS, ct.HEAD_DIM), cfg, name="wq_b")(q)
    q = checkpoint_name(q, "query_proj")
    q = sharding.constrain(q, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    kv = checkpoint_name(DenseGeneral((rank + rope,), (ct.EMBED, ct.KV_LORA), cfg, name="wkv_a")(x), "key_proj")
    latent = RMSNorm(cfg, name="kv_norm")(kv[..., :rank])[:, :, None, :]  # [batch, length, 1, rank]

    freq, rope_mul = rope_frequencies(cfg, rope), rope_scale(cfg)
    q_pe = apply_rope(q[..., nope:], positions, freq, rope_mul, interleaved=cfg.rope_interleave)
    k_pe = apply_rope(kv[..., None, rank:], positions, freq, rope_mul, interleaved=cfg.rope_interleave)
    scale = jnp.asarray(softmax_scale(cfg), q.dtype)
    q_nope, q_pe = q[..., :nope] * scale, q_pe * scale
    wkv_b = DenseGeneral((heads, nope + v_dim), (ct.KV_LORA, ct.HEADS, ct.HEAD_DIM), cfg, name="wkv_b")
    precision = PRECISIONS[cfg.matmul_precision]

    if self.model_mode == ct.MODEL_MODE_AUTOREGRESSIVE:
      w, _ = wkv_b(latent, weights_only=True)  # [rank, heads, nope + v_dim] in the activation dtype
      q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, w[..., :nope], precision=precision)
      cache_latent, cache_pe = (sharding.constrain(c, ct.LATENT_CACHE_AXES, self.mesh, cfg) for c in kv_cache.rows(cache))
      ctx = latent_cached_attention(
        q_latent,
        q_pe,
        latent,
        k_pe,
        cache=(cache_latent, cache_pe),
        cache_mask=cache_mask,
        positions=positions,
        settings=AttentionSettings.from_config(cfg),
      )
      out = jnp.einsum("bthr,rhv->bthv", ctx, w[..., nope:], precision=precision)
    else:
      kv_heads = wkv_b(latent[:, :, 0])  # [batch, length, heads, nope + v_dim]
      kv_heads = sharding.constrain(kv_heads, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
      k = jnp.concatenate([kv_heads[..., :nope], jnp.broadcast_to(k_pe, (*k_pe.shape[:2], heads, rope))], axis=-1)
      v = checkpoint_name(kv_heads[..., nope:], "value_proj")
      # The kernels take one head_dim: the narrower of (q, k) and v is zero-padded, which changes no dot product.
      width = max(qk_dim, v_dim)
      q_all = jnp.concatenate([q_nope, q_pe], axis=-1)
      q_all, k, v = _pad_last(q_all, width), _pad_last(k, width), _pad_last(v, width)
      settings = AttentionSettings.from_config(cfg)
      mode = self.model_mode
      out = context_parallel.attend(q_all, k, v, segment_ids, positions, settings, mesh=self.mesh, model_mode=mode)
      out = out[..., :v_dim]
    out = sharding.constrain(out, (ct.BATCH, ct.LENGTH, ct.ACT_HEADS, ct.ACT_HEAD_DIM), self.mesh, cfg)
    out = checkpoint_name(out, "context")
    out = DenseGeneral((cfg.emb_dim,), (ct.HEADS, ct.HEAD_DIM, ct.EMBED), cfg, num_in=2, name="out")(out)
    kv = None if self.model_mode == ct.MODEL_MODE_TRAIN else (latent, k_pe)
    return checkpoint_name(out, "out_proj"), kv
