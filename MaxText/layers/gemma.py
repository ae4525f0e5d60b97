"""The Gemma decoder layer (Gemma team 2024, arXiv:2403.08295): Llama's structure with GeGLU and Gemma's norms.

Differences from Llama: RMSNorm weights are stored as offsets from 1 (y = norm(x) * (1 + w)), token embeddings
are multiplied by sqrt(emb_dim), the output projection is tied to the embedding (logits_via_embedding), and
the MLP is GeGLU (mlp_activations: [gelu, linear], tanh-approximated GELU). The configs/models/gemma-*.yml
presets set the last two.
"""

from MaxText.layers.llama import LlamaDecoderLayer


class GemmaDecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with Gemma's 1 + w RMSNorm and scaled embeddings."""

  norm_scale_offset = 1.0
  scale_embeddings = True
