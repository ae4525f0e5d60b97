"""The Mixtral decoder layer (Jiang et al. 2024, arXiv:2401.04088): Mistral's layer with a sparse mixture of
experts (layers/moe.py) in place of the MLP.

Each token goes to its num_experts_per_tok (2) best of num_experts (8) SwiGLU experts; their weights are the
router's softmax over the chosen experts, i.e. the top-k probabilities renormalised to sum to 1, always.
"""

from MaxText.layers.mistral import MistralDecoderLayer
from MaxText.layers.moe import MoeBlock


class MixtralDecoderLayer(MistralDecoderLayer):
  """Mistral's layer (see there) whose MLP is an MoeBlock with renormalised top-k weights."""

  moe = True

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, renormalize=True, name="mlp")
