"""Splash attention: the `flash` kernel on TPU (Pallas, jax.experimental.pallas.ops.tpu.splash_attention).

Pallas is imported only when a kernel is built (`splash_block_sizes`, `splash_attention`): checking a config's
tiles (`splash_blocks`) and importing this module never load it. Splash masks by token index: a causal or a local
(sliding-window) mask, with documents kept apart by segment ids. That equals the reference's masks by position
because positions are contiguous within a document (see attention_kernels).

Chunked attention (Llama 4) goes through the segment ids, not splash's ChunkedCausalMask: that mask cuts chunks by
token index, which differs from the reference's chunks by position as soon as a packed document starts off a chunk
boundary. Each run of tokens sharing a document and a chunk gets its own id (`attention_masks.chunk_segment_ids`),
exact with packed documents and with a chunk traced inside the layer scan; a python chunk also bounds the local
mask (a key in the query's chunk lies less than `chunk` tokens back), so blocks beyond it are skipped. Attention
sinks (gpt-oss) are splash's own `sinks` input, with their gradient.
"""

import dataclasses
import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.layers.attention_blockwise import blockwise_attention
from MaxText.layers.attention_masks import AttentionSettings, chunk_segment_ids, is_static

# Splash's blocks are tiled on 128 lanes: the length and every block size must be multiples of it.
SPLASH_LANES = 128


def splash_blocks(config: Config, length: int) -> dict[str, int]:
  """Splash's tiles from the sa_block_* keys ({key: size}), each clipped to the length; ConfigError (a ValueError)
  if the length does not fit them. Pallas-free, so that config validation does not load it."""
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
  return blocks


def splash_block_sizes(config: Config, length: int):
  """Splash's `BlockSizes` for the length: `splash_blocks`, the fused-backward choice and the q/k/v layouts."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  blocks = splash_blocks(config, length)
  layout = {f"{axis}_layout": splash.QKVLayout[getattr(config, f"sa_{axis}_layout")] for axis in ("q", "k", "v")}
  return splash.BlockSizes(
    **{name.removeprefix("sa_"): size for name, size in blocks.items()},
    use_fused_bwd_kernel=config.sa_use_fused_bwd_kernel,
    **layout,
  )


@functools.cache
def splash_takes_sinks() -> bool:
  """Whether the installed jax's splash kernel has an attention-sinks input (jax 0.10.2's and 0.12's do)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  return "sinks" in inspect.signature(splash.attention_reference).parameters


SINKS_REFUSAL = (
  "attention=flash (splash): this jax's splash kernel has no attention sinks (gpt-oss, Attention.use_sinks); use "
  "attention=dot_product, or a jax whose splash takes sinks"
)


def _nearest(*bounds: int) -> int:
  """The smallest positive of python ints (0: none is)."""
  return min((x for x in bounds if x > 0), default=0)


def _splash_one_device(q, k, v, segment_ids, sinks, block_sizes, settings: AttentionSettings, window: int):
  """Splash on one device's shard: q [batch, heads, length, head_dim], k, v [batch, kv_heads, length, head_dim],
  segment_ids [batch, length]; sinks [heads] float32 or None; `window` a python int (the settings' cap and interpret
  apply)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

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
    attn_logits_soft_cap=settings.cap if settings.cap > 0 else None,
    head_shards=1,
    q_seq_shards=1,
    interpret=settings.interpret,
  )
  if mqa:
    k, v = k[:, 0], v[:, 0]
  ids = splash.SegmentIds(segment_ids, segment_ids)
  if sinks is None:
    return jax.vmap(kernel)(q, k, v, ids)
  return jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(q, k, v, ids, _gradient_in_float32(sinks))


@jax.custom_vjp
def _gradient_in_float32(sinks: jax.Array) -> jax.Array:
  """The float32 sinks themselves, whose gradient comes back float32: splash returns the sinks' gradient in the
  activations' dtype (bfloat16) whatever theirs, which the switch over windows refuses (its branches' gradients must
  agree), while rounding the sinks themselves to bfloat16 would change the forward pass against the other kernels."""
  return sinks


def _gradient_in_float32_fwd(sinks):
  return sinks, None


def _gradient_in_float32_bwd(_, gradient):
  return (gradient.astype(jnp.float32),)


_gradient_in_float32.defvjp(_gradient_in_float32_fwd, _gradient_in_float32_bwd)


def splash_attention(q, k, v, segment_ids, positions, settings: AttentionSettings, mesh=None) -> jax.Array:
  """Pallas splash attention (TPU; settings.interpret runs it on CPU), under shard_map when a mesh is given.

  Shapes as `attention_kernels.attend`; the tiles, layouts and sharding rules come from settings.config. Batch is
  split over the mesh axes of activation_batch, heads over those of activation_heads (kv heads too; when their
  count does not divide those axes, kv heads are repeated to one per query head). The length stays whole on each
  device. A traced window switches at run time between a causal kernel and a local one of window
  `config.sliding_window_size` (the only windows the model families use); any other value takes
  `blockwise_attention`, so the answer is never wrong. A chunk (python or traced) and the sinks apply to every
  branch; ConfigError if sinks are asked of a splash that has none.
  """
  config = settings.config
  b, t, h, d = q.shape
  block_sizes = splash_block_sizes(config, t)
  if settings.sinks is not None and not splash_takes_sinks():
    raise ConfigError(SINKS_REFUSAL)
  static = is_static(settings.window)
  local_window = int(settings.window) if static else config.sliding_window_size
  static_chunk = int(settings.chunk) if is_static(settings.chunk) else 0
  # The window, chunk (both may be traced) and sinks travel as data; the sinks split with the heads.
  data = {
    "window": jnp.asarray(0 if static else settings.window, jnp.int32),
    "chunk": settings.chunk_array(),
    "sinks": settings.sinks,
  }
  data = {name: x for name, x in data.items() if x is not None}
  settings = settings.static()

  def per_device(q, k, v, segment_ids, positions, data):
    qt, kt, vt = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    window, chunk, sinks = (data.get(name) for name in ("window", "chunk", "sinks"))
    ids = segment_ids if chunk is None else chunk_segment_ids(segment_ids, positions, chunk)

    def run(w):
      w = _nearest(w, static_chunk)
      return lambda: _splash_one_device(qt, kt, vt, ids, sinks, block_sizes, settings, w).transpose(0, 2, 1, 3)

    if static:
      return run(local_window)()

    def fallback():
      local = dataclasses.replace(settings, window=window, chunk=0 if chunk is None else chunk, sinks=sinks)
      return blockwise_attention(q, k, v, segment_ids, positions, local)

    branches = [run(0)] + ([run(local_window), fallback] if local_window > 0 else [fallback])
    index = jnp.where(window <= 0, 0, jnp.where(window == local_window, 1, len(branches) - 1))
    return jax.lax.switch(index, branches)

  if mesh is None:
    return per_device(q, k, v, segment_ids, positions, data)

  batch_axes = sharding.logical_to_mesh_spec((ct.BATCH,), config)[0]
  head_axes = sharding.logical_to_mesh_spec((ct.ACT_HEADS,), config)[0]
  for name, count, axes in (("batch", b, batch_axes), ("heads", h, head_axes)):
    if count % mesh_size(mesh, axes):
      raise ConfigError(
        f"attention=flash (splash): {name}={count} does not divide into the {mesh_size(mesh, axes)} shards of mesh "
        f"axes {axes}; change the parallelism or use attention=dot_product"
      )
  k, v = kv_heads_local(k, v, h, mesh, config)
  data_specs = {name: PartitionSpec(head_axes) if name == "sinks" else PartitionSpec() for name in data}
  qkv_spec = PartitionSpec(batch_axes, None, head_axes, None)
  ids_spec = PartitionSpec(batch_axes, None)
  sharded = jax.shard_map(
    per_device,
    mesh=mesh,
    in_specs=(qkv_spec, qkv_spec, qkv_spec, ids_spec, ids_spec, data_specs),
    out_specs=qkv_spec,
    check_vma=False,
  )
  return sharded(q, k, v, segment_ids, positions, data)


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
