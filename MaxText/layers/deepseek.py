"""The DeepSeek-V3 decoder layers (DeepSeek-AI 2024, arXiv:2412.19437): Llama's pre-norm structure with
multi-head latent attention (layers/attention_mla.py), a dense SwiGLU MLP in the first first_num_dense_layers
layers and a mixture of experts (layers/moe.py: sigmoid routing with a balancing bias over groups of experts,
routed scaling, shared experts) in the rest.

The two kinds are separate layer stacks (decoders.Stack), `dense_layers` and `moe_layers`, as in MaxText.
"""

from MaxText import common_types as ct
from MaxText.common_types import Config
from MaxText.layers.attention_mla import MLA
from MaxText.layers.llama import AttentionFlops, LlamaDecoderLayer
from MaxText.layers.moe import MoeBlock


class DeepSeekDenseLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with MLA for attention: the first first_num_dense_layers layers."""

  attention_type = "mla"
  kv_cache_axes = ct.LATENT_CACHE_AXES  # the compressed latent and the shared RoPE key, one "head" each

  def attention(self) -> MLA:
    return MLA(self.config, self.mesh, self.model_mode, name="self_attention")

  @classmethod
  def attention_flops(cls, config: Config) -> AttentionFlops:
    """MLA's own projections: the query 2*E*H*Dqk (or 2*E*Rq + 2*Rq*H*Dqk through q_lora_rank Rq), wkv_a
    2*E*(Rkv + Drope), wkv_b 2*Rkv*H*(Dnope + Dv) and out 2*H*Dv*E per token; per pair, q.k over Dqk and the
    weighted v over Dv per head."""
    e, h, rank, q_rank = config.emb_dim, config.num_query_heads, config.kv_lora_rank, config.q_lora_rank
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    query = 2 * e * h * qk if q_rank == 0 else 2 * e * q_rank + 2 * q_rank * h * qk
    projections = query + 2 * e * (rank + config.qk_rope_head_dim) + 2 * rank * h * (config.qk_nope_head_dim + v)
    return AttentionFlops(projections=projections + 2 * h * v * e, per_pair=2 * h * (qk + v))


class DeepSeekMoeLayer(DeepSeekDenseLayer):
  """The dense layer whose MLP is an MoeBlock; its top-k weights are renormalised when norm_topk_prob."""

  moe = True
  dense_layer = DeepSeekDenseLayer

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, renormalize=self.config.norm_topk_prob, name="mlp")
