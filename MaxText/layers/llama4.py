"""The Llama 4 decoder layers (Meta 2025, the text model of Llama 4 Scout and Maverick; transformers'
modeling_llama4 is the reference).

Llama's pre-norm layer with, in its attention:
  - RoPE layers and NoPE layers: every nope_layer_interval-th layer (the 4th, 8th, ...) has no rotary embedding and
    attends to the whole context; the others rotate queries and keys by Llama 3.1-scaled RoPE over interleaved pairs
    (2i, 2i + 1), as Meta's reference multiplies complex numbers, and attend only within their chunk of
    chunk_attn_window_size positions (chunked attention);
  - in the RoPE layers, with use_qk_norm (Scout), each query and key head L2-normalised after RoPE:
    x / sqrt(mean(x^2) + eps), without a weight, eps = normalization_layer_epsilon (transformers' Llama4TextL2Norm
    with rms_norm_eps);
  - in the NoPE layers, with temperature_tuning, queries scaled by log(floor((position + 1) / floor_scale) + 1) *
    scale + 1 (Nakanishi 2025, arXiv:2501.19399: the softmax sharpens with the context it spreads over);
and for its MLP a mixture of experts (layers/moe.py) with top-1 sigmoid routing whose score scales the chosen
expert's input (not its output), no renormalisation, plus one shared expert of moe_mlp_dim, in every
interleave_moe_layer_step-th layer (every layer for Scout, every 2nd for Maverick), and a dense SwiGLU MLP of mlp_dim
in the others.

Which kind a layer's attention is depends on its index, which is traced inside a scan: the choices are made with
jnp.where there (both rotations are computed; they are cheap beside the projections). The dense and MoE layers
differ in their parameters, so an interleaved model's layers are scanned by periods of interleave_moe_layer_step
layers, dense ones first (decoders.Period; `period_layers` below).
"""

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText.common_types import Config
from MaxText.families.llama4 import is_nope_layer
from MaxText.layers.attention_masks import AttentionSettings
from MaxText.layers.attentions import Attention
from MaxText.layers.embeddings import apply_rope, rope_frequencies
from MaxText.layers.llama import LlamaDecoderLayer, causal_pairs
from MaxText.layers.moe import MoeBlock


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32 (no weight: transformers' Llama4TextL2Norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def attention_temperature(config: Config, positions: jax.Array) -> jax.Array:
  """The NoPE layers' query scale at positions [batch, length]: log(floor((p + 1) / floor_scale) + 1) * scale + 1
  (transformers' attn_temperature_tuning, with attn_scale and floor_scale), float32 [batch, length].

  By each token's position in its document, where transformers takes its index in the batch row (ignoring
  position_ids): the same for one right-padded document per row (the parity tests), but packed documents here each
  start at 1, and a left-padded row in transformers counts its padding."""
  floor = jnp.floor((positions.astype(jnp.float32) + 1.0) / config.temperature_tuning_floor_scale)
  return jnp.log1p(floor) * config.temperature_tuning_scale + 1.0


def _select(choice, if_true, if_false):
  """if_true where `choice` (a python bool picks at trace time; a traced one by jnp.where)."""
  if isinstance(choice, bool):
    return if_true if choice else if_false
  return jnp.where(choice, if_true, if_false)


class Llama4Attention(Attention):
  """Attention (see there) whose rotation and mask follow the layer's kind (RoPE or NoPE, see the module)."""

  def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array, layer_index) -> tuple[jax.Array, jax.Array]:
    cfg = self.config
    nope = is_nope_layer(cfg, layer_index)
    nope_q = q
    if cfg.temperature_tuning and nope is not False:
      nope_q = (q * attention_temperature(cfg, positions)[:, :, None, None]).astype(q.dtype)
    if nope is True:
      return nope_q, k
    freq = rope_frequencies(cfg, cfg.head_dim)
    rope_q, rope_k = (apply_rope(x, positions, freq, interleaved=True) for x in (q, k))
    if cfg.use_qk_norm:
      eps = cfg.normalization_layer_epsilon
      rope_q, rope_k = l2_norm(rope_q, eps), l2_norm(rope_k, eps)
    return _select(nope, nope_q, rope_q), _select(nope, k, rope_k)

  def settings(self, sliding_window, layer_index) -> AttentionSettings:
    cfg = self.config
    chunk = _select(is_nope_layer(cfg, layer_index), 0, cfg.chunk_attn_window_size)
    return AttentionSettings.from_config(cfg, window=sliding_window, chunk=chunk, cap=cfg.attn_logits_soft_cap)


class Llama4DenseLayer(LlamaDecoderLayer):
  """Llama's layer (see there) with Llama 4's attention and a dense SwiGLU MLP of mlp_dim: the layers between the
  MoE ones of an interleaved model (Maverick's even layers)."""

  def attention(self) -> Llama4Attention:
    return Llama4Attention(self.config, self.mesh, self.model_mode, name="self_attention")

  @classmethod
  def attention_pairs(cls, config: Config, layer_index: int, length: int) -> float:
    """The RoPE layers attend within their chunk (chunk_attn_window_size), the NoPE layers to every earlier key."""
    chunk = 0 if is_nope_layer(config, layer_index) else config.chunk_attn_window_size
    return causal_pairs(length, chunk=chunk)


class Llama4MoeLayer(Llama4DenseLayer):
  """The layer whose MLP is Llama 4's mixture of experts: top-1 sigmoid routing scaling the expert's input, and the
  shared expert (MoeBlock's shared_experts=1 of moe_mlp_dim)."""

  moe = True

  def mlp(self) -> MoeBlock:
    return MoeBlock(self.config, self.mesh, scale_expert_inputs=True, name="mlp")

  @classmethod
  def period_layers(cls, config: Config) -> tuple[type[nn.Module], ...]:
    """The layer classes of one period of the model's layers (decoders.layer_stacks): interleave_moe_layer_step - 1
    dense layers, then this one."""
    return (Llama4DenseLayer,) * (config.interleave_moe_layer_step - 1) + (cls,)
