"""What every attention kernel shares: which keys a query sees, how logits are capped, and the settings of a call.

A query sees a key when the key is not in its future (by index in the whole sequence), belongs to the same packed
document (segment id), with a sliding window lies less than `window` positions back, and with chunked attention
(Llama 4) lies in the same chunk of `chunk` positions (q_pos // chunk == k_pos // chunk). Masked logits get
MASK_VALUE, large but finite, so that a row with no visible key is never NaN. Every kernel (attention_kernels.py)
applies these rules, and `AttentionSettings` carries everything a call needs beyond its arrays.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from MaxText.common_types import Config
from MaxText.layers.linears import PRECISIONS

# Added to masked logits: large but finite, so a row never becomes NaN (MaxText's DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
  """What an attention call computes, and how, besides its arrays (q, k, v, segment ids, positions).

  window: sliding window, keys with q_pos - k_pos >= window are masked (<= 0: none); a python int, or a traced
    int32 scalar when the layers of one scan differ (Gemma 2 alternates local and global layers);
  chunk: chunked attention, keys outside the query's chunk of `chunk` positions are masked (<= 0: none; Llama 4's
    RoPE layers); a python int or a traced int32 scalar, as the window;
  sinks: learned attention sinks, [heads] float32 logits, one per head, that join every query's softmax without a
    value (gpt-oss): the weights of the real keys then sum to less than 1; None: no sinks;
  cap: logit soft cap, cap * tanh(logits / cap) (0: none; Gemma 2);
  precision: of the matmuls;
  float32_qk_product, float32_logits: the dense kernels' (dot_product, the KV-cache paths) score dtype, MaxText's
    keys (dense_scores): q.k computed in float32, and the scores cast to float32 before the mask and softmax; both
    False: scores and softmax in the activation dtype. Blockwise, splash and cuDNN keep float32 scores and softmax
    statistics in their tiles whatever these say;
  block_q, block_kv: the tiles of blockwise attention (clipped to the length);
  interpret: run Pallas kernels (splash) in interpret mode, on any platform (tests on the CPU);
  config: the run's Config, for what only the choice of kernel, splash and the mesh read (`attention`, the sa_*
    tiles, sliding_window_size, logical_axis_rules); None for direct calls of blockwise or dot_product.
  """

  window: int | jax.Array = 0
  chunk: int | jax.Array = 0
  sinks: jax.Array | None = None
  cap: float = 0.0
  precision: jax.lax.Precision | None = None
  float32_qk_product: bool = False
  float32_logits: bool = False
  block_q: int = 512
  block_kv: int = 512
  interpret: bool = False
  config: Config | None = None

  @classmethod
  def from_config(cls, config: Config, **fields) -> "AttentionSettings":
    """The settings a model's attention runs with: the config's matmul precision, score dtype (float32_qk_product,
    float32_logits) and blocks (sa_block_q, sa_block_kv), and the given fields (window, cap, ...)."""
    fields = {
      "precision": PRECISIONS[config.matmul_precision],
      "float32_qk_product": config.float32_qk_product,
      "float32_logits": config.float32_logits,
      "block_q": config.sa_block_q,
      "block_kv": config.sa_block_kv,
      **fields,
    }
    return cls(config=config, **fields)

  @property
  def windowed(self) -> bool:
    """Whether a window may apply; known before tracing (False only for a python window <= 0)."""
    return not (is_static(self.window) and self.window <= 0)

  @property
  def chunked(self) -> bool:
    """Whether chunked attention may apply; known before tracing (False only for a python chunk <= 0)."""
    return not (is_static(self.chunk) and self.chunk <= 0)

  def window_array(self) -> jax.Array | None:
    """The window as an int32 scalar for kernels that take it as data, None when there is none (so its masks are
    skipped at trace time)."""
    return jnp.asarray(self.window, jnp.int32) if self.windowed else None

  def chunk_array(self) -> jax.Array | None:
    """The chunk as an int32 scalar, as window_array."""
    return jnp.asarray(self.chunk, jnp.int32) if self.chunked else None

  def static(self) -> "AttentionSettings":
    """These settings without the window, chunk and sinks (they may be traced, and travel as data) and the config:
    the constants a kernel's compiled parts (custom_vjp's non-differentiable arguments) are specialised on."""
    return dataclasses.replace(self, window=0, chunk=0, sinks=None, config=None)


def is_static(window) -> bool:
  """Whether a window is a python integer, known at trace time (else a traced scalar)."""
  return isinstance(window, (int, np.integer))


class Tokens(NamedTuple):
  """What the masks need of a run of query or key tokens: segment_ids and positions [batch, n], and `index`
  [n], each token's place in the whole sequence (causality goes by it). Plain attention has index 0..n-1;
  under context parallelism a device's queries and the keys it sees are pieces of the sequence, with their
  indices ascending."""

  segment_ids: jax.Array
  positions: jax.Array
  index: jax.Array

  def mask(self, keys: "Tokens", window=0, chunk=0) -> jax.Array:
    """[batch, q, k] bool: key visible to query (causal by index, same segment, within the window and chunk)."""
    mask = (self.index[:, None] >= keys.index[None, :])[None]
    mask = mask & (self.segment_ids[:, :, None] == keys.segment_ids[:, None, :])
    q_pos, k_pos = self.positions[:, :, None], keys.positions[:, None, :]
    return mask & within_window(q_pos, k_pos, window) & within_chunk(q_pos, k_pos, chunk)


class Mask(NamedTuple):
  """Which keys each query sees: the queries' and the keys' Tokens, and the window and chunk as int32 scalars
  (None: none, known at trace time)."""

  queries: Tokens
  keys: Tokens
  window: jax.Array | None = None
  chunk: jax.Array | None = None

  def visible(self) -> jax.Array:
    """[batch, q, k] bool."""
    window, chunk = (0 if x is None else x for x in (self.window, self.chunk))
    return self.queries.mask(self.keys, window, chunk)


def within_window(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
  """Key positions a query may see under sliding-window attention (q - k < window); all of them when window <= 0.
  `window` may be traced (Gemma 2 alternates local and global layers inside one scan)."""
  if isinstance(window, int) and window <= 0:
    return jnp.asarray(True)
  return (jnp.asarray(window) <= 0) | (q_pos - k_pos < window)


def within_chunk(q_pos: jax.Array, k_pos: jax.Array, chunk) -> jax.Array:
  """Key positions in the query's chunk (q // chunk == k // chunk, Llama 4's chunked attention); all of them when
  chunk <= 0. `chunk` may be traced."""
  if isinstance(chunk, int) and chunk <= 0:
    return jnp.asarray(True)
  chunk = jnp.asarray(chunk)
  size = jnp.maximum(chunk, 1)
  return (chunk <= 0) | (q_pos // size == k_pos // size)


def chunk_segment_ids(segment_ids: jax.Array, positions: jax.Array, chunk) -> jax.Array:
  """[batch, length] int32 ids, equal for two tokens exactly when they share a document and a chunk of `chunk`
  positions (within_chunk): each run of tokens with one segment id and one chunk number gets its own id. For kernels
  that mask by segment ids and token index only (splash, cuDNN), these ids make a causal mask chunked, exactly by
  positions, with packed documents, and with a traced chunk. Positions ascend within a document, so two of its
  tokens share a chunk when every token between them does. `chunk` <= 0: the runs are the documents."""
  chunk = jnp.asarray(chunk)
  number = jnp.where(chunk > 0, positions // jnp.maximum(chunk, 1), 0)
  starts = (segment_ids[:, 1:] != segment_ids[:, :-1]) | (number[:, 1:] != number[:, :-1])
  return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), jnp.cumsum(starts, axis=1, dtype=segment_ids.dtype)], 1)


def dense_scores(spec: str, q: jax.Array, k: jax.Array, settings: AttentionSettings) -> jax.Array:
  """The dense kernels' attention logits, q.k by the einsum `spec`, soft-capped, as MaxText's dot-product attention
  computes them (AttentionOp.apply_attention_dot). By default in the activation dtype: the matmul accumulates in
  float32 (TPU's MXU, GPUs, XLA on the CPU) and rounds once, so bf16 scores are within half a bf16 ulp of the exact
  product of the bf16 inputs, at half the memory of float32 ones (the [length, length] scores are dot_product's
  largest buffer). float32_qk_product: the product computed and kept in float32 (bf16 x bf16 products are exact in
  float32, so this equals casting q and k first, without their float32 copies); float32_logits: the scores cast to
  float32 after the cap, so the mask and softmax run in float32."""
  f32 = jnp.float32 if settings.float32_qk_product else None
  logits = soft_cap(jnp.einsum(spec, q, k, precision=settings.precision, preferred_element_type=f32), settings.cap)
  return logits.astype(jnp.float32) if settings.float32_logits else logits


def sink_softmax(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
  """softmax over the last axis of `logits` [..., q, k], in their dtype, with one more logit per head, the head's
  sink, whose weight is dropped (gpt-oss's attention sinks): exp(l) / (sum exp(l) + exp(sink)). `sinks` has the
  shape of logits' head axes just before [q, k] ([heads], or [kv_heads, group] for grouped queries); None: plain
  softmax. In bf16 it stays sane as MaxText's does: the row maximum is subtracted before exp, and the sum of the
  exponentials accumulates in float32 (jnp.sum's, rounded once)."""
  if sinks is None:
    return jax.nn.softmax(logits, axis=-1)
  sink = jnp.broadcast_to(sinks.astype(logits.dtype)[..., None, None], (*logits.shape[:-1], 1))
  return jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(logits / cap) (Gemma 2's logit soft-capping); identity for cap <= 0."""
  return cap * jnp.tanh(logits / cap) if cap > 0 else logits
