"""The Llama 2/3 decoder layer (Touvron et al. 2023): pre-norm attention and SwiGLU MLP, residuals.

Mistral, Gemma, Gemma 2, Qwen 2, Qwen 3 and GPT-3 share its structure and subclass it (mistral.py, gemma.py,
gemma2.py, qwen2.py, qwen3.py, gpt3.py): they change the class attributes and the hooks below (norm,
sliding_window, attention, mlp, and after_attention / after_mlp for Gemma 2's extra norms), never the call itself.

The class also describes the layer to the code around the model, so that none of it names a family or an
attention kind: its traits (moe, attention_type, dense_layer; its family declares them for pyconfig), the
logical axes of its KV cache (inference/model_runner.py), and its model FLOPs (metrics.py): the attention's and the
MLP's per token, and the (query, key) pairs its attention computes, which its masks decide (`attention_pairs`).
A layer that changes what it computes changes these with it.
"""

import dataclasses
from typing import ClassVar

import jax
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.normalizations import RMSNorm


def causal_pairs(length: int, window: int = 0, chunk: int = 0) -> float:
  """The (query, key) pairs of one sequence of `length` tokens that a causal mask lets attention compute, with the
  diagonal (each query with its own key) counted half.

  Half the diagonal is MaxText's convention for causal attention, which it counts as half the full length x length
  square (calculate_tflops_training_per_device: causal_attention_flops = noncausal_attention_flops / 2, i.e.
  L^2/2 = L(L+1)/2 - L/2 pairs), carried over to masks that allow fewer keys: window > 0 lets a query see only the
  keys less than `window` positions back (attention_masks.within_window), so query i attends min(i + 1, window)
  keys; chunk > 0 only the keys of its own chunk of `chunk` tokens (Llama 4's chunked attention; MaxText's
  _calculate_chunked_attention_flops_per_layer counts c^2/2 per chunk of c, the same convention).
  """
  chunk = chunk if 0 < chunk < length else length
  full, rest = divmod(length, chunk)

  def pairs(c: int) -> int:  # sum over i < c of min(i + 1, w): a triangle up to the window, then w keys each
    w = c if window <= 0 else min(window, c)
    return w * (w + 1) // 2 + (c - w) * w

  return full * pairs(chunk) + pairs(rest) - length / 2


@dataclasses.dataclass(frozen=True)
class AttentionFlops:
  """Forward FLOPs of one layer's attention (a matmul [m, k] x [k, n] costs 2mkn)."""

  projections: float  # per token: the matmuls against the attention's weights (queries, keys, values, output)
  per_pair: float  # per (query, key) pair it attends: the score q.k and the weighted value, over all heads


class LlamaDecoderLayer(nn.Module):
  """x [batch, length, embed] -> (x [batch, length, embed], kv): a scan carry and a per-layer output.

  kv is None in train mode, else the attention's keys and values (see Attention); `cache`, `cache_mask` and
  `cache_positions` are used in autoregressive mode only. `layer_index` (an int, or traced inside a scan)
  lets a family vary attention by layer.
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  deterministic: bool = True
  model_mode: str = ct.MODEL_MODE_TRAIN

  # Family traits, read by the Transformer too.
  norm_scale_offset: ClassVar[float] = 0.0  # Gemma: RMSNorm weights are stored as an offset from 1.
  scale_embeddings: ClassVar[bool] = False  # Gemma: token embeddings are multiplied by sqrt(emb_dim).
  qk_norm: ClassVar[bool] = False  # Qwen 3: RMSNorm of each query and key head.
  qkv_bias: ClassVar[bool] = False  # Qwen 2: biases on the query, key and value projections (not the output's).
  attention_sinks: ClassVar[bool] = False  # gpt-oss: a learned sink logit per head (pyconfig refuses cuDNN for it).
  # gpt-oss: routed_bias under softmax routing is a bias on the router's logits, and mlp_activations_limit clamps the
  # SwiGLU; pyconfig refuses both for a layer without them (they would train what its checkpoint format cannot hold).
  router_logit_bias: ClassVar[bool] = False
  clamped_swiglu: ClassVar[bool] = False
  pre_mlp_norm_name: ClassVar[str] = "post_self_attention_layer_norm"  # Gemma 2: pre_ffw_norm.
  # What the config must say about the layer (its family declares the same for pyconfig, families_test checks), and
  # where layers of another class come first.
  moe: ClassVar[bool] = False  # Its MLP is a mixture of experts (layers/moe.py): num_experts >= 2.
  attention_type: ClassVar[str] = "global"  # The config's attention_type it runs (MaxText's key): "mla" for MLA.
  # The class of the first first_num_dense_layers layers (DeepSeek's dense ones); None: every layer is this one.
  dense_layer: ClassVar[type[nn.Module] | None] = None
  # The logical axes of one layer's cached keys or values, [batch, cache_len, kv_heads, head_dim] (the decoder's
  # cache adds the layers in front).
  kv_cache_axes: ClassVar[tuple[str | None, ...]] = ct.CACHE_AXES

  @classmethod
  def norm(cls, config: Config, name: str) -> nn.Module:
    return RMSNorm(config, scale_offset=cls.norm_scale_offset, name=name)

  @classmethod
  def sliding_window(cls, config: Config, layer_index) -> int | jax.Array:
    """Sliding-window size of attention in layer `layer_index` (an int, or traced inside a scan; an int gives an
    int); 0 attends to the whole context."""
    del config, layer_index
    return 0

  @classmethod
  def attention_pairs(cls, config: Config, layer_index: int, length: int) -> float:
    """The (query, key) pairs layer `layer_index` attends in a sequence of `length` tokens (causal_pairs' count)."""
    return causal_pairs(length, window=cls.sliding_window(config, layer_index))

  @classmethod
  def attention_flops(cls, config: Config) -> AttentionFlops:
    """Grouped-query attention: q/k/v projections 2*E*(H + 2*KV)*D and the output 2*E*H*D per token; per pair,
    q.k and the weighted v, 2*D each per head."""
    e, h, kv, d = config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim
    return AttentionFlops(projections=2 * e * (h + 2 * kv) * d + 2 * e * h * d, per_pair=4 * h * d)

  @classmethod
  def mlp_flops(cls, config: Config) -> float:
    """Per token: a gated MLP's input projections (one per mlp_activations entry) and its output, 2*E*M each; for a
    mixture of experts (moe) the router 2*E*num_experts and the MLPs of the num_experts_per_tok chosen and the
    shared experts, at moe_mlp_dim (active parameters only, as MaxText counts)."""
    matmuls = len(config.mlp_activations) + 1
    if not cls.moe:
      return 2 * config.emb_dim * config.mlp_dim * matmuls
    active = config.num_experts_per_tok + config.shared_experts
    return 2 * config.emb_dim * config.num_experts + 2 * config.emb_dim * config.moe_mlp_dim * matmuls * active

  def attention(self) -> Attention:
    return Attention(
      self.config, self.mesh, self.model_mode, use_qk_norm=self.qk_norm, use_qkv_bias=self.qkv_bias, name="self_attention"
    )

  def mlp(self) -> MlpBlock:
    return MlpBlock(self.config, self.mesh, name="mlp")

  def after_attention(self, h: jax.Array) -> jax.Array:
    """The attention's output before it joins the residual stream (Gemma 2 normalises it)."""
    return h

  def after_mlp(self, h: jax.Array) -> jax.Array:
    """The MLP's output before it joins the residual stream (Gemma 2 normalises it)."""
    return h

  @nn.compact
  def __call__(
    self, x, segment_ids, positions, cache=None, cache_mask=None, cache_positions=None, layer_index=0
  ) -> tuple[jax.Array, tuple | None]:
    cfg = self.config
    act_axes = (ct.BATCH, ct.LENGTH, ct.ACT_EMBED)
    x = sharding.constrain(x, act_axes, self.mesh, cfg)
    dropout = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))

    h = self.norm(cfg, "pre_self_attention_layer_norm")(x)
    window = self.sliding_window(cfg, layer_index)
    h, kv = self.attention()(h, segment_ids, positions, cache, cache_mask, cache_positions, window, layer_index)
    x = x + dropout(self.after_attention(h), deterministic=self.deterministic)

    h = self.norm(cfg, self.pre_mlp_norm_name)(x)
    h = self.mlp()(h)
    x = x + dropout(self.after_mlp(h), deterministic=self.deterministic)
    return sharding.constrain(x, act_axes, self.mesh, cfg), kv
