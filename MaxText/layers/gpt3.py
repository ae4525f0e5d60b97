"""The GPT-3 decoder layer (Brown et al. 2020, arXiv:2005.14165), i.e. GPT-2's architecture (Radford et al. 2019).

Pre-LayerNorm (with bias) attention and a GELU MLP, biases on every projection, no RoPE: positions come from
a learned table (trainable_position_size, in the Transformer), and the output projection is tied to the
token embedding. Hugging Face's GPT2LMHeadModel is its reference. (GPT-3's alternating sparse attention is
not modelled, as in MaxText.)
"""

from flax import linen as nn

from MaxText.common_types import Config
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.layers.normalizations import LayerNorm


class Gpt3DecoderLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with LayerNorms, biases and no RoPE."""

  @classmethod
  def norm(cls, config: Config, name: str) -> nn.Module:
    return LayerNorm(config, name=name)

  def attention(self) -> Attention:
    return Attention(self.config, self.mesh, self.model_mode, use_bias=True, use_rope=False, name="self_attention")

  def mlp(self) -> MlpBlock:
    return MlpBlock(self.config, self.mesh, use_bias=True, name="mlp")
