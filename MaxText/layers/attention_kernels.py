"""Causal self-attention kernels behind the `attention` config key, and the choice among them.

Every kernel computes the same function as `dot_product_attention`, the reference: softmax(q k^T + mask) v
per head, q already scaled, causal, only within a packed document (same segment id), optionally within a
sliding window and with soft-capped logits. They differ in where they run and in memory:

- `dot_product`: XLA einsums; the [length, length] scores exist in float32. Any platform, any feature.
- `flash`: on TPU, Pallas splash attention (`splash_attention`); elsewhere `blockwise_attention`, an online
  softmax over key blocks in plain JAX (FlashAttention-2, Dao 2023, arXiv:2307.08691) whose backward recomputes
  the scores per block, so memory is O(length * block).
- `cudnn_flash_jax`, `cudnn_flash_te`: cuDNN fused attention on NVIDIA GPUs through `jax.nn.dot_product_attention`
  (`cudnn_attention`); both names run the same kernel (Transformer Engine is not a dependency). cuDNN lacks some
  features (soft cap, float32, traced windows); asking for them raises `ValueError`, never a silent wrong answer.

Sliding windows: the reference masks keys by positions (q_pos - k_pos >= window); splash, cuDNN and blockwise's
skipping of whole key blocks go by token index. The two agree because a query only sees keys of its own document
and positions are contiguous (0, 1, 2, ...) within a document, so there position and index differences are
equal. Rows of padding (segment 0), whose positions may not be contiguous, may differ; they never reach other
rows or the loss.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.layers.linears import PRECISIONS

# The values of the `attention` config key (MaxText's names).
KERNELS = ("autoselected", "dot_product", "flash", "cudnn_flash_jax", "cudnn_flash_te")

# Below this length `autoselected` picks dot_product on CPU and GPU: its [length, length] scores are small and one
# fused einsum beats a loop over blocks (TPU takes splash whenever the length fits its blocks).
SHORT_SEQUENCE = 1024

# Splash's blocks are tiled on 128 lanes: the length and every block size must be multiples of it.
SPLASH_LANES = 128

# Added to masked logits: large but finite, so a row never becomes NaN (MaxText's DEFAULT_MASK_VALUE).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

GPU_PLATFORMS = ("gpu", "cuda")


def attention_mask(segment_ids: jax.Array, positions: jax.Array, window=0) -> jax.Array:
  """[batch, 1, 1, q_len, kv_len] bool: causal, only within the same segment (packed document), and, for a
  positive `window` (sliding-window attention), only the keys less than `window` positions back."""
  index = jnp.arange(segment_ids.shape[1])
  return Tokens(segment_ids, positions, index).mask(Tokens(segment_ids, positions, index), window)[:, None, None]


class Tokens(NamedTuple):
  """What the masks need of a run of query or key tokens: segment_ids and positions [batch, n], and `index`
  [n], each token's place in the whole sequence (causality goes by it). Plain attention has index 0..n-1;
  under context parallelism a device's queries and the keys it sees are pieces of the sequence, with their
  indices ascending."""

  segment_ids: jax.Array
  positions: jax.Array
  index: jax.Array

  def mask(self, keys: "Tokens", window=0) -> jax.Array:
    """[batch, q, k] bool: key visible to query (causal by index, same segment, within the window)."""
    mask = (self.index[:, None] >= keys.index[None, :])[None]
    mask = mask & (self.segment_ids[:, :, None] == keys.segment_ids[:, None, :])
    return mask & within_window(self.positions[:, :, None], keys.positions[:, None, :], window)


def within_window(q_pos: jax.Array, k_pos: jax.Array, window) -> jax.Array:
  """Key positions a query may see under sliding-window attention (q - k < window); all of them when window <= 0.
  `window` may be traced (Gemma 2 alternates local and global layers inside one scan)."""
  if isinstance(window, int) and window <= 0:
    return jnp.asarray(True)
  return (jnp.asarray(window) <= 0) | (q_pos - k_pos < window)


def soft_cap(logits: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(logits / cap) (Gemma 2's logit soft-capping); identity for cap <= 0."""
  return cap * jnp.tanh(logits / cap) if cap > 0 else logits


def dot_product_attention(q, k, v, segment_ids, positions, precision, window=0, cap=0.0):
  """softmax(q k^T + mask) v with grouped heads; the softmax runs in float32.

  q: [batch, length, heads, head_dim] (already scaled); k, v: [batch, length, kv_heads, head_dim];
  returns [batch, length, heads, head_dim].
  """
  tokens = Tokens(segment_ids, positions, jnp.arange(q.shape[1]))
  return dense_attention(q, k, v, tokens, tokens, precision, window, cap)


def dense_attention(q, k, v, queries: Tokens, keys: Tokens, precision, window=0, cap=0.0):
  """dot_product_attention of queries [batch, q_len, heads, head_dim] against keys and values [batch, k_len,
  kv_heads, head_dim], masked by their Tokens."""
  b, t, h, d = q.shape
  kv = k.shape[2]
  q = q.reshape(b, t, kv, h // kv, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32)
  logits = jnp.where(queries.mask(keys, window)[:, None, None], soft_cap(logits, cap), MASK_VALUE)
  weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", weights, v, precision=precision)
  return out.reshape(b, t, h, -1)


# ------------------------------------------------------------------------------------------- blockwise (flash)


def is_static(window) -> bool:
  return isinstance(window, (int, np.integer))


def _pad_to(x: jax.Array, length: int, value, axis: int = 1) -> jax.Array:
  """x padded along `axis` (the sequence) to `length` with `value` ("edge": its last entry)."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  if value == "edge":
    return jnp.pad(x, pad, mode="edge")
  return jnp.pad(x, pad, constant_values=value)


class _Blocks:
  """Padded inputs of blockwise attention cut into blocks; scores are [batch, kv_heads, groups, bq, bk].

  Query and key tokens (`Tokens`) may be different runs of one sequence (context parallelism); their indices
  ascend, so the key blocks a query block needs form one range, found from the blocks' first and last indices.
  """

  def __init__(self, q, k, v, queries: Tokens, keys: Tokens, block_q, block_kv):
    b, t, h, d = q.shape
    s = k.shape[1]
    self.kv_heads = k.shape[2]
    self.groups = h // self.kv_heads
    self.bq, self.bk = min(block_q, t), min(block_kv, s)
    self.nq, self.nk = -(-t // self.bq), -(-s // self.bk)
    tq, tk = self.nq * self.bq, self.nk * self.bk
    # Padded tokens get segment -1 (no real token's), so no real query sees a padded key; padded queries are cut
    # off at the end. Their indices repeat the last one, keeping the indices ascending.
    self.q = _pad_to(q, tq, 0).reshape(b, tq, self.kv_heads, self.groups, d)
    self.k, self.v = _pad_to(k, tk, 0), _pad_to(v, tk, 0)
    self.seg_q, self.pos_q = _pad_to(queries.segment_ids, tq, -1), _pad_to(queries.positions, tq, 0)
    self.seg_k, self.pos_k = _pad_to(keys.segment_ids, tk, -1), _pad_to(keys.positions, tk, 0)
    self.idx_q, self.idx_k = _pad_to(queries.index, tq, "edge", 0), _pad_to(keys.index, tk, "edge", 0)
    self.q_first, self.q_last = self.idx_q[:: self.bq], self.idx_q[self.bq - 1 :: self.bq]
    self.k_first, self.k_last = self.idx_k[:: self.bk], self.idx_k[self.bk - 1 :: self.bk]

  def q_rows(self, x, i):
    return jax.lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=1)

  def k_rows(self, x, j):
    return jax.lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=1)

  def key_range(self, i, window):
    """[lo, hi) of the key blocks query block i needs: none wholly after its last query (causal) and, with a
    window, none wholly more than `window` tokens before its first query (masked because only the own document is
    visible and positions advance with the index there)."""
    hi = jnp.sum(self.k_first <= self.q_last[i])
    lo = jnp.sum(self.k_last <= self.q_first[i] - window)
    return jnp.where(window > 0, lo, 0), hi

  def query_range(self, j, window):
    """[lo, hi) of the query blocks that need key block j (the transpose of `key_range`)."""
    lo = jnp.sum(self.q_last < self.k_first[j])
    hi = jnp.sum(self.q_first < self.k_last[j] + window)
    return lo, jnp.where(window > 0, hi, self.nq)

  def mask(self, i, j, window, has_window):
    """[batch, 1, 1, bq, bk] bool: the reference's mask for query block i and key block j."""
    queries = Tokens(self.q_rows(self.seg_q, i), self.q_rows(self.pos_q, i), self.q_rows(self.idx_q[None], i)[0])
    keys = Tokens(self.k_rows(self.seg_k, j), self.k_rows(self.pos_k, j), self.k_rows(self.idx_k[None], j)[0])
    return queries.mask(keys, window if has_window else 0)[:, None, None]

  def logits(self, i, j, window, has_window, cap, precision):
    """(masked logits, soft-capped logits before masking, mask) of a block pair, float32."""
    s = jnp.einsum(
      "bqkgd,bskd->bkgqs",
      self.q_rows(self.q, i),
      self.k_rows(self.k, j),
      precision=precision,
      preferred_element_type=jnp.float32,
    )
    capped = soft_cap(s, cap)
    mask = self.mask(i, j, window, has_window)
    return jnp.where(mask, capped, MASK_VALUE), capped, mask


def blockwise_forward(q, k, v, queries, keys, window, block_q, block_kv, cap, precision, has_window):
  """(out [batch, q_len, heads, head_dim] float32, logsumexp [batch, kv_heads, groups, padded q_len] float32) of
  queries against keys: FlashAttention-2's forward. A query that sees no key gets out 0 and logsumexp MASK_VALUE."""
  b, t, h, d = q.shape
  blk = _Blocks(q, k, v, queries, keys, block_q, block_kv)
  stats = (b, blk.kv_heads, blk.groups, blk.bq)

  def query_block(i):
    def key_block(j, carry):
      m, denom, acc = carry
      logits, _, mask = blk.logits(i, j, window, has_window, cap, precision)
      m_new = jnp.maximum(m, logits.max(axis=-1))
      # where(): a row whose keys in this block are all masked adds nothing (exp(0) would add 1).
      p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
      alpha = jnp.exp(m - m_new)
      pv = jnp.einsum(
        "bkgqs,bskd->bkgqd",
        p.astype(v.dtype),
        blk.k_rows(blk.v, j),
        precision=precision,
        preferred_element_type=jnp.float32,
      )
      return m_new, alpha * denom + p.sum(axis=-1), alpha[..., None] * acc + pv

    init = (jnp.full(stats, MASK_VALUE, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros((*stats, d), jnp.float32))
    lo, hi = blk.key_range(i, window)
    m, denom, acc = jax.lax.fori_loop(lo, hi, key_block, init)
    denom = jnp.where(denom > 0, denom, 1.0)  # a query may see no key at all (padding; a chunk of the future)
    return acc / denom[..., None], m + jnp.log(denom)

  out, lse = jax.lax.map(query_block, jnp.arange(blk.nq))  # [nq, b, kv, g, bq, d], [nq, b, kv, g, bq]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, blk.nq * blk.bq, h, d)[:, :t]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, blk.kv_heads, blk.groups, blk.nq * blk.bq)
  return out, lse


def blockwise_backward(q, k, v, queries, keys, window, out, lse, d_out, block_q, block_kv, cap, precision, has_window):
  """float32 (dq, dk, dv) by FlashAttention-2's backward, given the forward's `out` and `lse` (of these queries
  against all the keys they attend to, which may be more than `k`: a ring step's share is then the gradient
  through these keys). Each block pair's probabilities are recomputed from the logsumexp; a loop over key blocks
  accumulates dk, dv of its block and adds into dq."""
  b, t, h, d = q.shape
  blk = _Blocks(q, k, v, queries, keys, block_q, block_kv)
  tq = blk.nq * blk.bq
  d_out = _pad_to(d_out, tq, 0).reshape(blk.q.shape)
  # delta = rowsum(dO * O) = sum_s p_s dp_s, the softmax backward's subtracted term.
  delta = jnp.einsum(
    "bqkgd,bqkgd->bkgq", d_out.astype(jnp.float32), _pad_to(out, tq, 0).reshape(blk.q.shape).astype(jnp.float32)
  )

  def key_block(dq, j):
    k_j, v_j = blk.k_rows(blk.k, j), blk.k_rows(blk.v, j)

    def query_block(i, carry):
      dq, dk_j, dv_j = carry
      logits, capped, mask = blk.logits(i, j, window, has_window, cap, precision)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * blk.bq, blk.bq, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * blk.bq, blk.bq, axis=3)
      p = jnp.where(mask, jnp.exp(logits - lse_i[..., None]), 0.0)
      do_i, q_i = blk.q_rows(d_out, i), blk.q_rows(blk.q, i)
      dv_j += jnp.einsum(
        "bkgqs,bqkgd->bskd", p.astype(v.dtype), do_i, precision=precision, preferred_element_type=jnp.float32
      )
      dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, v_j, precision=precision, preferred_element_type=jnp.float32)
      ds = p * (dp - delta_i[..., None])
      if cap > 0:
        ds *= 1.0 - jnp.square(capped / cap)  # d/dx cap tanh(x / cap) = 1 - tanh^2
      ds = ds.astype(q.dtype)
      dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_j, precision=precision, preferred_element_type=jnp.float32)
      dq = jax.lax.dynamic_update_slice_in_dim(dq, blk.q_rows(dq, i) + dq_i, i * blk.bq, axis=1)
      dk_j += jnp.einsum("bkgqs,bqkgd->bskd", ds, q_i, precision=precision, preferred_element_type=jnp.float32)
      return dq, dk_j, dv_j

    zeros = jnp.zeros((b, blk.bk, blk.kv_heads, d), jnp.float32)
    lo, hi = blk.query_range(j, window)
    dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_block, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(blk.q.shape, jnp.float32), jnp.arange(blk.nk))
  s = k.shape[1]
  dq = dq.reshape(b, tq, h, d)[:, :t]
  dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, blk.nk * blk.bk, blk.kv_heads, d)[:, :s]
  dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, blk.nk * blk.bk, blk.kv_heads, d)[:, :s]
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _blockwise(q, k, v, queries, keys, window, block_q, block_kv, cap, precision, has_window):
  out, _ = blockwise_forward(q, k, v, queries, keys, window, block_q, block_kv, cap, precision, has_window)
  return out.astype(v.dtype)


def _blockwise_fwd(q, k, v, queries, keys, window, block_q, block_kv, cap, precision, has_window):
  out, lse = blockwise_forward(q, k, v, queries, keys, window, block_q, block_kv, cap, precision, has_window)
  out = out.astype(v.dtype)
  return out, (q, k, v, queries, keys, window, out, lse)


def _blockwise_bwd(block_q, block_kv, cap, precision, has_window, residuals, d_out):
  q, k, v, queries, keys, window, out, lse = residuals
  dq, dk, dv = blockwise_backward(
    q, k, v, queries, keys, window, out, lse, d_out, block_q, block_kv, cap, precision, has_window
  )
  no_grad = jax.tree_util.tree_map(lambda _: None, (queries, keys))  # integers: no cotangent
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad, None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, segment_ids, positions, *, block_q=512, block_kv=512, window=0, cap=0.0, precision=None):
  """Memory-efficient causal attention in plain JAX, equal to `dot_product_attention` up to float rounding.

  q: [batch, length, heads, head_dim] (already scaled); k, v: [batch, length, kv_heads, head_dim];
  segment_ids, positions: [batch, length] int32; window: python int or traced int32 scalar (<= 0: none);
  cap: python float (0: none). Returns [batch, length, heads, head_dim] in v.dtype.

  Forward and backward loop over [block_q, block_kv] tiles (clipped to the length; the length is padded to a
  multiple internally), keeping float32 statistics, so memory is O(length * block), never [length, length].
  Key blocks wholly in a query block's future, or wholly before its window, are skipped.
  """
  tokens = Tokens(segment_ids, positions, jnp.arange(q.shape[1], dtype=jnp.int32))
  return blockwise_tokens(
    q, k, v, tokens, tokens, block_q=block_q, block_kv=block_kv, window=window, cap=cap, precision=precision
  )


def blockwise_tokens(q, k, v, queries: Tokens, keys: Tokens, *, block_q, block_kv, window=0, cap=0.0, precision=None):
  """blockwise_attention of queries against keys of their own `Tokens` (context parallelism: a device's queries
  against gathered keys)."""
  has_window = not (is_static(window) and window <= 0)
  window = jnp.asarray(window if has_window else 0, jnp.int32)
  return _blockwise(q, k, v, queries, keys, window, int(block_q), int(block_kv), float(cap), precision, has_window)


# ------------------------------------------------------------------------------------------------ splash (TPU)


def splash_block_sizes(config: Config, length: int) -> splash.BlockSizes:
  """Splash's tiles from the sa_* keys, each clipped to the length; ValueError if the length does not fit them."""
  names = (
    "sa_block_q",
    "sa_block_kv",
    "sa_block_kv_compute",
    "sa_block_q_dkv",
    "sa_block_kv_dkv",
    "sa_block_kv_dkv_compute",
  )
  if not config.sa_use_fused_bwd_kernel:
    names += ("sa_block_q_dq", "sa_block_kv_dq")
  blocks = {name: min(getattr(config, name), length) for name in names}
  problems = [f"length {length} is not a multiple of {SPLASH_LANES}"] if length % SPLASH_LANES else []
  problems += [f"{name}={size} does not divide length {length}" for name, size in blocks.items() if length % size]
  problems += [f"{name}={size} is not a multiple of {SPLASH_LANES}" for name, size in blocks.items() if size % SPLASH_LANES]
  if problems:
    raise ConfigError(
      f"attention=flash (splash): {'; '.join(problems)}; set max_target_length or the sa_block_* keys to fit, "
      f"or use attention=dot_product"
    )
  layout = {f"{axis}_layout": splash.QKVLayout[getattr(config, f"sa_{axis}_layout")] for axis in ("q", "k", "v")}
  return splash.BlockSizes(
    **{name.removeprefix("sa_"): size for name, size in blocks.items()},
    use_fused_bwd_kernel=config.sa_use_fused_bwd_kernel,
    **layout,
  )


def _splash_one_device(q, k, v, segment_ids, block_sizes, window, cap, interpret):
  """Splash on one device's shard: q [batch, heads, length, head_dim], k, v [batch, kv_heads, length, head_dim],
  segment_ids [batch, length]; `window` a python int."""
  heads, length = q.shape[1], q.shape[2]
  if window > 0:
    # (window - 1, 0): q - (window - 1) <= k <= q, i.e. causal and q - k < window, in token indices.
    mask = splash_mask.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
  else:
    mask = splash_mask.CausalMask((length, length))
  mqa = k.shape[1] == 1
  make = splash.make_splash_mqa if mqa else splash.make_splash_mha
  kernel = make(
    splash_mask.MultiHeadMask((mask,) * heads),
    block_sizes=block_sizes,
    attn_logits_soft_cap=cap if cap > 0 else None,
    head_shards=1,
    q_seq_shards=1,
    interpret=interpret,
  )
  if mqa:
    k, v = k[:, 0], v[:, 0]
  ids = splash.SegmentIds(segment_ids, segment_ids)
  return jax.vmap(kernel)(q, k, v, segment_ids=ids)


def splash_attention(
  q, k, v, segment_ids, positions, *, config: Config, mesh=None, window=0, cap=0.0, interpret=False
) -> jax.Array:
  """Pallas splash attention (TPU; `interpret=True` runs it on CPU), under shard_map when a mesh is given.

  Shapes as `attend`. Batch is split over the mesh axes of activation_batch, heads over those of activation_heads
  (kv heads too; when their count does not divide those axes, kv heads are repeated to one per query head).
  The length stays whole on each device. A traced `window` switches at run time between a causal kernel and a
  local one of window `config.sliding_window_size` (the only windows the model families use); any other value
  takes `blockwise_attention`, so the answer is never wrong.
  """
  b, t, h, d = q.shape
  block_sizes = splash_block_sizes(config, t)
  static = is_static(window)
  local_window = int(window) if static else config.sliding_window_size

  def per_device(q, k, v, segment_ids, positions, window):
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))

    def run(w):
      return lambda: _splash_one_device(qt, kt, vt, segment_ids, block_sizes, w, cap, interpret).transpose(0, 2, 1, 3)

    if static:
      return run(local_window)()
    fallback = functools.partial(_configured_blockwise, q, k, v, segment_ids, positions, config, window, cap)
    branches = [run(0)] + ([run(local_window), fallback] if local_window > 0 else [fallback])
    index = jnp.where(window <= 0, 0, jnp.where(window == local_window, 1, len(branches) - 1))
    return jax.lax.switch(index, branches)

  window = jnp.asarray(0 if static else window, jnp.int32)
  if mesh is None:
    return per_device(q, k, v, segment_ids, positions, window)

  batch_axes = sharding.logical_to_mesh_spec((ct.BATCH,), config)[0]
  head_axes = sharding.logical_to_mesh_spec((ct.ACT_HEADS,), config)[0]
  for name, count, axes in (("batch", b, batch_axes), ("heads", h, head_axes)):
    if count % mesh_size(mesh, axes):
      raise ConfigError(
        f"attention=flash (splash): {name}={count} does not divide into the {mesh_size(mesh, axes)} shards of mesh "
        f"axes {axes}; change the parallelism or use attention=dot_product"
      )
  k, v = kv_heads_local(k, v, h, mesh, config)
  qkv_spec = PartitionSpec(batch_axes, None, head_axes, None)
  ids_spec = PartitionSpec(batch_axes, None)
  sharded = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(qkv_spec, qkv_spec, qkv_spec, ids_spec, ids_spec, PartitionSpec()),
    out_specs=qkv_spec,
    check_vma=False,
  )
  return sharded(q, k, v, segment_ids, positions, window)


def kv_heads_local(k, v, heads: int, mesh, config: Config):
  """(k, v) [batch, length, kv_heads, head_dim] such that, with heads split over the mesh axes of activation_heads
  inside shard_map, each device's query heads find their kv heads locally: as they are when the kv heads split
  the same way, else repeated to one per query head."""
  head_axes = sharding.logical_to_mesh_spec((ct.ACT_HEADS,), config)[0]
  kv_axes = sharding.logical_to_mesh_spec((ct.ACT_KV_HEADS,), config)[0]
  head_shards = mesh_size(mesh, head_axes)
  if head_shards > 1 and (kv_axes != head_axes or k.shape[2] % head_shards):
    return tuple(jnp.repeat(x, heads // k.shape[2], axis=2) for x in (k, v))
  return k, v


def mesh_size(mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


# ------------------------------------------------------------------------------------------------- cuDNN (GPU)


def cudnn_unsupported_reason(config: Config, q_shape, dtype, window, cap) -> str | None:
  """What cuDNN fused attention cannot do for this call, in a phrase; None when it can.

  config: the run's Config (no limit depends on it today); q_shape: [batch, length, heads, head_dim];
  dtype: the inputs' dtype; window: python int or traced scalar; cap: the logit soft cap.
  """
  del config
  length, head_dim = q_shape[1], q_shape[3]
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


def cudnn_attention(q, k, v, segment_ids, *, window=0, implementation="cudnn") -> jax.Array:
  """cuDNN fused attention (jax.nn.dot_product_attention), causal, per document, optionally windowed.

  Shapes as `attend`; q already scaled (scale=1). Packed documents travel as a [batch, 1, length, length] boolean
  mask (cuDNN takes it as an additive bias): public JAX has no per-document offsets, so memory is not O(length)
  but the mask's, still far below dot_product's float32 scores of every head. `implementation="xla"` runs the same
  call through XLA (tests on CPU).
  """
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


# ------------------------------------------------------------------------------------------ choice and dispatch


def platform_of(mesh) -> str:
  """The platform the attention runs on: the mesh's devices (e.g. TPU devices of a topology compiled on a CPU
  host), else JAX's default backend."""
  if mesh is not None:
    return mesh.devices.flat[0].platform
  return jax.default_backend()


def _resolve(name, length, platform, *, config, q_shape=None, dtype=None, window=0, cap=0.0) -> str:
  if name not in KERNELS:
    raise ConfigError(f"attention={name} is not one of {', '.join(KERNELS)}")
  if name != "autoselected":
    return name
  if platform == "tpu":
    try:
      splash_block_sizes(config, length)
    except ValueError:
      return "dot_product"
    return "flash"
  if length < SHORT_SEQUENCE:
    return "dot_product"
  if platform in GPU_PLATFORMS:
    shape = q_shape if q_shape is not None else (1, length, 1, 128)
    reason = cudnn_unsupported_reason(config, shape, dtype if dtype is not None else jnp.bfloat16, window, cap)
    return "flash" if reason else "cudnn_flash_jax"  # Blockwise where cuDNN cannot: memory stays linear.
  return "flash"


def select(config: Config, length: int, platform: str, *, q_shape=None, dtype=None, window=0, cap=0.0) -> str:
  """The concrete kernel that config.attention means for a sequence length on a platform ("cpu", "gpu"/"cuda",
  "tpu"). autoselected: TPU -> flash (splash) whenever the length fits its blocks, else dot_product; CPU and GPU
  -> dot_product below SHORT_SEQUENCE; GPU -> cudnn_flash_jax when cuDNN supports the call (q_shape
  [batch, length, heads, head_dim], dtype, window, cap; unknown ones are taken as supported), else flash (blockwise);
  CPU -> flash (blockwise). Any other value is returned as it is (ValueError if it is not in KERNELS)."""
  return _resolve(config.attention, length, platform, config=config, q_shape=q_shape, dtype=dtype, window=window, cap=cap)


def _dot_product(q, k, v, segment_ids, positions, *, config, mesh, window, cap, name, platform):
  del mesh, name, platform
  return dot_product_attention(q, k, v, segment_ids, positions, PRECISIONS[config.matmul_precision], window, cap)


def _flash(q, k, v, segment_ids, positions, *, config, mesh, window, cap, name, platform):
  del name
  if platform == "tpu":
    return splash_attention(q, k, v, segment_ids, positions, config=config, mesh=mesh, window=window, cap=cap)
  return _configured_blockwise(q, k, v, segment_ids, positions, config, window, cap)


def _configured_blockwise(q, k, v, segment_ids, positions, config, window, cap):
  """blockwise_attention with the config's block sizes (sa_block_q, sa_block_kv) and matmul precision."""
  precision = PRECISIONS[config.matmul_precision]
  return blockwise_attention(
    q,
    k,
    v,
    segment_ids,
    positions,
    block_q=config.sa_block_q,
    block_kv=config.sa_block_kv,
    window=window,
    cap=cap,
    precision=precision,
  )


def _cudnn(q, k, v, segment_ids, positions, *, config, mesh, window, cap, name, platform):
  del positions, mesh
  reason = cudnn_unsupported_reason(config, q.shape, q.dtype, window, cap)
  if reason is None and platform not in GPU_PLATFORMS:
    reason = f"cuDNN fused attention runs on NVIDIA GPUs only, not on {platform}"
  if reason:
    raise ConfigError(f"attention={name}: {reason}; use attention=flash or attention=dot_product")
  return cudnn_attention(q, k, v, segment_ids, window=window)


_DISPATCH = {"dot_product": _dot_product, "flash": _flash, "cudnn_flash_jax": _cudnn, "cudnn_flash_te": _cudnn}


def attend(q, k, v, segment_ids, positions, *, config: Config, mesh=None, window=0, cap=0.0, kernel=None) -> jax.Array:
  """Causal self-attention by the kernel `kernel` (default config.attention), "autoselected" resolved by `select`.

  q: [batch, length, heads, head_dim], already scaled; k, v: [batch, length, kv_heads, head_dim];
  segment_ids, positions: [batch, length] int32 (segment 0 = padding; positions restart at 0 in each document);
  window: sliding window (keys with q_pos - k_pos >= window are masked; <= 0: none), python int or traced int32;
  cap: logit soft cap (0: none). Returns [batch, length, heads, head_dim] in v.dtype.
  """
  platform = platform_of(mesh)
  name = _resolve(
    kernel or config.attention,
    q.shape[1],
    platform,
    config=config,
    q_shape=q.shape,
    dtype=q.dtype,
    window=window,
    cap=cap,
  )
  run = _DISPATCH[name]
  return run(q, k, v, segment_ids, positions, config=config, mesh=mesh, window=window, cap=cap, name=name, platform=platform)
