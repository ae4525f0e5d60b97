"""The Llama 2/3 decoder layer (Touvron et al. 2023): pre-norm attention and SwiGLU MLP, residuals.

Mistral, Gemma, Gemma 2, Qwen 3 and GPT-3 share its structure and subclass it (mistral.py, gemma.py, gemma2.py,
qwen3.py, gpt3.py): they change the class attributes and the hooks below (norm, sliding_window, attention, mlp,
and after_attention / after_mlp for Gemma 2's extra norms), never the call itself.
"""

from typing import ClassVar

import jax
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.normalizations import RMSNorm


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
  pre_mlp_norm_name: ClassVar[str] = "post_self_attention_layer_norm"  # Gemma 2: pre_ffw_norm.

  @classmethod
  def norm(cls, config: Config, name: str) -> nn.Module:
    return RMSNorm(config, scale_offset=cls.norm_scale_offset, name=name)

  def sliding_window(self, layer_index) -> int | jax.Array:
    """Sliding-window size of attention in this layer; 0 attends to the whole context."""
    del layer_index
    return 0

  def attention(self) -> Attention:
    return Attention(self.config, self.mesh, self.model_mode, use_qk_norm=self.qk_norm, name="self_attention")

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
    window = self.sliding_window(layer_index)
    h, kv = self.attention()(h, segment_ids, positions, cache, cache_mask, cache_positions, window)
    x = x + dropout(self.after_attention(h), deterministic=self.deterministic)

    h = self.norm(cfg, self.pre_mlp_norm_name)(x)
    h = self.mlp()(h)
    x = x + dropout(self.after_mlp(h), deterministic=self.deterministic)
    return sharding.constrain(x, act_axes, self.mesh, cfg), kv
