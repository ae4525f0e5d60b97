"""cuDNN fused attention: `cudnn_flash_jax` and `cudnn_flash_te` on NVIDIA GPUs, through jax.nn.dot_product_attention.

Both names run the same kernel (Transformer Engine is not a dependency). cuDNN lacks some features (soft cap,
float32, traced windows, attention sinks); `cudnn_unsupported_reason` names them, and asking for them raises
`ValueError`, never a silent wrong answer. Chunked attention (Llama 4) needs no feature of cuDNN's: the chunks
join the documents in the boolean mask the call already takes (`attention_masks.chunk_segment_ids`).
"""

import jax
import jax.numpy as jnp

from MaxText.common_types import Config
from MaxText.layers.attention_masks import AttentionSettings, chunk_segment_ids, is_static

GPU_PLATFORMS = ("gpu", "cuda")


def cudnn_unsupported_reason(config: Config, q_shape, dtype, window, cap, sinks=None) -> str | None:
  """What cuDNN fused attention cannot do for this call, in a phrase; None when it can.

  config: the run's Config (no limit depends on it today); q_shape: [batch, length, heads, head_dim];
  dtype: the inputs' dtype; window: python int or traced scalar; cap: the logit soft cap; sinks: the attention
  sinks [heads] or None.
  """
  del config
  length, head_dim = q_shape[1], q_shape[3]
  if sinks is not None:
    return "cuDNN fused attention has no attention sinks (gpt-oss's learned sink logit per head)"
  if cap > 0:
    return f"cuDNN fused attention has no logit soft cap (attn_logits_soft_cap={cap}, Gemma 2)"
  if not is_static(window):
    return "cuDNN fused attention takes a fixed sliding window, not one chosen per layer at run time (Gemma 2)"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN fused attention needs bfloat16 or float16 inputs, not {jnp.dtype(dtype).name} (set dtype=bfloat16)"
  max_head_dim = _cudnn_max_head_dim()
  if head_dim > max_head_dim or head_dim % 8:
    return f"cuDNN fused attention needs head_dim a multiple of 8 and at most {max_head_dim}, not {head_dim}"
  if length % 2:
    # The document mask travels as a bias, which cuDNN's backward takes only for even lengths.
    return f"cuDNN fused attention with packed documents needs an even length, not {length}"
  return None


def _cudnn_max_head_dim() -> int:
  """cuDNN's flash kernels take head_dim <= 256 from Hopper (compute capability 9.0) on, <= 128 before."""
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None) if device.platform in GPU_PLATFORMS else None
  if capability is not None and tuple(int(x) for x in str(capability).split(".")[:2]) < (9, 0):
    return 128
  return 256


def cudnn_attention(q, k, v, segment_ids, positions, settings: AttentionSettings, implementation="cudnn") -> jax.Array:
  """cuDNN fused attention (jax.nn.dot_product_attention), causal, per document, optionally windowed (settings'
  window, a python int; cuDNN takes no soft cap and no sinks) and chunked (settings' chunk, python or traced).

  Shapes as `attention_kernels.attend`; q already scaled (scale=1). Packed documents, and chunks within them, travel
  as a [batch, 1, length, length] boolean mask (cuDNN takes it as an additive bias): public JAX has no per-document
  offsets, so memory is not O(length) but the mask's, still far below dot_product's float32 scores of every head.
  `implementation="xla"` runs the same call through XLA (tests on CPU).
  """
  window = settings.window
  if settings.chunked:
    segment_ids = chunk_segment_ids(segment_ids, positions, settings.chunk)
  same_segment = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    mask=same_segment,
    scale=1.0,
    is_causal=True,
    # (left, right) excluding the query itself: keys with q - k <= window - 1 remain.
    local_window_size=(int(window) - 1, 0) if window > 0 else None,
    implementation=implementation,
  ).astype(v.dtype)
