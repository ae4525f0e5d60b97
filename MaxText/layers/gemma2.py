"""The Gemma 2 decoder layer (Gemma team 2024, arXiv:2408.00118).

On top of Gemma (1 + w RMSNorm, scaled and tied embeddings, GeGLU): a norm before and after both the
attention and the MLP, attention logits soft-capped at attn_logits_soft_cap (and the final logits at
final_logits_soft_cap, in the Transformer), queries scaled by query_pre_attn_scalar**-0.5, and layers that
alternate local sliding-window attention (even layers, window sliding_window_size) with global attention
(odd layers), as Hugging Face's `layer_types` does.
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.layers.llama import LlamaDecoderLayer


class Gemma2DecoderLayer(LlamaDecoderLayer):
  """x [batch, length, embed] -> (x, kv), as LlamaDecoderLayer; sandwich norms around attention and MLP."""

  norm_scale_offset = 1.0
  scale_embeddings = True

  def sliding_window(self, layer_index) -> jax.Array:
    return jnp.where(jnp.asarray(layer_index) % 2 == 0, self.config.sliding_window_size, 0)

  @nn.compact
  def __call__(self, x, segment_ids, positions, cache=None, cache_mask=None, cache_positions=None, layer_index=0):
    cfg = self.config
    act_axes = (ct.BATCH, ct.LENGTH, ct.ACT_EMBED)
    x = sharding.constrain(x, act_axes, self.mesh, cfg)
    dropout = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))

    h = self.norm(cfg, "pre_self_attention_layer_norm")(x)
    window = self.sliding_window(layer_index)
    h, kv = self.attention()(h, segment_ids, positions, cache, cache_mask, cache_positions, window)
    h = self.norm(cfg, "post_self_attention_norm")(h)
    x = x + dropout(h, deterministic=self.deterministic)

    h = self.norm(cfg, "pre_ffw_norm")(x)
    h = self.mlp()(h)
    h = self.norm(cfg, "post_ffw_norm")(h)
    x = x + dropout(h, deterministic=self.deterministic)
    return sharding.constrain(x, act_axes, self.mesh, cfg), kv
