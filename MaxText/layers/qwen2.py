"""The Qwen 2 and Qwen 2.5 decoder layer (Qwen team 2024, arXiv:2407.10671, arXiv:2412.15115): Llama's layer with
biases on the query, key and value projections.

The output projection and the MLP have none; the biases are what the checkpoints carry (Qwen 2.5 inherits them
from Qwen 1, and they help length extrapolation, per the Qwen report). Smaller models tie the output head to the
embedding (logits_via_embedding), as the checkpoint's tie_word_embeddings says.
"""

from MaxText.layers.llama import LlamaDecoderLayer


class Qwen2DecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with `bias` beside the query, key and value kernels of self_attention."""

  qkv_bias = True
