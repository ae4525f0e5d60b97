"""The Gemma 2 decoder layer (Gemma team 2024, arXiv:2408.00118).

On top of Gemma (1 + w RMSNorm, scaled and tied embeddings, GeGLU): a norm before and after both the
attention and the MLP, attention logits soft-capped at attn_logits_soft_cap (and the final logits at
final_logits_soft_cap, in the Transformer), queries scaled by query_pre_attn_scalar**-0.5, and layers that
alternate local sliding-window attention (even layers, window sliding_window_size) with global attention
(odd layers), as Hugging Face's `layer_types` does.
"""

import jax
import jax.numpy as jnp

from MaxText.common_types import Config
from MaxText.layers.llama import LlamaDecoderLayer


class Gemma2DecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with sandwich norms around attention and MLP, and alternating local layers."""

  norm_scale_offset = 1.0
  scale_embeddings = True
  pre_mlp_norm_name = "pre_ffw_norm"

  @classmethod
  def sliding_window(cls, config: Config, layer_index) -> int | jax.Array:
    if isinstance(layer_index, int):  # unrolled layers, and the FLOP count
      return config.sliding_window_size if layer_index % 2 == 0 else 0
    return jnp.where(jnp.asarray(layer_index) % 2 == 0, config.sliding_window_size, 0)

  def after_attention(self, h: jax.Array) -> jax.Array:
    return self.norm(self.config, "post_self_attention_norm")(h)

  def after_mlp(self, h: jax.Array) -> jax.Array:
    return self.norm(self.config, "post_ffw_norm")(h)
