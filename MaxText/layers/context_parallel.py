"""Context parallelism: attention over sequences split along their length across devices.

The mesh axes of `activation_length` in logical_axis_rules (base.yml: `sequence` and `context`) split every
activation along the sequence. Everything but attention is per token; attention runs here, under shard_map, each
device holding one piece of the queries, keys and values:

- `context_parallel_strategy=all_gather`: the keys and values are gathered from every device (backward: reduce-
  scattered), then the device's queries attend to all of them with the config's kernel (dot_product, or blockwise
  for flash).
- `ring`: keys and values travel round the ring of devices, one piece per step, and the device's queries attend to
  each piece with the blockwise kernel, the partial results merged by their log-sum-exp (Liu et al. 2023, Ring
  Attention, arXiv:2310.01889). The next piece's transfer is issued before the step's compute, so the two overlap.
  Memory holds two pieces of keys and values, never the whole sequence. The backward sends the keys and values
  round again, their gradients travelling with them, and each step is FlashAttention-2's backward on that piece.

Causality is by each token's index in the whole sequence (`attention_masks.Tokens`), so a device's piece need
not be contiguous. With `context_parallel_load_balance` (training) the sequence is cut into 2n chunks and device r
holds chunks r and 2n-1-r: under a causal mask every device then has the same work, where a contiguous split gives
the last device about 2n-1 times the first one's. The Transformer reorders its inputs into that order on entry and its
activations back before the output head (`reorder`), so logits, losses and everything outside it see the sequence
in its natural order. Packed documents (segment ids), sliding windows and chunked attention (Llama 4) are exact:
masks use the tokens' own segments, positions and indices. Attention sinks (gpt-oss) join the softmax once per
query: all_gather's kernel folds them in as on one device; the ring folds them into its merged result after the
last piece, and their gradient, a sum over each device's queries, is summed over the devices by shard_map.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.layers import attention_kernels
from MaxText.layers.attention_blockwise import (
  Forward,
  blockwise_backward,
  blockwise_forward,
  blockwise_tokens,
  by_row,
  sink_grad,
  with_sinks,
)
from MaxText.layers.attention_masks import MASK_VALUE, AttentionSettings, Mask, Tokens
from MaxText.layers.attention_splash import kv_heads_local

STRATEGIES = ("all_gather", "ring")


def length_axes(config: Config, mesh: Mesh | None = None) -> tuple[str, ...]:
  """The mesh axes of size > 1 that split sequences (those of activation_length)."""
  sizes = sharding.axis_sizes(config, mesh)
  return tuple(a for a in sharding.mesh_axes_of(ct.LENGTH, config) if sizes[a] > 1)


def degree(config: Config, mesh: Mesh | None = None) -> int:
  """How many pieces each sequence is split into."""
  sizes = sharding.axis_sizes(config, mesh)
  return math.prod(sizes[a] for a in length_axes(config, mesh))


def reorders(config: Config, mesh: Mesh | None, model_mode: str) -> bool:
  """Whether the Transformer runs with its tokens in load-balanced order (training under context parallelism with
  context_parallel_load_balance); prefill keeps the natural order, as its keys and values fill a cache."""
  return (
    mesh is not None
    and model_mode == ct.MODEL_MODE_TRAIN
    and config.context_parallel_load_balance
    and degree(config, mesh) > 1
  )


def piece_index(n: int, rank, piece: int, balanced: bool) -> jax.Array:
  """[piece] int32: the indices in the whole sequence of the tokens device `rank` (may be traced) of n holds."""
  if not balanced:
    return rank * piece + jnp.arange(piece, dtype=jnp.int32)
  half = piece // 2
  chunk = jnp.arange(half, dtype=jnp.int32)
  return jnp.concatenate([rank * half + chunk, (2 * n - 1 - rank) * half + chunk])


def load_balanced_order(length: int, n: int) -> np.ndarray:
  """[length]: the index in the natural sequence of each place of the load-balanced one (device r's piece holds
  chunks r and 2n-1-r of 2n)."""
  half = length // (2 * n)
  chunks = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
  return np.concatenate([c * half + np.arange(half) for c in chunks])


def _moves(n: int, inverse: bool) -> dict[tuple[int, int], list[tuple[int, int]]]:
  """The load-balancing permutation as collective permutes of half-pieces: {(source half, destination half):
  [(source device, destination device)]}. Chunk c of 2n lies on device c // 2, half c % 2, in the natural order,
  and on device c (first half) or 2n-1-c (second half) in the balanced one."""
  moves = {}
  for c in range(2 * n):
    natural = (c // 2, c % 2)
    balanced = (c, 0) if c < n else (2 * n - 1 - c, 1)
    (src, src_half), (dst, dst_half) = (balanced, natural) if inverse else (natural, balanced)
    moves.setdefault((src_half, dst_half), []).append((src, dst))
  return moves


def reorder(x: jax.Array, logical_axes, config: Config, mesh: Mesh, inverse: bool = False) -> jax.Array:
  """x [batch, length, ...] (sharded by `logical_axes`, the length by the context-parallel axes) in load-balanced
  order (`load_balanced_order`), or with `inverse` back in the natural order. Each device sends its two half-pieces
  to where they belong with collective permutes: no device ever holds more than its own piece."""
  axes, n = length_axes(config, mesh), degree(config, mesh)
  if x.shape[1] % (2 * n):
    raise ConfigError(
      f"context_parallel_load_balance: a length of {x.shape[1]} does not split into 2 x {n} chunks; make "
      f"max_target_length a multiple of {2 * n} or set context_parallel_load_balance=false"
    )
  spec = sharding.logical_to_mesh_spec(logical_axes, config)
  moves = _moves(n, inverse)

  def per_device(x):
    halves = jnp.split(x, 2, axis=1)
    out = [jnp.zeros_like(halves[0]), jnp.zeros_like(halves[1])]
    received = _permute_in_turn([halves[src] for src, _ in moves], axes, list(moves.values()))
    for (_, dst_half), piece in zip(moves, received, strict=True):
      out[dst_half] = out[dst_half] + piece
    return jnp.concatenate(out, axis=1)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)(x)


def _permute_in_turn(xs, axes, pairs, after=None):
  """[ppermute(x, axes, p) for x, p in zip(xs, pairs)], each waiting (an optimization barrier) for the one before,
  the first for `after` if given, so that every device runs them in the same order: JAX gives all these collective
  permutes one channel, and XLA's CPU runtime, free to run independent ones in any order on each device, could
  hang."""
  out = []
  for x, p in zip(xs, pairs, strict=True):
    ready = x if after is None else jax.lax.optimization_barrier((x, after))[0]
    after = jax.lax.ppermute(ready, axes, p)
    out.append(after)
  return out


# ---------------------------------------------------------------------------------------------- attention


@dataclasses.dataclass(frozen=True)
class Split:
  """How a sequence is split over devices: the mesh axes of activation_length, their total size n, and whether
  the pieces are load-balanced (device r holds chunks r and 2n-1-r of 2n)."""

  axes: tuple[str, ...]
  n: int
  balanced: bool

  def index(self, rank, piece: int) -> jax.Array:
    """[piece] int32: the indices in the whole sequence of the tokens device `rank` holds."""
    return piece_index(self.n, rank, piece, self.balanced)


def attend(q, k, v, segment_ids, positions, settings: AttentionSettings, *, mesh=None, model_mode=ct.MODEL_MODE_TRAIN):
  """Causal self-attention as `attention_kernels.attend` (same shapes, settings and result), split over the
  context-parallel axes when the sequence is (degree > 1), else that function itself. A prefill whose prompt bucket
  does not split into the pieces runs unsplit (training lengths are checked by pyconfig)."""
  config = settings.config
  n = 1 if mesh is None else degree(config, mesh)
  if n == 1 or (model_mode != ct.MODEL_MODE_TRAIN and q.shape[1] % n):
    return attention_kernels.attend(q, k, v, segment_ids, positions, settings, mesh)
  platform = attention_kernels.platform_of(mesh)
  kernel = attention_kernels.select(
    config,
    q.shape[1],
    platform,
    q_shape=q.shape,
    dtype=q.dtype,
    window=settings.window,
    cap=settings.cap,
    sinks=settings.sinks,
  )
  if kernel.startswith("cudnn") and config.attention == "autoselected":
    kernel = "flash"  # blockwise: cuDNN's kernel takes whole sequences
  if kernel.startswith("cudnn"):
    raise ConfigError(
      f"attention={config.attention} (cuDNN) does not run under context parallelism; use attention=flash "
      "or dot_product, or set ici_context_parallelism and ici_sequence_parallelism to 1"
    )
  split = Split(length_axes(config, mesh), n, reorders(config, mesh, model_mode))
  _, t, h, _ = q.shape
  if t % (2 * n if split.balanced else n):
    raise ConfigError(
      f"context parallelism over {n} devices: a length of {t} does not split into {2 * n if split.balanced else n} "
      "chunks; change max_target_length"
    )
  k, v = kv_heads_local(k, v, h, mesh, config)
  static = settings.static()
  # The window and chunk (which may be traced) and the sinks travel into shard_map as data; the sinks split with
  # the heads.
  batch_axes = sharding.logical_to_mesh_spec((ct.BATCH,), config)[0]
  head_axes = sharding.logical_to_mesh_spec((ct.ACT_HEADS,), config)[0]
  data = {"window": settings.window_array(), "chunk": settings.chunk_array(), "sinks": settings.sinks}
  data = {name: x for name, x in data.items() if x is not None}
  data_specs = {name: PartitionSpec(head_axes) if name == "sinks" else PartitionSpec() for name in data}

  def per_device(q, k, v, segment_ids, positions, data):
    if config.context_parallel_strategy == "ring":
      window, chunk, sinks = (data.get(name) for name in ("window", "chunk", "sinks"))
      return _ring(q, k, v, (segment_ids, positions), (window, chunk), sinks, split, static)
    local = dataclasses.replace(static, **data)
    return _all_gather_attention(q, k, v, segment_ids, positions, local, split, dense=kernel == "dot_product")

  qkv_spec = PartitionSpec(batch_axes, split.axes, head_axes, None)
  ids_spec = PartitionSpec(batch_axes, split.axes)
  specs = (qkv_spec, qkv_spec, qkv_spec, ids_spec, ids_spec, data_specs)
  sharded = jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=qkv_spec, check_vma=False)
  return sharded(q, k, v, segment_ids, positions, data)


def _all_gather_attention(q, k, v, segment_ids, positions, settings: AttentionSettings, split: Split, dense: bool):
  """One device's queries against the keys and values gathered from all devices, put back in index order; the
  settings' window, chunk and sinks are this device's (traced) copies, its sinks those of its heads."""
  piece, n = q.shape[1], split.n
  queries = Tokens(segment_ids, positions, split.index(jax.lax.axis_index(split.axes), piece))

  def gather(x):
    x = jax.lax.all_gather(x, split.axes, axis=1, tiled=True)
    return x[:, np.argsort(load_balanced_order(n * piece, n))] if split.balanced else x

  k, v, segment_ids, positions = (gather(x) for x in (k, v, segment_ids, positions))
  keys = Tokens(segment_ids, positions, jnp.arange(n * piece, dtype=jnp.int32))
  if dense:
    return attention_kernels.dense_attention(q, k, v, queries, keys, settings)
  return blockwise_tokens(q, k, v, queries, keys, settings)


def _ring_forward(q, k, v, ids, limits, sinks, split: Split, settings: AttentionSettings) -> Forward:
  """(out [batch, piece, heads, head_dim] float32, logsumexp) of this device's queries against every piece, the
  sinks [local heads] (or None) folded in once at the end; ids: (segment_ids, positions); limits: (window, chunk),
  each an int32 scalar or None (none)."""
  segment_ids, positions = ids
  window, chunk = limits
  axes, n = split.axes, split.n
  rank, piece = jax.lax.axis_index(axes), q.shape[1]
  queries = Tokens(segment_ids, positions, split.index(rank, piece))
  ring = [(i, (i + 1) % n) for i in range(n)]
  b, _, h, d = q.shape
  kv_heads = k.shape[2]

  def step(carry, s):
    out, lse, kv = carry
    following = tuple(_permute_in_turn(kv, axes, [ring] * 4))  # issued first: the transfer overlaps this step's compute
    k_s, v_s, seg_s, pos_s = kv
    keys = Tokens(seg_s, pos_s, split.index((rank - s) % n, piece))
    out_s, lse_s = blockwise_forward(q, k_s, v_s, Mask(queries, keys, window, chunk), settings)
    merged = jnp.logaddexp(lse, lse_s)
    out = out * by_row(jnp.exp(lse - merged), piece) + out_s * by_row(jnp.exp(lse_s - merged), piece)
    return (out, merged, following), None

  block_q = min(settings.block_q, piece)
  lse = jnp.full((b, kv_heads, h // kv_heads, -(-piece // block_q) * block_q), MASK_VALUE, jnp.float32)
  init = (jnp.zeros((b, piece, h, d), jnp.float32), lse, (k, v, segment_ids, positions))
  (out, lse, _), _ = jax.lax.scan(step, init, jnp.arange(n))
  return with_sinks(Forward(out, lse), sinks)


# The window, chunk and sinks are arguments, not static: they may be traced, and one compiled ring serves every layer.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ring(q, k, v, ids, limits, sinks, split: Split, settings: AttentionSettings):
  return _ring_forward(q, k, v, ids, limits, sinks, split, settings).out.astype(v.dtype)


def _ring_fwd(q, k, v, ids, limits, sinks, split, settings):
  forward = _ring_forward(q, k, v, ids, limits, sinks, split, settings)
  out = forward.out.astype(v.dtype)
  return out, (q, k, v, ids, limits, sinks, Forward(out, forward.lse))


def _ring_bwd(split: Split, settings: AttentionSettings, residuals, d_out):
  """The keys and values go round the ring again, with float32 accumulators of their gradients; each step adds
  FlashAttention-2's backward of this device's queries against the piece it holds (the global logsumexp, sinks
  included, makes each share exact). After n steps every piece, and its gradient, is back home. The sinks'
  gradient is this device's queries' share (shard_map sums it over the devices)."""
  q, k, v, ids, limits, sinks, forward = residuals
  (segment_ids, positions), (window, chunk) = ids, limits
  axes, n = split.axes, split.n
  rank, piece = jax.lax.axis_index(axes), q.shape[1]
  queries = Tokens(segment_ids, positions, split.index(rank, piece))
  ring = [(i, (i + 1) % n) for i in range(n)]

  def step(carry, s):
    dq, kv, dk, dv = carry
    following = tuple(_permute_in_turn(kv, axes, [ring] * 4))
    k_s, v_s, seg_s, pos_s = kv
    keys = Tokens(seg_s, pos_s, split.index((rank - s) % n, piece))
    dq_s, dk_s, dv_s = blockwise_backward(q, k_s, v_s, Mask(queries, keys, window, chunk), settings, forward, d_out)
    dk, dv = _permute_in_turn([dk + dk_s, dv + dv_s], axes, [ring] * 2, after=following[-1])
    return (dq + dq_s, following, dk, dv), None

  zeros = jnp.zeros(k.shape, jnp.float32)
  init = (jnp.zeros(q.shape, jnp.float32), (k, v, segment_ids, positions), zeros, zeros)
  (dq, _, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(n))
  d_sinks = None if sinks is None else sink_grad(forward, d_out, sinks)
  no_grad = jax.tree_util.tree_map(lambda _: None, (ids, limits))  # integers: no cotangent
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad, d_sinks


_ring.defvjp(_ring_fwd, _ring_bwd)
