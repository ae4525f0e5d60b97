"""A compiled train step: what its compilation says (memory per device against the chip's HBM, FLOPs,
collectives), and the step as a file that train.py loads instead of compiling.

train_compile.py compiles the step train.py runs (step.py) for a topology, prints `StepReport` and, with
compiled_trainstep_file=PATH, `save`s the executable; `train.py compiled_trainstep_file=PATH` `load`s it after
checking that it was compiled for the step this run would compile:
- the same device kind, device count and slice count, and the same jax / jaxlib / libtpu versions;
- the same value of every config key that can change the step (every key but those in NOT_IN_STEP: paths, logging,
  data sources, evaluation, checkpointing, decoding; the raw *_parallelism keys count through the mesh shape they
  derive, the raw `steps` through the learning-rate schedule it derives).
A mismatch is a ConfigError naming what differs.

The file is one JSON line (that fingerprint) and then the bytes of jax.experimental.serialize_executable, a
pickle: load only files you wrote.
"""

import dataclasses
import importlib.metadata
import json
import os
import re

import jax
import jaxlib.version
import numpy as np
from jax.experimental import serialize_executable

from MaxText import metrics, objectives, storage
from MaxText.common_types import Config, ConfigError
from MaxText.config_derive import OBJECTIVE_FLAGS
from MaxText.kernel_capabilities import CAPABILITIES

FORMAT = "maxtext-compiled-train-step-1"

# Keys that never change the compiled step: where output and data come from, logging, evaluation, checkpointing,
# decoding and job set-up; `hardware` is checked through the devices.
NOT_IN_STEP = frozenset({
  "run_name", "base_output_directory", "hardware", "jax_cache_dir", "steps", "log_period", "metrics_file", "gcs_metrics",
  "enable_tensorboard", "profiler", "skip_first_n_steps_for_profiler", "profiler_steps", "cpu_peak_tflops",
  "log_config", "model_name", "override_model_config", "reward_timeout_seconds", "stream_interval_ms",
  "server_max_prompt_chars", "server_read_timeout",
  "dataset_type", "data_shuffle_seed", "num_epoch", "tokenizer_path", "tokenizer_type", "add_bos", "add_eos",
  "grain_train_files", "grain_eval_files", "grain_worker_count", "dataset_path", "dataset_name", "eval_dataset_name",
  "train_split", "eval_split", "hf_path", "hf_data_dir", "hf_train_files", "hf_eval_files", "train_data_columns",
  "eval_data_columns", "packing", "sft_train_on_completion_only", "use_chat_template", "chat_template",
  "chat_template_path", "hf_lora_adapter_path", "hf_lora_export",
  "eval_interval", "eval_steps", "eval_per_device_batch_size", "eval_batch_size", "reuse_example_batch",
  "enable_checkpointing", "async_checkpointing", "checkpoint_period", "max_num_checkpoints_to_keep",
  "load_parameters_path", "load_full_state_path",
  "server_host", "server_port", "server_api_key", "server_max_queue", "served_model_name",
  "pagedattn_tokens_per_page", "pagedattn_num_pages", "use_chunked_prefill", "prefill_chunk_size",
  "enable_prefix_caching", "decode_steps_per_dispatch",
  "num_generations", "reward_functions", "reward_weights", "reward_format_regex",
  "prompt", "decode_prompts_file", "max_prefill_predict_length", "decode_sampling_strategy",
  "decode_sampling_temperature", "decode_sampling_top_k", "decode_sampling_nucleus_p", "decode_sampling_seed",
  "autoregressive_decode_assert", "force_unroll", "inference_microbenchmark_prefill_lengths",
  "inference_microbenchmark_batch_sizes", "inference_microbenchmark_stages", "inference_microbenchmark_loop_iters",
  "inference_microbenchmark_log_file_path", "memory_bandwidth_gbps", "hf_model_path", "hf_max_shard_size_mb",
  "compile_topology", "compile_topology_num_slices", "compiled_trainstep_file",
  "jax_coordinator_address", "jax_process_count", "jax_process_id", "jax_distributed_initialization_timeout",
  "jax_distributed_heartbeat_timeout_seconds", "skip_jax_distributed_system",
  "objective", *OBJECTIVE_FLAGS,  # the fingerprint's own "objective": the step's, which another's may be (SFT: lm's)
})  # fmt: skip
_RAW_PARALLELISM = re.compile(r"^(ici|dcn)_[a-z]+_parallelism$")
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")
GiB = 2**30


# ---------------------------------------------------------------------------------------------- the report
@dataclasses.dataclass(frozen=True)
class StepReport:
  """What the compiler says about one train step, per device (bytes, FLOPs)."""

  target: str  # e.g. "v5e-256 (256 x TPU v5 lite, 1 slice)"
  chip: str  # the name in the one-line verdict, e.g. "v5e"
  arguments: int  # the state and the batch shard
  outputs: int  # the new state and the metrics
  aliased: int  # outputs written over donated arguments (the state), counted once
  temporaries: int
  generated_code: int
  host_temporaries: int  # activations offloaded to host memory (remat_policy=*_offloaded)
  peak: int  # the most live at once by XLA's heap simulation, host memory included (0 when not reported)
  hbm: int | None  # what the device may use; None when unknown (a CPU)
  flops: float | None  # XLA's count; Pallas kernels (splash attention) count as zero
  model_flops: float  # metrics.training_flops_per_device: no rematerialisation
  collectives: dict[str, int]  # op -> instructions in the optimized HLO
  compile_seconds: float

  @property
  def total(self) -> int:
    """The sum of the allocations. On TPU the temporaries' allocation is larger than what is live at its peak."""
    return self.arguments + self.outputs - self.aliased + self.temporaries + self.generated_code

  @property
  def needed(self) -> int | None:
    """What the device must hold: the peak, which XLA's TPU compiler checks against HBM (the allocated total is
    larger: on TPU the temporaries' allocation exceeds what is live at once). None when the peak also counts
    activations offloaded to host memory: HBM's share is not reported, and the compile passing is the check."""
    if self.host_temporaries:
      return None
    return self.peak or self.total

  @property
  def fits(self) -> bool:
    return self.hbm is None or self.needed is None or self.needed <= self.hbm

  def lines(self) -> list[str]:
    def gib(n):  # MiB below a tenth of a GiB, so a small model's step does not read as zero
      return f"{n / GiB:8.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:8.2f} MiB"

    def flop(n):
      return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"

    hbm = "no fixed limit (host memory)" if self.hbm is None else f"{self.hbm / GiB:.2f} GiB HBM"
    flops = "n/a" if self.flops is None else flop(self.flops)
    counts = ", ".join(f"{op} {n}" for op, n in self.collectives.items())
    out = [
      f"Compiled the train step for {self.target} in {self.compile_seconds:.1f} s.",
      "Memory per device:",
      f"  arguments        {gib(self.arguments)}  (state and batch)",
      f"  outputs          {gib(self.outputs)}",
      f"  aliased          {gib(self.aliased)}  (outputs written over the donated state, counted once)",
      f"  temporaries      {gib(self.temporaries)}",
      f"  generated code   {gib(self.generated_code)}",
      f"  total            {gib(self.total)}  (arguments + outputs - aliased + temporaries + code)",
    ]
    if self.host_temporaries:
      out.append(f"  host temporaries {gib(self.host_temporaries)}  (offloaded activations, in host memory)")
    if self.peak:
      out.append(f"  peak             {gib(self.peak)}  (live at once, by XLA's heap simulation)")
    verdict = "fits" if self.fits else "DOES NOT FIT"
    if self.needed is None:
      out.append(f"  {hbm}: {verdict} (XLA checked it when compiling; the peak above counts host memory too)")
    else:
      out.append(f"  needed           {gib(self.needed)}  of {hbm}: {verdict}")
    out += [
      f"FLOPs per device per step: {flops} by XLA (the scanned layers' loop body counted once, Pallas kernels as 0), "
      f"{flop(self.model_flops)} model FLOPs (no rematerialisation)",
      f"Collectives in the optimized HLO (instructions: one in the layer loop counts once): {counts}",
    ]
    return out

  def does_not_fit(self, config: Config) -> str:
    return does_not_fit_line(self.needed, self.hbm, self.chip, config)


def report(  # noqa: PLR0913 (the step's, then where and how long, then its model FLOPs)
  compiled: jax.stages.Compiled,
  config: Config,
  mesh,
  target: str,
  chip: str,
  seconds: float,
  model_flops: float | None = None,
) -> StepReport:
  """The StepReport of a compiled step; model_flops: its objective's (by default one training pass, as
  metrics.training_flops_per_device counts it)."""
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  cost = cost[0] if isinstance(cost, list) else cost  # A list of one dict on some jax versions.
  return StepReport(
    target=target,
    chip=chip,
    arguments=memory.argument_size_in_bytes,
    outputs=memory.output_size_in_bytes,
    aliased=memory.alias_size_in_bytes,
    temporaries=memory.temp_size_in_bytes,
    generated_code=memory.generated_code_size_in_bytes,
    host_temporaries=memory.host_temp_size_in_bytes,
    peak=getattr(memory, "peak_memory_in_bytes", 0),
    hbm=metrics.device_memory_bytes(mesh.devices.flat[0]),
    flops=cost.get("flops"),
    model_flops=metrics.training_flops_per_device(config).total if model_flops is None else model_flops,
    collectives=count_collectives(compiled.as_text()),
    compile_seconds=seconds,
  )


def count_collectives(hlo_text: str) -> dict[str, int]:
  """Instructions of each collective op in HLO text, synchronous (`all-gather(`) or asynchronous (`-start(`)."""
  return {op: len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text)) for op in COLLECTIVES}


def does_not_fit_line(used: float | None, hbm: float | None, chip: str, config: Config) -> str:
  """The one line train_compile.py exits with when the step needs more memory than a device has (None: unknown)."""
  hbm_text = "its HBM" if hbm is None else f"{hbm / GiB:.2f} GiB HBM"
  needed = "more than" if used is None else f"{used / GiB:.2f} GiB per chip >"
  return f"does not fit: {needed} {hbm_text} of {chip}; try {_tries(config, step=True, more='a larger topology')}"


def _tries(config: Config, step: bool, more: str) -> str:
  """What lowers the memory per device: of the step (activations too) or of the state alone."""
  tries = []
  if step and config.per_device_batch_size > 1:
    tries.append("a smaller per_device_batch_size")
  kernel = CAPABILITIES.get(config.attention)  # None for autoselected, which picks a kernel per call
  if step and kernel is not None and kernel.dense_scores:
    tries.append(f"attention={kernel.instead[0]}")
  if step and config.remat_policy != "full":
    tries.append("remat_policy=full")
  if config.ici_mesh_shape[config.mesh_axes.index("fsdp")] < config.num_devices // config.num_slices:
    tries.append("more fsdp (ici_fsdp_parallelism)")
  tries.append(more)
  return f"{', '.join(tries[:-1])} or {tries[-1]}" if len(tries) > 1 else tries[0]


# ---------------------------------------------------------------------------------------------- before a run
def host_memory_bytes() -> int:
  """This host's RAM, or the memory limit of its cgroup (a container; cgroup v2 or v1) when that is lower."""
  total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(limit_file, encoding="ascii") as f:
        limit = f.read().strip()
    except OSError:
      continue
    if limit.isdigit():
      return min(total, int(limit))
  return total


def _memory_of(mesh) -> tuple[int, int, str]:
  """(bytes, devices sharing them, what they are) for this process's devices of `mesh`: each accelerator has its
  own memory; CPU devices all live in the host's RAM."""
  local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  limit = metrics.device_memory_bytes(local[0])
  if limit is not None:
    return limit, 1, f"the {limit / GiB:.2f} GiB of one {local[0].device_kind}"
  return host_memory_bytes(), len(local), f"this host's {host_memory_bytes() / GiB:.2f} GiB of RAM"


def check_fits(what: str, per_device: int, config: Config, mesh, step: bool) -> None:
  """Raises ConfigError, with the figures, when `what` needs more than this process's devices have; run before
  anything is allocated (the state) or written (the compiled step)."""
  limit, sharing, where = _memory_of(mesh)
  if per_device * sharing <= limit:
    return
  need = f"{per_device / GiB:.2f} GiB per device"
  if sharing > 1:
    need += f" ({per_device * sharing / GiB:.2f} GiB for the {sharing} devices of this host)"
  more = "a smaller model" if not step else "more or larger devices"
  raise ConfigError(f"{what} needs {need}, more than {where}; try {_tries(config, step, more)}")


def state_bytes_per_device(abstract_state) -> int:
  """Bytes of one device's shards of a state given as ShapeDtypeStructs with shardings (the largest shard)."""
  total = 0
  for leaf in jax.tree_util.tree_leaves(abstract_state):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
  return total


def step_bytes_per_device(compiled: jax.stages.Compiled, platform: str) -> int | None:
  """What a device holds while the compiled step runs: the sum of its allocations (arguments + outputs - aliased +
  temporaries + code) on CPU, which allocates the temporaries as one buffer (the peak it reports can be a
  fraction of them); elsewhere XLA's peak if it reports one (TPU's temporaries allocation exceeds what is live at
  once), else that sum. None when XLA reports nothing."""
  memory = compiled.memory_analysis()
  if memory is None:
    return None
  total = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    - memory.alias_size_in_bytes
    + memory.temp_size_in_bytes
    + memory.generated_code_size_in_bytes
  )
  return total if platform == "cpu" else getattr(memory, "peak_memory_in_bytes", 0) or total


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# XLA's two messages: "Used 15.88G of 15.75G hbm" and "HLO temporaries (160.00G) exceeds available HBM (15.75G)".
_OOM_FORMS = (
  re.compile(r"Used ([\d.]+)([KMGT]?)B? of ([\d.]+)([KMGT]?)B? hbm"),
  re.compile(r"\(([\d.]+)([KMGT]?)B?\) exceeds available HBM \(([\d.]+)([KMGT]?)B?\)"),
)


def out_of_memory(error: Exception) -> tuple[float | None, float | None] | None:
  """(bytes needed, bytes available) per device when `error` is XLA running out of HBM while compiling (None for
  a figure it did not give), else None."""
  text = str(error)
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  for form in _OOM_FORMS:
    found = form.search(text)
    if found:
      used, used_unit, limit, limit_unit = found.groups()
      return float(used) * _UNITS[used_unit], float(limit) * _UNITS[limit_unit]
  return None, None


# ---------------------------------------------------------------------------------------------- the file
def fingerprint(config: Config, mesh) -> dict:
  """What a compiled step must share with the run that loads it (see the module docstring)."""
  device = mesh.devices.flat[0]
  versions = {"jax": jax.__version__, "jaxlib": jaxlib.version.__version__}
  if device.platform == "tpu":
    try:
      versions["libtpu"] = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:  # A TPU VM's own libtpu, outside pip.
      pass
  keys = {
    key: value for key, value in config.as_dict().items() if key not in NOT_IN_STEP and not _RAW_PARALLELISM.match(key)
  }
  objective = objectives.get(config)
  return {
    "format": FORMAT,
    "objective": objective.same_step_as or objective.name,
    "devices": {"platform": device.platform, "kind": device.device_kind, "count": mesh.devices.size},
    "num_slices": config.num_slices,
    "versions": versions,
    "config": json.loads(json.dumps(keys)),  # As it comes back from the file (e.g. no tuples).
  }


def save(path: str, compiled: jax.stages.Compiled, config: Config, mesh) -> None:
  """Writes the executable and its fingerprint to `path` (whole or not at all)."""
  serialized, _, _ = serialize_executable.serialize(compiled)
  storage.write_bytes(path, json.dumps(fingerprint(config, mesh), sort_keys=True).encode() + b"\n" + serialized)


def load(path: str, config: Config, mesh, lowered: jax.stages.Lowered) -> jax.stages.Compiled:
  """The executable in `path`, for the step `lowered` (this run's own), after checking its fingerprint."""
  key = f"compiled_trainstep_file={path}"
  if not storage.isfile(path):
    raise ConfigError(f"{key}: no such file; write it with train_compile.py and the same keys, or unset it")
  header, _, serialized = storage.read_bytes(path).partition(b"\n")
  try:
    stored = json.loads(header)
  except ValueError:
    stored = None
  if not isinstance(stored, dict) or stored.get("format") != FORMAT:
    raise ConfigError(f"{key} is not a train step written by train_compile.py; write it again with train_compile.py")
  mismatch = _mismatch(stored, fingerprint(config, mesh))
  if mismatch:
    raise ConfigError(f"{key} was compiled for another step: {mismatch}; compile it again for this run, or unset it")
  return serialize_executable.deserialize_and_load(
    serialized, lowered.in_tree, lowered.out_tree, execution_devices=list(mesh.devices.flat)
  )


def _mismatch(stored: dict, here: dict) -> str:
  """What differs between the file's fingerprint and this run's, in words ("" when nothing)."""
  if stored["devices"] != here["devices"] or stored["num_slices"] != here["num_slices"]:
    return f"it is for {_devices(stored)}, this run has {_devices(here)}"
  if stored["versions"] != here["versions"]:
    return f"it was compiled by {_versions(stored)}, this run has {_versions(here)}"
  if stored.get("objective") != here["objective"]:
    there = stored.get("objective", "(none: an older file)")
    return f"it is the train step of objective={there}, this run's is objective={here['objective']}'s"
  there, ours = stored["config"], here["config"]
  differ = [k for k in sorted(set(there) | set(ours)) if there.get(k, "(none)") != ours.get(k, "(none)")]
  shown = "; ".join(f"{k}={there.get(k, '(none)')} there, {ours.get(k, '(none)')} here" for k in differ[:4])
  return shown + (f"; and {len(differ) - 4} more keys" if len(differ) > 4 else "")


def _devices(fp: dict) -> str:
  d = fp["devices"]
  return f"{d['count']} x {d['kind']} ({d['platform']}) in {fp['num_slices']} slice(s)"


def _versions(fp: dict) -> str:
  return ", ".join(f"{name} {version}" for name, version in sorted(fp["versions"].items()))
