"""The Llama 2/3 decoder layer (Touvron et al. 2023): pre-norm attention and SwiGLU MLP, residuals."""

import jax
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.normalizations import RMSNorm
from MaxText.pyconfig import Config


class LlamaDecoderLayer(nn.Module):
  """x [batch, length, embed] -> (x [batch, length, embed], kv): a scan carry and a per-layer output.

  kv is None in train mode, else the attention's keys and values (see Attention); `cache` and
  `cache_mask` are used in autoregressive mode only.
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  deterministic: bool = True
  model_mode: str = ct.MODEL_MODE_TRAIN

  @nn.compact
  def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array, cache=None, cache_mask=None):
    cfg = self.config
    act_axes = (ct.BATCH, ct.LENGTH, ct.ACT_EMBED)
    x = sharding.constrain(x, act_axes, self.mesh, cfg)
    dropout = nn.Dropout(rate=cfg.dropout_rate, broadcast_dims=(-2,))

    h = RMSNorm(cfg, name="pre_self_attention_layer_norm")(x)
    h, kv = Attention(cfg, self.mesh, self.model_mode, name="self_attention")(h, segment_ids, positions, cache, cache_mask)
    x = x + dropout(h, deterministic=self.deterministic)

    h = RMSNorm(cfg, name="post_self_attention_layer_norm")(x)
    h = MlpBlock(cfg, self.mesh, name="mlp")(h)
    x = x + dropout(h, deterministic=self.deterministic)
    return sharding.constrain(x, act_axes, self.mesh, cfg), kv
