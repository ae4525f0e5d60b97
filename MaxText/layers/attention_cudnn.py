"""cuDNN fused attention: `cudnn_flash_jax` and `cudnn_flash_te` on NVIDIA GPUs, through jax.nn.dot_product_attention.

Both names run the same kernel (Transformer Engine is not a dependency). cuDNN lacks some features (soft cap,
float32, traced windows, attention sinks, long heads, odd lengths); their rows in kernel_capabilities declare them,
and asking for them raises `ValueError` (at config time, or from attention_kernels.attend when the step is traced),
never a silent wrong answer. Chunked attention (Llama 4) needs no feature of cuDNN's: the chunks
join the documents in the boolean mask the call already takes (`attention_masks.chunk_segment_ids`).
"""

import jax

from MaxText.layers.attention_masks import AttentionSettings, chunk_segment_ids


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
