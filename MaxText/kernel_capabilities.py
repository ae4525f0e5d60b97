"""What each attention kernel can do: one row per value of the `attention` config key, read by everything that
decides by kernel.

The config checks (config_validate: platform, features, tiles, context parallelism), the choice and dispatch
(layers/attention_kernels.py: `select`, `attend`), context parallelism (layers/context_parallel.py: whole
sequences or split, dense or blockwise scores) and the memory hint of compiled_step.py read the rows here; none
of them matches a kernel's name. Adding a kernel is its module under layers/ (with its function in
attention_kernels' dispatch, keyed by the same name) plus its row in `CAPABILITIES`.

This module is at the top of the package, not in layers/, and imports neither jax nor flax: the config layer reads
it while parsing a YAML file, before any device work and without importing the layers. So everything here is plain
Python: a row is data, and what only traced arrays tell (a traced window, the inputs' dtype, the GPU's compute
capability) reaches `KernelCapabilities.refusal` as plain values in a `Call`.
"""

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from MaxText.common_types import ConfigError

# The value of the `attention` key that lets `attention_kernels.select` pick a kernel per call.
AUTOSELECTED = "autoselected"

# The platforms a row names; JAX also calls a CUDA GPU "cuda" (canonical() maps it).
PLATFORMS = ("cpu", "gpu", "tpu")

# Below this length `autoselected` picks dot_product on CPU and GPU: its [length, length] scores are small and one
# fused einsum beats a loop over blocks (TPU takes splash whenever the length fits its blocks).
SHORT_SEQUENCE = 1024

# Splash's blocks are tiled on 128 lanes: the length and every block size must be multiples of it.
SPLASH_LANES = 128


def canonical(platform: str) -> str:
  """A JAX platform name as the rows name it ("cuda" -> "gpu")."""
  return "gpu" if platform == "cuda" else platform


def splash_blocks(config: Any, length: int) -> dict[str, int]:
  """Splash's tiles from the sa_block_* keys of a Config ({key: size}), each clipped to the length; ConfigError (a
  ValueError) if the length does not fit them. The `flash` row's tile check on TPU; Pallas-free, like this module."""
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


@dataclasses.dataclass(frozen=True)
class Call:
  """What a kernel is asked to do: known from the config before any device work, or from the traced arrays.

  length: the sequence length; head_dim: the width each head gives the kernel; dtype: the inputs' dtype by name
  ("bfloat16"); cap: the logit soft cap (0: none); sinks: attention sinks (gpt-oss); windowed: a sliding window
  (Mistral, Gemma 2); traced_window: one chosen per layer at run time (Gemma 2 under the layer scan); chunked:
  chunked attention (Llama 4);
  compute_capability: the GPU's (major, minor), None where unknown (config time, other platforms).
  """

  length: int
  head_dim: int
  dtype: str
  cap: float = 0.0
  sinks: bool = False
  windowed: bool = False
  traced_window: bool = False
  chunked: bool = False
  compute_capability: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class KernelCapabilities:
  """One attention kernel's capabilities (a row of CAPABILITIES).

  name: the value of the `attention` key; runs: the function that runs it, by its import path "module:function",
  called as f(q, k, v, segment_ids, positions, settings, mesh); title: what the kernel is, in errors ("cuDNN fused
  attention"); family: its short name in errors ("cuDNN"); platforms: where it runs (PLATFORMS), and `where` says so
  in words for errors; instead: the kernels to use where it cannot run a config, best first.
  whole_sequences: it takes whole sequences only, so it does not run under context parallelism, where `autoselected`
  runs `context_parallel_fallback` instead (an explicit choice is refused). A kernel that runs split is run by
  context parallelism on its all-gathered keys and values, dense or blockwise as `dense_scores` says.
  dense_scores: the [length, length] scores exist whole, so memory grows with the square of the length (the
  memory hint of compiled_step suggests instead[0]); otherwise an online softmax over key blocks or a fused kernel.
  sinks, soft_cap, windows, traced_windows, chunks: whether it takes attention sinks (gpt-oss), a logit soft cap
  (Gemma 2), a sliding window (Mistral), one traced per layer (Gemma 2 scanned), chunked attention (Llama 4).
  dtypes: the input dtypes it takes (empty: any); head_dim_multiple, max_head_dim: limits on head_dim (0: none),
  max_head_dim_before: (compute capability, bound) where older GPUs take less; even_length: packed documents need
  an even length. tiles: platform -> a check of the config's tiles for a length (raises ConfigError, names the fix).
  """

  name: str
  runs: str
  title: str
  family: str
  platforms: tuple[str, ...] = PLATFORMS
  where: str = "any platform"
  instead: tuple[str, ...] = ()
  whole_sequences: bool = False
  context_parallel_fallback: str = ""
  dense_scores: bool = False
  sinks: bool = True
  soft_cap: bool = True
  windows: bool = True
  traced_windows: bool = True
  chunks: bool = True
  dtypes: tuple[str, ...] = ()
  head_dim_multiple: int = 1
  max_head_dim: int = 0
  max_head_dim_before: tuple[tuple[int, int], int] | None = None
  even_length: bool = False
  tiles: Mapping[str, Callable[[Any, int], Any]] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

  def runs_on(self, platform: str) -> bool:
    return canonical(platform) in self.platforms

  def head_dim_bound(self, compute_capability: tuple[int, int] | None) -> int:
    """max_head_dim on a GPU of that compute capability (None: unknown, the largest any GPU takes)."""
    if self.max_head_dim_before and compute_capability is not None and compute_capability < self.max_head_dim_before[0]:
      return self.max_head_dim_before[1]
    return self.max_head_dim

  def refusal(self, call: Call) -> str | None:
    """What the kernel cannot do of the call, in a phrase; None when it can. The platform is not checked here."""
    return self._feature_refusal(call) or self._shape_refusal(call)

  def _feature_refusal(self, call: Call) -> str | None:
    if call.sinks and not self.sinks:
      return f"{self.title} has no attention sinks (gpt-oss's learned sink logit per head)"
    if call.cap > 0 and not self.soft_cap:
      return f"{self.title} has no logit soft cap (attn_logits_soft_cap={call.cap}, Gemma 2)"
    if (call.windowed or call.traced_window) and not self.windows:
      return f"{self.title} has no sliding window (sliding_window_size, Mistral)"
    if call.traced_window and not self.traced_windows:
      return f"{self.title} takes a fixed sliding window, not one chosen per layer at run time (Gemma 2)"
    if call.chunked and not self.chunks:
      return f"{self.title} has no chunked attention (chunk_attn_window_size, Llama 4)"
    return None

  def _shape_refusal(self, call: Call) -> str | None:
    if self.dtypes and call.dtype not in self.dtypes:
      return f"{self.title} needs {' or '.join(self.dtypes)} inputs, not {call.dtype} (set dtype={self.dtypes[0]})"
    bound = self.head_dim_bound(call.compute_capability)
    if (bound and call.head_dim > bound) or call.head_dim % self.head_dim_multiple:
      limits = [f"a multiple of {self.head_dim_multiple}"] if self.head_dim_multiple > 1 else []
      limits += [f"at most {bound}"] if bound else []
      return f"{self.title} needs head_dim {' and '.join(limits)}, not {call.head_dim}"
    if self.even_length and call.length % 2:
      return f"{self.title} with packed documents needs an even length, not {call.length}"
    return None

  def refused(self, reason: str) -> ConfigError:
    """The one-line error for a refusal: the kernel, the reason, the kernels to use instead."""
    return ConfigError(f"attention={self.name}: {reason}; use {' or '.join(f'attention={k}' for k in self.instead)}")


_CUDNN = KernelCapabilities(
  name="cudnn_flash_jax",
  runs="MaxText.layers.attention_kernels:run_cudnn",
  title="cuDNN fused attention",
  family="cuDNN",
  platforms=("gpu",),
  where="NVIDIA GPUs",
  instead=("flash", "dot_product"),
  whole_sequences=True,  # public JAX's call has no offsets for a piece of a sequence
  context_parallel_fallback="flash",
  sinks=False,
  soft_cap=False,
  traced_windows=False,
  dtypes=("bfloat16", "float16"),
  head_dim_multiple=8,
  max_head_dim=256,
  max_head_dim_before=((9, 0), 128),  # cuDNN's flash kernels take 256 from Hopper (compute capability 9.0) on
  even_length=True,  # the document mask travels as a bias, which cuDNN's backward takes only for even lengths
)

# One row per kernel; the `attention` key takes these names and AUTOSELECTED.
CAPABILITIES: Mapping[str, KernelCapabilities] = MappingProxyType(
  {
    row.name: row
    for row in (
      KernelCapabilities(
        name="dot_product",
        runs="MaxText.layers.attention_kernels:run_dot_product",
        title="XLA dot-product attention",
        family="XLA",
        instead=("flash",),
        dense_scores=True,
      ),
      KernelCapabilities(
        name="flash",
        runs="MaxText.layers.attention_kernels:run_flash",
        title="flash attention",
        family="splash on TPU, blockwise elsewhere",
        instead=("dot_product",),
        tiles=MappingProxyType({"tpu": splash_blocks}),
      ),
      _CUDNN,
      dataclasses.replace(_CUDNN, name="cudnn_flash_te"),  # the same kernel: Transformer Engine is not a dependency
    )
  }
)

# The values of the `attention` config key, MaxText's names.
CHOICES = (AUTOSELECTED, *CAPABILITIES)

# What `autoselected` means on each platform: the first (kernel, length bound) whose bound exceeds the length (None:
# any length) and whose kernel runs the call (its row's refusal, its tiles, what the installed jax has).
AUTOSELECT: Mapping[str, tuple[tuple[str, int | None], ...]] = MappingProxyType(
  {
    "tpu": (("flash", None), ("dot_product", None)),
    # Blockwise where cuDNN cannot: memory stays linear.
    "gpu": (("dot_product", SHORT_SEQUENCE), ("cudnn_flash_jax", None), ("flash", None)),
    "cpu": (("dot_product", SHORT_SEQUENCE), ("flash", None)),
  }
)
