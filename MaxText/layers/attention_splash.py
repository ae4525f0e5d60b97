"""Splash attention: the `flash` kernel on TPU (Pallas, jax.experimental.pallas.ops.tpu.splash_attention).

Pallas is imported only when a kernel is built (`splash_block_sizes`, `splash_attention`): checking a config's
tiles (`splash_blocks`: the `flash` row's tile check in kernel_capabilities, which the config checks read too) and
importing this module never load it. Splash masks by token index: a causal or a local (sliding-window) mask, with
documents kept apart by segment ids. That equals the reference's masks by position
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
import numpy as np
from jax.sharding import PartitionSpec

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.kernel_capabilities import splash_blocks
from MaxText.layers.attention_blockwise import blockwise_attention
from MaxText.layers.attention_masks import AttentionSettings, chunk_segment_ids, is_static


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
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

  heads, length = q.shape[1], q.shape[2]
  if window > 0:
    # (window - 1, 0): q - (window - 1) <= k <= q, i.e. causal and q - k < window, in token indices.
    mask = splash_mask.LocalMask((length, length), window_size=(window - 1, 0), offset=0)
  else:
    mask = splash_mask.CausalMask((length, length))
  kernel = splash_kernel(KernelSpec(mask, heads, k.shape[1] == 1, block_sizes, settings.cap, settings.interpret))
  return run_splash(kernel, q, k, v, segment_ids, segment_ids, sinks)


def index_mask(q_index, k_index, window: int = 0):
  """A splash mask (splash_attention_mask.Mask) by each token's index in the whole sequence: query i sees key j when
  q_index[i] >= k_index[j] and, with a window > 0, q_index[i] - k_index[j] < window. Context parallelism's pieces
  are runs of the sequence (a device's queries against the gathered keys, or one ring step's key piece), so their
  indices need not start at 0 nor be contiguous."""
  return _index_mask_class()(np.asarray(q_index, np.int64), np.asarray(k_index, np.int64), int(window))


@functools.cache
def _index_mask_class():
  """`index_mask`'s class, a subclass of splash's Mask, defined on first use so that importing this module does not
  load Pallas. A block is classified from its indices' extremes first, so building a kernel's block tables stays
  fast at 128k tokens; only partial blocks are computed elementwise."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

  class IndexMask(splash_mask.Mask):
    def __init__(self, q_index: np.ndarray, k_index: np.ndarray, window: int):
      self.q_index, self.k_index, self.window = q_index, k_index, window
      self._key = (q_index.tobytes(), k_index.tobytes(), window)

    @property
    def shape(self) -> tuple[int, int]:
      return (len(self.q_index), len(self.k_index))

    def __getitem__(self, idx) -> np.ndarray:
      q, k = np.atleast_1d(self.q_index[idx[0]]), np.atleast_1d(self.k_index[idx[1]])
      lo, hi = q.min() - k.max(), q.max() - k.min()  # the range of q - k over the block
      if hi < 0 or 0 < self.window <= lo:
        return np.zeros((len(q), len(k)), np.bool_)
      if lo >= 0 and (self.window <= 0 or hi < self.window):
        return np.ones((len(q), len(k)), np.bool_)
      d = q[:, None] - k[None, :]
      return (d >= 0) & ((d < self.window) if self.window > 0 else True)

    def __eq__(self, other) -> bool:
      return isinstance(other, IndexMask) and self._key == other._key

    def __hash__(self) -> int:
      return hash(self._key)

  return IndexMask


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What a splash kernel is built from (hashable: kernels are cached by it). mask: a 2-D splash mask [q_len,
  k_len], the same for every head; mqa: one kv head (splash's MQA kernel); q_seq_shards: the kernel's queries are
  split over that many devices (its block tables then split with them, see `kernel_specs`); save_residuals: the
  forward also returns the logsumexp [heads, q_len] (context parallelism's ring merges partial results by it)."""

  mask: object
  heads: int
  mqa: bool
  block_sizes: object
  cap: float = 0.0
  interpret: bool = False
  q_seq_shards: int = 1
  save_residuals: bool = False


@functools.lru_cache(maxsize=64)
def splash_kernel(spec: KernelSpec):
  """The splash kernel of `spec`, built once per spec: the block tables of a long sequence take seconds of NumPy.
  Its tables are concrete arrays (built outside any trace), so that one kernel serves every trace."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

  make = splash.make_splash_mqa if spec.mqa else splash.make_splash_mha
  with jax.ensure_compile_time_eval():
    return make(
      splash_mask.MultiHeadMask((spec.mask,) * spec.heads),
      block_sizes=spec.block_sizes,
      attn_logits_soft_cap=spec.cap if spec.cap > 0 else None,
      head_shards=1,
      q_seq_shards=spec.q_seq_shards,
      save_residuals=spec.save_residuals,
      interpret=spec.interpret,
    )


def kernel_specs(kernel, mesh, axes):
  """shard_map's in_specs for a kernel built with q_seq_shards over the mesh `axes` (the devices' queries in their
  order along those axes): its block tables split by query block, as splash's manual_sharding_spec gives."""
  from jax.sharding import NamedSharding

  return kernel.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(None, axes)))


def run_splash(kernel, q, k, v, q_ids, kv_ids, sinks=None):
  """`kernel` over a batch: q [batch, heads, q_len, head_dim], k, v [batch, kv_heads, k_len, head_dim] (one kv head
  for an MQA kernel), segment ids q_ids [batch, q_len], kv_ids [batch, k_len]; sinks [heads] float32 or None (their
  gradient comes back float32). Returns out [batch, heads, q_len, head_dim] (with the kernel's save_residuals,
  (out, logsumexp [batch, heads, q_len]))."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  if kernel.kwargs["is_mqa"]:
    k, v = k[:, 0], v[:, 0]
  ids = splash.SegmentIds(q_ids, kv_ids)
  if sinks is None:
    out = jax.vmap(kernel)(q, k, v, ids)
  else:
    out = jax.vmap(kernel, in_axes=(0, 0, 0, 0, None))(q, k, v, ids, _gradient_in_float32(sinks))
  if kernel.kwargs["save_residuals"]:
    out, (lse,) = out
    return out, lse
  return out


# What `splash_backward` relies on in splash's private module, checked by name so that a jax whose backward changes
# shape makes the ring fall back to blockwise attention instead of binding arguments to the wrong parameters:
# `_splash_attention_bwd`'s parameters (passed by keyword), the residuals it unpacks (9: q, k, v, segment ids, sinks,
# out, logsumexp, dq and dkv mask infos), and the primal inputs of `_splash_attention_custom`, whose order is that
# of the backward's cotangents (dq, dk, dv picked by name) and whose keywords are those of the kernel's kwargs read.
_BACKWARD_PARAMETERS = (
  "save_residuals",
  "mask_value",
  "is_mqa",
  "block_sizes",
  "residual_checkpoint_name",
  "mask_function",
  "attn_logits_soft_cap",
  "interpret",
  "res",
  "do",
)
_PRIMALS = ("fwd_mask_info", "dq_mask_info", "dkv_mask_info", "q", "k", "v", "segment_ids", "sinks")
_KERNEL_KWARGS = ("mask_value", "is_mqa", "block_sizes", "mask_function", "attn_logits_soft_cap", "interpret")
_RESIDUALS = 9


def _parameters(fn) -> tuple[str, ...]:
  try:
    return tuple(inspect.signature(fn).parameters)
  except (TypeError, ValueError):
    return ()


def splash_backward_available() -> bool:
  """Whether this jax's splash exposes its backward (`_splash_attention_bwd`) in the form `splash_backward` calls
  (see _BACKWARD_PARAMETERS)."""
  import typing

  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  backward = getattr(splash, "_splash_attention_bwd", None)
  custom = _parameters(getattr(splash, "_splash_attention_custom", None))
  kernel = _parameters(getattr(splash, "SplashAttentionKernel", None))
  return (
    callable(backward)
    and _parameters(backward) == _BACKWARD_PARAMETERS
    and custom[: len(_PRIMALS)] == _PRIMALS
    and set(_KERNEL_KWARGS) <= set(custom)
    and {"dq_mask_info", "dkv_mask_info"} <= set(kernel)
    and len(typing.get_args(getattr(splash, "SplashResidualsType", None))) == _RESIDUALS
  )


def splash_backward(kernel, q, k, v, ids, forward, d_out):
  """(dq, dk, dv) of splash's backward kernels given the segment ids (q_ids, kv_ids) and the forward (out [batch,
  heads, q_len, head_dim], logsumexp [batch, heads, q_len]) of a forward over MORE keys than k, v (context
  parallelism's ring: the merged output and logsumexp of all pieces, sinks included): each block's probabilities
  exp(s - lse) and the softmax backward's rowsum(d_out * out) are then the whole softmax's, so the result is exactly
  the gradient through these keys (as FlashAttention-2's backward, attention_blockwise.blockwise_backward). Shapes
  as `run_splash`; the kernel's block tables and tiles apply. splash's public kernel cannot do this: its VJP
  differentiates its own output only, and its residual-saving form has none, so this calls the module's backward
  (`splash_backward_available`)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  kw = kernel.kwargs
  mqa = kw["is_mqa"]
  (q_ids, kv_ids), (out, lse) = ids, forward
  if mqa:
    k, v = k[:, 0], v[:, 0]

  def one(q, k, v, q_ids, kv_ids, out, lse, d_out):
    residuals = (q, k, v, splash.SegmentIds(q_ids, kv_ids), None, out, lse, kernel.dq_mask_info, kernel.dkv_mask_info)
    grads = splash._splash_attention_bwd(  # noqa: SLF001 (see the docstring)
      save_residuals=False,
      mask_value=kw["mask_value"],
      is_mqa=mqa,
      block_sizes=kw["block_sizes"],
      residual_checkpoint_name=None,
      mask_function=kw["mask_function"],
      attn_logits_soft_cap=kw["attn_logits_soft_cap"],
      interpret=kw["interpret"],
      res=residuals,
      do=d_out,
    )
    return tuple(grads[_PRIMALS.index(name)] for name in ("q", "k", "v"))

  dq, dk, dv = jax.vmap(one)(q, k, v, q_ids, kv_ids, out, lse, d_out)
  if mqa:
    dk, dv = dk[:, None], dv[:, None]
  return dq, dk, dv


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
