"""The Mistral decoder layer (Jiang et al. 2023, arXiv:2310.06825): Llama's layer with sliding-window attention.

Every layer attends to the last `sliding_window_size` positions only (0 disables the window, as in Mistral
7B v0.2 and later).
"""

from MaxText.common_types import Config
from MaxText.layers.llama import LlamaDecoderLayer


class MistralDecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) whose attention is windowed in every layer."""

  @classmethod
  def sliding_window(cls, config: Config, layer_index) -> int:
    del layer_index
    return config.sliding_window_size
