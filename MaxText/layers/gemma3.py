"""The Gemma 3 decoder layer (Gemma team 2025, arXiv:2503.19786).

Gemma 2's layer (gemma2.py: 1 + w RMSNorm, scaled and tied embeddings, GeGLU, norms before and after attention and
MLP, query_pre_attn_scalar) with three changes, as the report and Hugging Face's Gemma3ForCausalLM have them:

- QK-norm: each query and key head is RMS-normalised (Gemma's 1 + w scale, one scale for all heads) before RoPE;
  the report replaces Gemma 2's attention soft cap with it.
- Five local layers to one global layer: layer i attends globally when (i + 1) % 6 == 0 (transformers' layer_types
  from sliding_window_pattern=6), the others within sliding_window_size (the decode cache still holds every
  position for them: README, Attention kernels).
- Two RoPEs: local layers rotate with theta local_rope_max_timescale (10k), global layers with rope_max_timescale
  (1M) and their positions divided by rope_linear_scaling_factor (8 in the 4B, 12B and 27B models: the report's
  context extension to 128k, Hugging Face's "linear" rope scaling).
"""

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.common_types import Config
from MaxText.families.gemma3 import is_global, local_rope_theta
from MaxText.layers.attentions import Attention
from MaxText.layers.embeddings import apply_rope, rope_frequencies
from MaxText.layers.gemma2 import Gemma2DecoderLayer
from MaxText.layers.normalizations import RMSNorm


def rope_frequencies_by_kind(config: Config) -> tuple[np.ndarray, np.ndarray]:
  """(local, global) angular frequencies [head_dim // 2]: RoFormer's at each kind's theta; the global layers'
  divided by rope_linear_scaling_factor, which is dividing their positions by it (linear position interpolation,
  Chen et al. 2023, arXiv:2306.15595)."""
  global_ = rope_frequencies(config, config.head_dim) / np.float32(config.rope_linear_scaling_factor)
  return rope_frequencies(config, config.head_dim, theta=local_rope_theta(config)), global_


class Gemma3Attention(Attention):
  """Attention (see there) whose `rotate` applies Gemma 3's QK-norm and the RoPE of the layer's kind."""

  def rotate(self, q: jax.Array, k: jax.Array, positions: jax.Array, layer_index) -> tuple[jax.Array, jax.Array]:
    cfg = self.config
    q = RMSNorm(cfg, scale_offset=1.0, name="query_norm")(q)
    k = RMSNorm(cfg, scale_offset=1.0, name="key_norm")(k)
    local, global_ = rope_frequencies_by_kind(cfg)
    glob = is_global(layer_index)
    freq = (global_ if glob else local) if isinstance(glob, bool) else jnp.where(glob, global_, local)
    return apply_rope(q, positions, freq), apply_rope(k, positions, freq)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
  """Gemma 2's layer (see there) with Gemma3Attention and five local layers to each global one."""

  @classmethod
  def sliding_window(cls, config: Config, layer_index) -> int | jax.Array:
    glob = is_global(layer_index)
    if isinstance(glob, bool):  # unrolled layers, and the FLOP count
      return 0 if glob else config.sliding_window_size
    return jnp.where(glob, 0, config.sliding_window_size)

  def attention(self) -> Attention:
    return Gemma3Attention(self.config, self.mesh, self.model_mode, name="self_attention")
