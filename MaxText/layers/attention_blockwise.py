"""Blockwise attention: the `flash` kernel off TPU, in plain JAX, and the pieces context parallelism builds on.

An online softmax over key blocks (FlashAttention-2, Dao 2023, arXiv:2307.08691): the forward keeps float32
running maxima, denominators and outputs per query block; the backward recomputes each block pair's probabilities
from the forward's logsumexp. Memory is O(length * block), never [length, length]. Key blocks wholly in a query
block's future, or wholly before its window or chunk, are skipped; the mask (attention_masks.py) does the rest, so
the result equals `dot_product_attention` up to float rounding.

Attention sinks (gpt-oss) join the softmax after the loop over keys, as one more logit per head with no value
(`with_sinks`): a partial result over keys is merged with the sink by log-sum-exp, exactly as context parallelism's
ring merges the partial results of its pieces, so the ring folds the sink in once, after its last piece. The
backward then needs no change for q, k, v (the logsumexp already holds the sink), and the sinks' own gradient
(`sink_grad`) is one reduction over the queries.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText.layers.attention_masks import MASK_VALUE, AttentionSettings, Mask, Tokens, soft_cap


class Forward(NamedTuple):
  """What the forward returns and the backward needs: out [batch, q_len, heads, head_dim] float32 and logsumexp
  [batch, kv_heads, groups, padded q_len] float32."""

  out: jax.Array
  lse: jax.Array


def _pad_to(x: jax.Array, length: int, value, axis: int = 1) -> jax.Array:
  """x padded along `axis` (the sequence) to `length` with `value` ("edge": its last entry)."""
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, length - x.shape[axis])
  if value == "edge":
    return jnp.pad(x, pad, mode="edge")
  return jnp.pad(x, pad, constant_values=value)


def reach(window: jax.Array | None, chunk: jax.Array | None) -> jax.Array | None:
  """How far back a visible key may lie, as an int32 scalar (0: unbounded), None when neither a window nor a chunk
  may apply. A key in the query's chunk of `chunk` positions lies less than `chunk` positions back, so a chunk
  bounds the reach as a window of its size does (a window and a chunk together: the smaller)."""
  if window is None and chunk is None:
    return None
  unbounded = jnp.iinfo(jnp.int32).max
  bounds = [jnp.where(x > 0, x, unbounded) for x in (window, chunk) if x is not None]
  nearest = functools.reduce(jnp.minimum, bounds)
  return jnp.where(nearest == unbounded, 0, nearest).astype(jnp.int32)


def by_row(x: jax.Array, length: int) -> jax.Array:
  """[batch, kv_heads, groups, padded q_len] (a logsumexp's layout) -> [batch, length, heads, 1], to scale outputs
  row by row."""
  b, kv, g, _ = x.shape
  return x[..., :length].transpose(0, 3, 1, 2).reshape(b, length, kv * g, 1)


def with_sinks(forward: Forward, sinks: jax.Array | None) -> Forward:
  """`forward` (over the keys alone) with each head's sink [heads] joining the softmax as one more logit without a
  value (gpt-oss): logsumexp' = logaddexp(logsumexp, sink), and the output scaled by exp(logsumexp - logsumexp'),
  the share of the real keys. A query that sees no key keeps out 0 and gets logsumexp' = sink."""
  if sinks is None:
    return forward
  out, lse = forward
  b, kv, g, _ = lse.shape
  total = jnp.logaddexp(lse, sinks.astype(jnp.float32).reshape(1, kv, g, 1))
  return Forward(out * by_row(jnp.exp(lse - total), out.shape[1]), total)


def sink_grad(forward: Forward, d_out: jax.Array, sinks: jax.Array) -> jax.Array:
  """d loss / d sinks [heads], given the forward with its sinks folded in and the output's cotangent d_out.

  With Z = sum_s exp(l_s) + exp(sink) and out = sum_s p_s v_s, p_s = exp(l_s) / Z, the sink's own weight
  p_sink = exp(sink - logsumexp) multiplies no value, so d out / d sink = -p_sink * out and
  d loss / d sink_h = -sum over batch and queries of p_sink * (d_out . out) for the queries of head h."""
  out, lse = forward
  b, length, h, _ = out.shape
  dot = jnp.einsum("bqhd,bqhd->bqh", d_out.astype(jnp.float32), out.astype(jnp.float32))
  p_sink = jnp.exp(sinks.astype(jnp.float32) - by_row(lse, length)[..., 0])  # [batch, length, heads]
  return -(p_sink * dot).sum(axis=(0, 1)).astype(sinks.dtype)


class _Blocks:
  """Padded inputs of blockwise attention cut into blocks; scores are [batch, kv_heads, groups, bq, bk].

  Query and key tokens (`Tokens`) may be different runs of one sequence (context parallelism); their indices
  ascend, so the key blocks a query block needs form one range, found from the blocks' first and last indices.
  """

  def __init__(self, q, k, v, mask: Mask, settings: AttentionSettings):
    queries, keys = mask.queries, mask.keys
    self.window, self.chunk, self.reach = mask.window, mask.chunk, reach(mask.window, mask.chunk)
    b, t, h, d = q.shape
    s = k.shape[1]
    self.kv_heads = k.shape[2]
    self.groups = h // self.kv_heads
    self.bq, self.bk = min(settings.block_q, t), min(settings.block_kv, s)
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

  def key_range(self, i):
    """[lo, hi) of the key blocks query block i needs: none wholly after its last query (causal) and, with a
    window or a chunk, none wholly `reach` or more tokens before its first query (masked because only the own
    document is visible and positions advance with the index there)."""
    hi = jnp.sum(self.k_first <= self.q_last[i])
    if self.reach is None:
      return 0, hi
    lo = jnp.sum(self.k_last <= self.q_first[i] - self.reach)
    return jnp.where(self.reach > 0, lo, 0), hi

  def query_range(self, j):
    """[lo, hi) of the query blocks that need key block j (the transpose of `key_range`)."""
    lo = jnp.sum(self.q_last < self.k_first[j])
    if self.reach is None:
      return lo, self.nq
    hi = jnp.sum(self.q_first < self.k_last[j] + self.reach)
    return lo, jnp.where(self.reach > 0, hi, self.nq)

  def mask(self, i, j):
    """[batch, 1, 1, bq, bk] bool: the reference's mask for query block i and key block j."""
    queries = Tokens(self.q_rows(self.seg_q, i), self.q_rows(self.pos_q, i), self.q_rows(self.idx_q[None], i)[0])
    keys = Tokens(self.k_rows(self.seg_k, j), self.k_rows(self.pos_k, j), self.k_rows(self.idx_k[None], j)[0])
    return Mask(queries, keys, self.window, self.chunk).visible()[:, None, None]

  def logits(self, i, j, settings: AttentionSettings):
    """(masked logits, soft-capped logits before masking, mask) of a block pair, float32."""
    s = jnp.einsum(
      "bqkgd,bskd->bkgqs",
      self.q_rows(self.q, i),
      self.k_rows(self.k, j),
      precision=settings.precision,
      preferred_element_type=jnp.float32,
    )
    capped = soft_cap(s, settings.cap)
    mask = self.mask(i, j)
    return jnp.where(mask, capped, MASK_VALUE), capped, mask


def blockwise_forward(q, k, v, mask: Mask, settings: AttentionSettings) -> Forward:
  """`Forward` (out, logsumexp) of the queries against the keys of `mask`: FlashAttention-2's forward, without
  sinks (`with_sinks` adds them). A query that sees no key gets out 0 and logsumexp MASK_VALUE. The window and
  chunk are the mask's; `settings` gives the rest."""
  b, t, h, d = q.shape
  precision = settings.precision
  blk = _Blocks(q, k, v, mask, settings)
  stats = (b, blk.kv_heads, blk.groups, blk.bq)

  def query_block(i):
    def key_block(j, carry):
      m, denom, acc = carry
      logits, _, mask = blk.logits(i, j, settings)
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
    lo, hi = blk.key_range(i)
    m, denom, acc = jax.lax.fori_loop(lo, hi, key_block, init)
    denom = jnp.where(denom > 0, denom, 1.0)  # a query may see no key at all (padding; a chunk of the future)
    return acc / denom[..., None], m + jnp.log(denom)

  out, lse = jax.lax.map(query_block, jnp.arange(blk.nq))  # [nq, b, kv, g, bq, d], [nq, b, kv, g, bq]
  out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, blk.nq * blk.bq, h, d)[:, :t]
  lse = lse.transpose(1, 2, 3, 0, 4).reshape(b, blk.kv_heads, blk.groups, blk.nq * blk.bq)
  return Forward(out, lse)


def blockwise_backward(q, k, v, mask: Mask, settings: AttentionSettings, forward: Forward, d_out):
  """float32 (dq, dk, dv) by FlashAttention-2's backward, given the cotangent `d_out` of the output and the
  `forward` of these queries against all the keys they attend to, which may be more than `k` (a ring step's share
  is then the gradient through these keys), sinks included (their weight is in the logsumexp; `sink_grad` gives
  their own gradient). Each block pair's probabilities are recomputed from the logsumexp; a
  loop over key blocks accumulates dk, dv of its block and adds into dq."""
  b, t, h, d = q.shape
  out, lse = forward
  precision, cap = settings.precision, settings.cap
  blk = _Blocks(q, k, v, mask, settings)
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
      logits, capped, mask = blk.logits(i, j, settings)
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
    lo, hi = blk.query_range(j)
    dq, dk_j, dv_j = jax.lax.fori_loop(lo, hi, query_block, (dq, zeros, zeros))
    return dq, (dk_j, dv_j)

  dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(blk.q.shape, jnp.float32), jnp.arange(blk.nk))
  s = k.shape[1]
  dq = dq.reshape(b, tq, h, d)[:, :t]
  dk = dk.transpose(1, 0, 2, 3, 4).reshape(b, blk.nk * blk.bk, blk.kv_heads, d)[:, :s]
  dv = dv.transpose(1, 0, 2, 3, 4).reshape(b, blk.nk * blk.bk, blk.kv_heads, d)[:, :s]
  return dq, dk, dv


# The window, chunk (in `mask`) and sinks are arguments, not static: they may be traced (one scan over layers that
# differ), and one compiled kernel serves every layer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blockwise(q, k, v, mask: Mask, sinks, settings: AttentionSettings):
  return with_sinks(blockwise_forward(q, k, v, mask, settings), sinks).out.astype(v.dtype)


def _blockwise_fwd(q, k, v, mask, sinks, settings):
  forward = with_sinks(blockwise_forward(q, k, v, mask, settings), sinks)
  out = forward.out.astype(v.dtype)
  return out, (q, k, v, mask, sinks, Forward(out, forward.lse))


def _blockwise_bwd(settings, residuals, d_out):
  q, k, v, mask, sinks, forward = residuals
  dq, dk, dv = blockwise_backward(q, k, v, mask, settings, forward, d_out)
  no_grad = jax.tree_util.tree_map(lambda _: None, mask)  # integers: no cotangent
  d_sinks = None if sinks is None else sink_grad(forward, d_out, sinks)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), no_grad, d_sinks


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q, k, v, segment_ids, positions, settings: AttentionSettings) -> jax.Array:
  """Memory-efficient causal attention in plain JAX, equal to `dot_product_attention` up to float rounding.

  q: [batch, length, heads, head_dim] (already scaled); k, v: [batch, length, kv_heads, head_dim];
  segment_ids, positions: [batch, length] int32. Of `settings`: window, chunk, sinks, cap, precision and the tiles
  block_q, block_kv. Returns [batch, length, heads, head_dim] in v.dtype; the sinks get their gradient.

  Forward and backward loop over [block_q, block_kv] tiles (clipped to the length; the length is padded to a
  multiple internally), keeping float32 statistics, so memory is O(length * block), never [length, length].
  Key blocks wholly in a query block's future, or wholly before its window or chunk, are skipped.
  """
  tokens = Tokens(segment_ids, positions, jnp.arange(q.shape[1], dtype=jnp.int32))
  return blockwise_tokens(q, k, v, tokens, tokens, settings)


def blockwise_tokens(q, k, v, queries: Tokens, keys: Tokens, settings: AttentionSettings) -> jax.Array:
  """blockwise_attention of queries against keys of their own `Tokens` (context parallelism: a device's queries
  against gathered keys)."""
  mask = Mask(queries, keys, settings.window_array(), settings.chunk_array())
  return _blockwise(q, k, v, mask, settings.sinks, settings.static())
