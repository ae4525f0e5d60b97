"""Causal self-attention kernels behind the `attention` config key, and the choice among them.

Every kernel computes the same function as `dot_product_attention`, the reference: softmax(q k^T + mask) v
per head, q already scaled, causal, only within a packed document (same segment id), optionally within a
sliding window or a chunk (Llama 4), with soft-capped logits and with attention sinks (gpt-oss; attention_masks.py).
They differ in where they run and in memory:

- `dot_product`: XLA einsums, here; the [length, length] scores exist whole, in the activation dtype as MaxText's
  (float32 with its keys float32_qk_product / float32_logits: attention_masks.dense_scores). Any platform, any
  feature. As the reference other kernels are tested against it runs with float32 scores (those keys set, or
  float32 inputs, where the keys change nothing).
- `flash`: on TPU, Pallas splash attention (attention_splash.py); elsewhere blockwise attention, an online softmax
  over key blocks in plain JAX (attention_blockwise.py) whose backward recomputes the scores per block, so memory
  is O(length * block).
- `cudnn_flash_jax`, `cudnn_flash_te`: cuDNN fused attention on NVIDIA GPUs (attention_cudnn.py); both names run
  the same kernel. cuDNN lacks some features (soft cap, float32, traced windows, sinks); asking for them raises
  `ValueError`, never a silent wrong answer.

What each kernel can do (platforms, context parallelism, sinks, soft cap, traced windows, chunks, dtypes, head
widths, tiles, memory) is its row of kernel_capabilities.CAPABILITIES, which `select`, `attend`, the config checks
and context parallelism read; each row names the function that runs its kernel (`runner` imports it).
Every kernel supports chunks (python or traced), and all but cuDNN sinks (with their gradient). Every kernel takes q,
k, v, the segment ids (and positions) it masks by, and one `AttentionSettings` (window, chunk, sinks, soft cap,
precision, tiles, config). Importing this module does not load Pallas: splash imports it when it builds a kernel.

Sliding windows: the reference masks keys by positions (q_pos - k_pos >= window); splash, cuDNN and blockwise's
skipping of whole key blocks go by token index. The two agree because a query only sees keys of its own document
and positions are contiguous (0, 1, 2, ...) within a document, so there position and index differences are
equal. Chunks rest on the same fact: splash and cuDNN give each run of tokens in one document and one chunk its
own segment id, and blockwise skips blocks `chunk` or more tokens back. Rows of padding (segment 0), whose
positions may not be contiguous, may differ; they never reach other rows or the loss.
"""

import functools
import importlib

import jax
import jax.numpy as jnp

from MaxText import kernel_capabilities
from MaxText.common_types import Config, ConfigError
from MaxText.kernel_capabilities import CAPABILITIES, SHORT_SEQUENCE
from MaxText.layers.attention_blockwise import blockwise_attention
from MaxText.layers.attention_cudnn import cudnn_attention
from MaxText.layers.attention_masks import MASK_VALUE, AttentionSettings, Tokens, dense_scores, is_static, sink_softmax
from MaxText.layers.attention_splash import splash_attention, splash_block_sizes, splash_blocks, splash_takes_sinks

__all__ = [
  "KERNELS",
  "SHORT_SEQUENCE",
  "AttentionSettings",
  "attend",
  "blockwise_attention",
  "cudnn_attention",
  "dense_attention",
  "dot_product_attention",
  "platform_of",
  "select",
  "splash_attention",
  "splash_block_sizes",
  "splash_blocks",
  "unsupported_reason",
]

# The values of the `attention` config key (MaxText's names): "autoselected" and the rows of the capability table.
KERNELS = kernel_capabilities.CHOICES


def dot_product_attention(q, k, v, segment_ids, positions, settings: AttentionSettings) -> jax.Array:
  """softmax(q k^T + mask) v with grouped heads, the scores and softmax in the dtype dense_scores gives (the
  activation dtype, or float32 by float32_qk_product / float32_logits). Of `settings`: window, chunk, sinks, cap,
  precision and those two keys.

  q: [batch, length, heads, head_dim] (already scaled); k, v: [batch, length, kv_heads, head_dim];
  returns [batch, length, heads, head_dim].
  """
  tokens = Tokens(segment_ids, positions, jnp.arange(q.shape[1]))
  return dense_attention(q, k, v, tokens, tokens, settings)


def dense_attention(q, k, v, queries: Tokens, keys: Tokens, settings: AttentionSettings) -> jax.Array:
  """dot_product_attention of queries [batch, q_len, heads, head_dim] against keys and values [batch, k_len,
  kv_heads, head_dim], masked by their Tokens."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  logits = dense_scores("btkgd,bskd->bkgts", q, k, settings)
  visible = queries.mask(keys, settings.window, settings.chunk)[:, None, None]
  logits = jnp.where(visible, logits, MASK_VALUE)
  sinks = None if settings.sinks is None else settings.sinks.reshape(kv, h // kv)
  weights = sink_softmax(logits, sinks).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", weights, v, precision=settings.precision)
  return out.reshape(b, t, h, -1)


# ------------------------------------------------------------------------------------------ choice and dispatch


def platform_of(mesh) -> str:
  """The platform the attention runs on: the mesh's devices (e.g. TPU devices of a topology compiled on a CPU
  host), else JAX's default backend."""
  if mesh is not None:
    return mesh.devices.flat[0].platform
  return jax.default_backend()


def compute_capability() -> tuple[int, int] | None:
  """The first device's CUDA compute capability (major, minor); None off NVIDIA GPUs."""
  device = jax.devices()[0]
  capability = (
    getattr(device, "compute_capability", None) if kernel_capabilities.canonical(device.platform) == "gpu" else None
  )
  return None if capability is None else tuple(int(x) for x in str(capability).split(".")[:2])


def unsupported_reason(name: str, platform: str, q_shape, dtype, window, cap, sinks=None, chunked=False) -> str | None:
  """What kernel `name` (a row of the capability table) cannot do of this call, in a phrase; None when it can. The
  features come before the platform. q_shape: [batch, length, heads, head_dim]; dtype: the inputs'; window: python
  int or traced scalar; cap: the logit soft cap; sinks: [heads] or None; chunked: AttentionSettings.chunked."""
  row = CAPABILITIES[name]
  call = kernel_capabilities.Call(
    length=q_shape[1],
    head_dim=q_shape[3],
    dtype=jnp.dtype(dtype).name,
    cap=cap,
    sinks=sinks is not None,
    windowed=not is_static(window) or window > 0,
    traced_window=not is_static(window),
    chunked=chunked,
    compute_capability=compute_capability() if row.max_head_dim_before else None,
  )
  reason = row.refusal(call)
  if reason is None and not row.runs_on(platform):
    reason = f"{row.title} runs on {row.where} only, not on {platform}"
  return reason


def _runs(name: str, config: Config, length: int, platform: str, q_shape, dtype, features: dict) -> bool:
  """Whether kernel `name` runs this call: its row's refusal, its tiles on the platform and, for splash, whether
  this jax's splash takes sinks. features: window, cap and sinks, as unsupported_reason takes them."""
  if unsupported_reason(name, platform, q_shape, dtype, **features):
    return False
  tiles = CAPABILITIES[name].tiles.get(kernel_capabilities.canonical(platform))
  try:
    if tiles is not None:
      tiles(config, length)
  except ValueError:
    return False
  return not (name == "flash" and platform == "tpu" and features["sinks"] is not None and not splash_takes_sinks())


def select(config: Config, length: int, platform: str, *, q_shape=None, dtype=None, window=0, cap=0.0, sinks=None) -> str:
  """The concrete kernel that config.attention means for a sequence length on a platform ("cpu", "gpu"/"cuda",
  "tpu"). autoselected: the first of kernel_capabilities.AUTOSELECT[platform] whose length bound holds and that runs
  the call: TPU -> flash (splash) whenever the length fits its blocks (and, with sinks, this jax's splash takes
  them), else dot_product; CPU and GPU -> dot_product below SHORT_SEQUENCE; GPU -> cudnn_flash_jax when cuDNN
  supports the call (q_shape [batch, length, heads, head_dim], dtype, window, cap, sinks; unknown ones are taken
  as supported), else flash (blockwise); CPU -> flash (blockwise). Any other value is returned as it is
  (ValueError if it is not in KERNELS). Chunks run on every kernel, so they do not enter the choice."""
  name = config.attention
  if name not in KERNELS:
    raise ConfigError(f"attention={name} is not one of {', '.join(KERNELS)}")
  if name != kernel_capabilities.AUTOSELECTED:
    return name
  shape = q_shape if q_shape is not None else (1, length, 1, 128)
  dtype = dtype if dtype is not None else jnp.bfloat16
  features = {"window": window, "cap": cap, "sinks": sinks}
  choices = kernel_capabilities.AUTOSELECT[kernel_capabilities.canonical(platform)]
  for kernel, bound in choices:
    if (bound is None or length < bound) and _runs(kernel, config, length, platform, shape, dtype, features):
      return kernel
  return choices[-1][0]


def run_dot_product(q, k, v, segment_ids, positions, settings, mesh):
  del mesh
  return dot_product_attention(q, k, v, segment_ids, positions, settings)


def run_flash(q, k, v, segment_ids, positions, settings, mesh):
  if platform_of(mesh) == "tpu":
    return splash_attention(q, k, v, segment_ids, positions, settings, mesh)
  return blockwise_attention(q, k, v, segment_ids, positions, settings)


def run_cudnn(q, k, v, segment_ids, positions, settings, mesh):
  del mesh
  return cudnn_attention(q, k, v, segment_ids, positions, settings)


@functools.cache
def runner(name: str):
  """The function that runs kernel `name`: its capability row's `runs`, "module:function", imported on first use."""
  module, function = CAPABILITIES[name].runs.split(":")
  return getattr(importlib.import_module(module), function)


def attend(q, k, v, segment_ids, positions, settings: AttentionSettings, mesh=None) -> jax.Array:
  """Causal self-attention by the kernel settings.config.attention names, "autoselected" resolved by `select`; a
  kernel asked for what its row of the capability table says it cannot do raises ConfigError in one line.

  q: [batch, length, heads, head_dim], already scaled; k, v: [batch, length, kv_heads, head_dim];
  segment_ids, positions: [batch, length] int32 (segment 0 = padding; positions restart at 0 in each document);
  settings: window, chunk, sinks, cap and the rest (AttentionSettings.from_config gives a model's); mesh: where it
  runs (splash shards over it). Returns [batch, length, heads, head_dim] in v.dtype.
  """
  config = settings.config
  platform = platform_of(mesh)
  features = {"window": settings.window, "cap": settings.cap, "sinks": settings.sinks}
  name = select(config, q.shape[1], platform, q_shape=q.shape, dtype=q.dtype, **features)
  reason = unsupported_reason(name, platform, q.shape, q.dtype, **features, chunked=settings.chunked)
  if reason:
    raise CAPABILITIES[name].refused(reason)
  return runner(name)(q, k, v, segment_ids, positions, settings, mesh)
