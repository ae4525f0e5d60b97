"""The gpt-oss decoder layer (OpenAI 2025, gpt-oss-20b and gpt-oss-120b; arXiv:2508.10925): Llama's layer with
biases on every attention projection, a learned attention sink per head, local (even) and global (odd) layers, and
a mixture of experts in every layer.

Attention: the query, key, value and output projections carry biases; each head has a learned sink logit that joins
its softmax without a value (attention_masks.sink_softmax), so a query may attend to nothing much; even layers see
only the last sliding_window_size (128) positions, odd ones the whole context, as Hugging Face's `layer_types`
says. RoPE is YaRN's (rope_type=yarn, unrounded ramp, cos and sin scaled by the attention temperature).

MLP: the router is a linear layer with a bias (routed_bias under softmax routing, layers/moe.py); each token takes
its top-k experts by logit, weighted by the softmax of the k chosen logits (route's renormalised top-k: the same
weights); each expert has biases on its projections and the clamped SwiGLU of mlp_activations_limit
(linears.gated_activation).
"""

import jax
import jax.numpy as jnp

from MaxText.common_types import Config
from MaxText.layers.attentions import Attention
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.layers.moe import MoeBlock


class GptOssDecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with biased projections and sinks in self_attention, alternating local layers, and
  an MoeBlock with expert biases for the MLP. Biases and sinks add no counted FLOPs (MaxText's convention: they are
  a few additions per token against the matmuls' thousands of multiply-adds)."""

  moe = True
  attention_sinks = True
  router_logit_bias = True
  clamped_swiglu = True

  @classmethod
  def sliding_window(cls, config: Config, layer_index) -> int | jax.Array:
    if isinstance(layer_index, int):  # unrolled layers, and the FLOP count
      return config.sliding_window_size if layer_index % 2 == 0 else 0
    return jnp.where(jnp.asarray(layer_index) % 2 == 0, config.sliding_window_size, 0)

  def attention(self) -> Attention:
    return Attention(
      self.config, self.mesh, self.model_mode, use_bias=True, use_sinks=self.attention_sinks, name="self_attention"
    )

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, renormalize=True, use_bias=True, name="mlp")
