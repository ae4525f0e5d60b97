"""The DeepSeek-V3 decoder layers (DeepSeek-AI 2024, arXiv:2412.19437): Llama's pre-norm structure with
multi-head latent attention (layers/attention_mla.py), a dense SwiGLU MLP in the first first_num_dense_layers
layers and a mixture of experts (layers/moe.py: sigmoid routing with a balancing bias over groups of experts,
routed scaling, shared experts) in the rest.

The two kinds are separate layer stacks (families.Stack), `dense_layers` and `moe_layers`, as in MaxText.
"""

from MaxText.layers.attention_mla import MLA
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.layers.moe import MoeBlock


class DeepSeekDenseLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with MLA for attention: the first first_num_dense_layers layers."""

  def attention(self) -> MLA:
    return MLA(self.config, self.mesh, self.model_mode, name="self_attention")


class DeepSeekMoeLayer(DeepSeekDenseLayer):
  """The dense layer whose MLP is an MoeBlock; its top-k weights are renormalised when norm_topk_prob."""

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, renormalize=self.config.norm_topk_prob, name="mlp")
