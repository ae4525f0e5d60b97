"""The Qwen3-MoE decoder layer (Qwen team 2025, arXiv:2505.09388): Qwen 3's layer (QK-norm) with a mixture of
experts (layers/moe.py) in place of the MLP, in every layer.

The router's top-k probabilities are renormalised when norm_topk_prob (true for the released models).
"""

from MaxText.layers.moe import MoeBlock
from MaxText.layers.qwen3 import Qwen3DecoderLayer


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
  """Qwen 3's layer (see there) whose MLP is an MoeBlock."""

  moe = True

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, renormalize=self.config.norm_topk_prob, name="mlp")
