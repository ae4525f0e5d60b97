"""The Qwen 3 dense decoder layer (Qwen team 2025, arXiv:2505.09388): Llama's layer with QK-norm.

Each query and key head is RMS-normalised over head_dim (one learned scale for all heads) before RoPE, which
keeps attention logits bounded; Qwen 3's head_dim is set on its own (num_heads * head_dim need not be emb_dim).
"""

from MaxText.layers.llama import LlamaDecoderLayer


class Qwen3DecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with `query_norm` and `key_norm` inside self_attention."""

  qk_norm = True
