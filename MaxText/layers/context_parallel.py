"""Context parallelism: attention over sequences split along their length across devices.

The mesh axes of `activation_length` in logical_axis_rules (base.yml: `sequence` and `context`) split every
activation along the sequence. Everything but attention is per token; attention runs here, under shard_map, each
device holding one piece of the queries, keys and values:

- `context_parallel_strategy=all_gather`: the keys and values are gathered from every device (backward: reduce-
  scattered), then the device's queries attend to all of them with the config's kernel (dot_product, or for flash
  splash on TPU and blockwise elsewhere).
- `ring`: keys and values travel round the ring of devices, one piece per step, and the device's queries attend to
  each piece with the flash kernel (splash on TPU, blockwise elsewhere), the partial results merged by their
  log-sum-exp (Liu et al. 2023, Ring Attention, arXiv:2310.01889). The next piece's transfer is issued before the
  step's compute, so the two overlap. Memory holds two pieces of keys and values, never the whole sequence. The
  backward sends the keys and values round again, their gradients travelling with them, and each step is
  FlashAttention-2's backward on that piece, given the merged output and log-sum-exp (which makes it exact).

How each kernel runs split is its row of kernel_capabilities: dense (`dense_scores`, dot_product) or blockwise
scores of the gathered keys; a kernel of whole sequences only (cuDNN) is refused, or replaced under `autoselected`
by its row's `context_parallel_fallback`.

Splash (TPU, or `AttentionSettings.interpret` on any platform) masks by each token's index in the whole sequence
(`attention_splash.index_mask`). all_gather builds one kernel for every device's queries, in their order along the
context axes, with `q_seq_shards=n`: shard_map hands each device its own queries' block tables, so blocks wholly in
the future are skipped as on one device. The ring's mask between a query piece and a key piece depends on the
device and the step (traced under shard_map), but only through a few relations (`_relation`: per pair of runs of
indices, none, all or an exact offset), so it runs one static kernel per relation, chosen by `lax.switch` from a
[device, step] table, and skips steps where no key is visible; its backward calls splash's backward kernels with
the merged output and log-sum-exp (`attention_splash.splash_backward`). Segment ids, windows, soft caps, chunks
(as segment ids numbered over the whole sequence) and sinks (all_gather: splash's own; ring: folded in after the
merge) all go through splash. Today's blockwise path runs instead exactly where splash cannot: pieces that are no
multiple of its 128 lanes or do not divide into its sa_block_* tiles, a traced window other than 0 and
sliding_window_size (as without context parallelism), all_gather with sinks on a splash without them, and the
ring on a jax whose splash backward this module cannot call.

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
from MaxText.kernel_capabilities import AUTOSELECTED, CAPABILITIES
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
from MaxText.layers.attention_masks import MASK_VALUE, AttentionSettings, Mask, Tokens, chunk_segment_ids, is_static
from MaxText.layers.attention_splash import (
  KernelSpec,
  index_mask,
  kernel_specs,
  kv_heads_local,
  mesh_size,
  run_splash,
  splash_backward,
  splash_backward_available,
  splash_block_sizes,
  splash_kernel,
  splash_takes_sinks,
)


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
  row = CAPABILITIES[kernel]
  if row.whole_sequences and config.attention == AUTOSELECTED:
    row = CAPABILITIES[row.context_parallel_fallback]  # e.g. cuDNN's kernel takes whole sequences: blockwise
  if row.whole_sequences:
    raise ConfigError(
      f"attention={config.attention} ({row.family}) does not run under context parallelism; use attention="
      f"{' or '.join(row.instead)}, or set ici_context_parallelism and ici_sequence_parallelism to 1"
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
  plan = None
  if not row.dense_scores and (platform == "tpu" or settings.interpret):
    shards = mesh_size(mesh, head_axes)
    plan = _splash_plan(settings, split, t // n, (h // shards, k.shape[2] // shards))
  if plan is not None and config.context_parallel_strategy == "all_gather":
    # The kernels' block tables split with the queries: each device gets those of its own piece.
    data["kernels"] = tuple(_all_gather_kernel(plan, w) for w in plan.windows)
    data_specs["kernels"] = tuple(kernel_specs(x, mesh, split.axes) for x in data["kernels"])

  def per_device(q, k, v, segment_ids, positions, data):
    if plan is not None:
      return _splash_per_device(q, k, v, (segment_ids, positions), data, plan, static)
    if config.context_parallel_strategy == "ring":
      window, chunk, sinks = (data.get(name) for name in ("window", "chunk", "sinks"))
      return _ring(q, k, v, (segment_ids, positions), (window, chunk), sinks, split, static)
    local = dataclasses.replace(static, **data)
    return _all_gather_attention(q, k, v, segment_ids, positions, local, split, dense=row.dense_scores)

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


# -------------------------------------------------------------------------------------------- splash (TPU)


@dataclasses.dataclass(frozen=True)
class SplashPlan:
  """How the splash kernels run under context parallelism (hashable: the ring's custom VJP is specialised on it).

  split: the sequence's split; piece: tokens per device; windows: the windows kernels are built for (a python
  window; for a traced one 0 and config.sliding_window_size, any other value running blockwise); chunk: a python
  chunk (0: none or traced), which bounds each kernel's window as a window of its size would; traced_window:
  whether the window is traced; spec: the kernels' heads (this device's), MQA, tiles, soft cap and interpret mode
  (its mask is filled in per kernel); strategy: as config.context_parallel_strategy."""

  split: Split
  piece: int
  windows: tuple[int, ...]
  chunk: int
  traced_window: bool
  spec: KernelSpec
  strategy: str


def _splash_plan(settings: AttentionSettings, split: Split, piece: int, heads: tuple[int, int]) -> SplashPlan | None:
  """The plan for splash under context parallelism, or None where it cannot run and today's kernels do (blockwise
  for flash): pieces that do not fit splash's 128-lane tiles (`splash_blocks` of the piece), all_gather with sinks
  on a splash that has none, the ring on a splash whose backward this module cannot call. heads: (query heads,
  kv heads) per device."""
  config = settings.config
  try:
    block_sizes = splash_block_sizes(config, piece)
  except ValueError:
    return None
  strategy = config.context_parallel_strategy
  if strategy == "all_gather" and settings.sinks is not None and not splash_takes_sinks():
    return None
  if strategy == "ring" and not splash_backward_available():
    return None
  chunk = int(settings.chunk) if is_static(settings.chunk) else 0
  traced = not is_static(settings.window)
  windows = (0, max(config.sliding_window_size, 0)) if traced else (max(int(settings.window), 0),)
  spec = KernelSpec(None, heads[0], heads[1] == 1, block_sizes, settings.cap, settings.interpret)
  return SplashPlan(split, piece, tuple(dict.fromkeys(windows)), chunk, traced, spec, strategy)


def _nearest(*bounds: int) -> int:
  """The smallest positive of python ints (0: none is)."""
  return min((x for x in bounds if x > 0), default=0)


def _piece_indices(split: Split, rank: int, piece: int) -> np.ndarray:
  """`Split.index` in NumPy, for a python rank: the kernels' masks are built before tracing."""
  if split.balanced:
    return load_balanced_order(split.n * piece, split.n)[rank * piece : (rank + 1) * piece]
  return rank * piece + np.arange(piece)


def _all_gather_kernel(plan: SplashPlan, window: int):
  """The all_gather kernel of one window: every device's queries, in their order along the context axes (the
  load-balanced one or not), against the whole sequence of keys in natural order, built with q_seq_shards = n so
  that shard_map hands each device its own queries' block tables."""
  split, length = plan.split, plan.split.n * plan.piece
  q_index = np.concatenate([_piece_indices(split, r, plan.piece) for r in range(split.n)])
  mask = index_mask(q_index, np.arange(length), _nearest(window, plan.chunk))
  return splash_kernel(dataclasses.replace(plan.spec, mask=mask, q_seq_shards=split.n))


def _splash_per_device(q, k, v, ids, data, plan: SplashPlan, static: AttentionSettings):
  """One device's splash attention under context parallelism (inside shard_map): q, k, v [batch, piece, heads or
  kv heads, head_dim] of its piece; ids: (segment_ids, positions) of its piece; data: the window, chunk, sinks
  (each if any) and, for all_gather, the kernels of plan.windows. A traced window other than those runs today's
  blockwise path (the same switch as splash without context parallelism)."""
  segment_ids, positions = ids
  split, piece = plan.split, q.shape[1]
  rank = jax.lax.axis_index(split.axes)
  window, chunk, sinks = (data.get(name) for name in ("window", "chunk", "sinks"))
  if chunk is not None:
    # Chunks go through the segment ids (attention_splash), numbered over the whole sequence so that every piece
    # agrees: the devices' ids and positions are gathered (int32, [batch, length]) and numbered in natural order.
    every_id, every_pos = (_gather(x, split, piece) for x in (segment_ids, positions))
    segment_ids = chunk_segment_ids(every_id, every_pos, chunk)[:, split.index(rank, piece)]
  if plan.strategy == "all_gather":
    branches = [
      functools.partial(_all_gather_splash, kernel, q, k, v, segment_ids, sinks, split) for kernel in data["kernels"]
    ]
  else:
    rings = [_ring_plan(plan, _nearest(w, plan.chunk)) for w in plan.windows]
    branches = [functools.partial(_splash_ring, q, k, v, segment_ids, sinks, split, ring) for ring in rings]
  if not plan.traced_window:
    return branches[0]()

  def fallback():
    if plan.strategy == "ring":
      return _ring(q, k, v, ids, (window, chunk), sinks, split, static)
    local = dataclasses.replace(static, window=window, chunk=0 if chunk is None else chunk, sinks=sinks)
    return _all_gather_attention(q, k, v, *ids, local, split, dense=False)

  index = jnp.full((), len(plan.windows), jnp.int32)
  for i, w in reversed(list(enumerate(plan.windows))):
    index = jnp.where(window == w if w > 0 else window <= 0, i, index)
  return jax.lax.switch(index, [*branches, fallback])


def _gather(x, split: Split, piece: int):
  """x [batch, piece, ...] of every device, gathered in the natural order of the sequence."""
  x = jax.lax.all_gather(x, split.axes, axis=1, tiled=True)
  return x[:, np.argsort(load_balanced_order(split.n * piece, split.n))] if split.balanced else x


def _all_gather_splash(kernel, q, k, v, segment_ids, sinks, split: Split):
  """This device's queries against the gathered keys and values by `kernel` (its own queries' block tables);
  segment_ids: this piece's (chunk ids where chunked)."""
  piece = q.shape[1]
  k, v, every_id = (_gather(x, split, piece) for x in (k, v, segment_ids))
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  return run_splash(kernel, qt, kt, vt, segment_ids, every_id, sinks).transpose(0, 2, 1, 3)


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """The ring's splash kernels: `masks`, one per distinct relation between a query piece and a key piece, and
  `table` [n][n], the relation (1 + its index in masks; 0: no key visible, the step is skipped) of device r's
  queries at ring step s (keys of device (r - s) mod n)."""

  split: Split
  spec: KernelSpec
  masks: tuple
  table: tuple[tuple[int, ...], ...]


def _relation(q_index: np.ndarray, k_index: np.ndarray, parts: int, window: int) -> tuple:
  """What decides the mask between a query piece and a key piece, each `parts` contiguous runs of indices: per pair
  of runs, "none" (no key visible), "all" (every key), or the runs' offset, which fixes the partial mask exactly."""
  c = len(q_index) // parts
  relation = []
  for a in range(parts):
    for b in range(parts):
      offset = int(q_index[a * c] - k_index[b * c])
      lo, hi = offset - (c - 1), offset + (c - 1)  # the range of q - k over the two runs
      if hi < 0 or 0 < window <= lo:
        relation.append("none")
      elif lo >= 0 and (window <= 0 or hi < window):
        relation.append("all")
      else:
        relation.append(offset)
  return tuple(relation)


@functools.lru_cache(maxsize=16)
def _ring_plan(plan: SplashPlan, window: int) -> RingPlan:
  """The ring's kernels for one window. Without a window and load-balanced there are three relations (the diagonal
  step; keys from a lower rank: the queries' first chunk sees them all, the second sees their first chunk; from a
  higher rank: only the queries' second chunk sees their first chunk... all by `_relation`), so a handful of
  kernels serve every (device, step); each mask is that of one (device, step) of its relation, exact for all."""
  split, piece = plan.split, plan.piece
  parts = 2 if split.balanced else 1
  relations: dict[tuple, int] = {}
  masks, table = [], []
  for r in range(split.n):
    row = []
    for s in range(split.n):
      q_index, k_index = _piece_indices(split, r, piece), _piece_indices(split, (r - s) % split.n, piece)
      relation = _relation(q_index, k_index, parts, window)
      if all(x == "none" for x in relation):
        row.append(0)
        continue
      if relation not in relations:
        relations[relation] = len(masks) + 1
        masks.append(index_mask(q_index, k_index, window))
      row.append(relations[relation])
    table.append(tuple(row))
  spec = dataclasses.replace(plan.spec, save_residuals=True)
  return RingPlan(split, spec, tuple(masks), tuple(table))


def _ring_kernels(plan: RingPlan):
  return [splash_kernel(dataclasses.replace(plan.spec, mask=mask)) for mask in plan.masks]


def _splash_ring_forward(q, k, v, segment_ids, sinks, plan: RingPlan) -> Forward:
  """Forward(out [batch, piece, heads, head_dim] float32, logsumexp [batch, 1, heads, piece]) of this device's
  queries against every piece by splash, merged by log-sum-exp as `_ring_forward` does, the sinks folded in at
  the end; segment_ids [batch, piece] (chunk ids where chunked) travel round with the keys."""
  split = plan.split
  axes, n = split.axes, split.n
  rank = jax.lax.axis_index(axes)
  ring = [(i, (i + 1) % n) for i in range(n)]
  qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
  b, h, piece, d = qt.shape
  kernels = _ring_kernels(plan)
  table = jnp.asarray(plan.table, jnp.int32)

  def step(carry, s):
    acc, m, total, kv = carry
    following = tuple(_permute_in_turn(kv, axes, [ring] * 3))  # issued first: the transfer overlaps this step's compute
    k_s, v_s, ids_s = kv

    def none():
      return jnp.zeros(acc.shape, jnp.float32), jnp.full(m.shape, MASK_VALUE, jnp.float32)

    def attend_by(kernel):
      out_s, lse_s = run_splash(kernel, qt, k_s, v_s, segment_ids, ids_s)
      # A query tile this step's mask gives no key tile (keys from a higher rank under load balance, a window shorter
      # than the piece) is never visited by splash: its rows come back out = 0 / 0 (NaN) and logsumexp -inf, and the
      # merge would multiply that NaN by a weight of 0. They see no key here, as `none` says.
      empty = jnp.isneginf(lse_s)
      out_s = jnp.where(empty[..., None], 0.0, out_s.astype(jnp.float32))
      return out_s, jnp.where(empty, MASK_VALUE, lse_s.astype(jnp.float32))

    branches = [none] + [functools.partial(attend_by, kernel) for kernel in kernels]
    out_s, lse_s = jax.lax.switch(table[rank, s], branches)
    # Merged as FlashAttention merges blocks, by a running maximum of the pieces' logsumexps: the largest weight is
    # exactly 1, so the merge adds less rounding than rescaling by exp(lse - logaddexp(...)) at every step.
    m_new = jnp.maximum(m, lse_s)
    old, new = jnp.exp(m - m_new), jnp.exp(lse_s - m_new)
    return (acc * old[..., None] + out_s * new[..., None], m_new, total * old + new, following), None

  zeros = jnp.zeros((b, h, piece), jnp.float32)
  init = (jnp.zeros((b, h, piece, d), jnp.float32), zeros + MASK_VALUE, zeros, (kt, vt, segment_ids))
  (acc, m, total, _), _ = jax.lax.scan(step, init, jnp.arange(n))
  out, lse = acc / total[..., None], m + jnp.log(total)
  return with_sinks(Forward(out.transpose(0, 2, 1, 3), lse[:, None]), sinks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _splash_ring(q, k, v, segment_ids, sinks, split: Split, plan: RingPlan):
  del split  # the plan's
  return _splash_ring_forward(q, k, v, segment_ids, sinks, plan).out.astype(v.dtype)


def _splash_ring_fwd(q, k, v, segment_ids, sinks, split, plan):
  del split
  forward = _splash_ring_forward(q, k, v, segment_ids, sinks, plan)
  out = forward.out.astype(v.dtype)
  return out, (q, k, v, segment_ids, sinks, Forward(out, forward.lse))


def _splash_ring_bwd(split: Split, plan: RingPlan, residuals, d_out):
  """As `_ring_bwd`, each step's share by splash's own backward kernels against the merged output and logsumexp
  (`splash_backward`), which makes it exact."""
  q, k, v, segment_ids, sinks, forward = residuals
  axes, n = split.axes, split.n
  rank = jax.lax.axis_index(axes)
  ring = [(i, (i + 1) % n) for i in range(n)]
  qt, kt, vt, out, d_out_t = (x.transpose(0, 2, 1, 3) for x in (q, k, v, forward.out, d_out))
  lse = forward.lse[:, 0]
  kernels = _ring_kernels(plan)
  table = jnp.asarray(plan.table, jnp.int32)

  def step(carry, s):
    dq, kv, dk, dv = carry
    following = tuple(_permute_in_turn(kv, axes, [ring] * 3))
    k_s, v_s, ids_s = kv

    def none():
      return tuple(jnp.zeros(x.shape, jnp.float32) for x in (qt, k_s, v_s))

    def grads_by(kernel):
      grads = splash_backward(kernel, qt, k_s, v_s, (segment_ids, ids_s), (out, lse), d_out_t)
      return tuple(g.astype(jnp.float32) for g in grads)

    branches = [none] + [functools.partial(grads_by, kernel) for kernel in kernels]
    dq_s, dk_s, dv_s = jax.lax.switch(table[rank, s], branches)
    dk, dv = _permute_in_turn([dk + dk_s, dv + dv_s], axes, [ring] * 2, after=following[-1])
    return (dq + dq_s, following, dk, dv), None

  zeros = jnp.zeros(kt.shape, jnp.float32)
  init = (jnp.zeros(qt.shape, jnp.float32), (kt, vt, segment_ids), zeros, zeros)
  (dq, _, dk, dv), _ = jax.lax.scan(step, init, jnp.arange(n))
  dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))
  d_sinks = None if sinks is None else sink_grad(forward, d_out, sinks)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, d_sinks


_splash_ring.defvjp(_splash_ring_fwd, _splash_ring_bwd)
