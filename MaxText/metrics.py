"""Model FLOPs, device peaks and MFU, step timing, the profiler window, and the metric writers (TensorBoard,
JSON lines)."""

import contextlib
import dataclasses
import json
import math
import resource
import statistics
import sys
import time

import jax

from MaxText import storage
from MaxText.common_types import Config
from MaxText.layers import decoders
from MaxText.sections import profiler as section


@dataclasses.dataclass(frozen=True)
class DevicePeak:
  """A device's data-sheet peaks: dense bf16 TFLOP/s (for MFU) and memory bandwidth (for decoding's roofline)."""

  name: str  # matched as a substring of jax's device_kind, ignoring case
  bf16_tflops: float
  memory_gbps: float | None  # GB/s of one device's HBM; None where the name covers parts that differ
  hbm_gib: float | None = None  # HBM of one device that XLA may use, as libtpu's compiler reports it (TPUs)


# Per device (per chip for TPUs), from the vendors' data sheets; most specific names first. hbm_gib is what
# libtpu 0.0.42.1's compiler says is available when a program does not fit ("exceeds available HBM (15.75G)"):
# a little under the data sheets' 32 / 16 / 95 / 32 GiB (train_compile.py checks a step against it).
DEVICE_PEAKS = (
  DevicePeak("TPU v4", 275.0, 1228.0, hbm_gib=30.75),
  DevicePeak("TPU v5 lite", 197.0, 819.0, hbm_gib=15.75),
  DevicePeak("TPU v5e", 197.0, 819.0, hbm_gib=15.75),
  DevicePeak("TPU v5p", 459.0, 2765.0, hbm_gib=95.74),
  DevicePeak("TPU v5", 459.0, 2765.0, hbm_gib=95.74),  # v5p reports device_kind "TPU v5"
  DevicePeak("TPU v6 lite", 918.0, 1640.0, hbm_gib=31.25),
  DevicePeak("TPU v6e", 918.0, 1640.0, hbm_gib=31.25),
  DevicePeak("A100-SXM4-80GB", 312.0, 2039.0),
  DevicePeak("A100-SXM4-40GB", 312.0, 1555.0),
  DevicePeak("A100", 312.0, None),
  DevicePeak("H100 PCIe", 756.0, 2000.0),
  DevicePeak("H100", 989.0, 3350.0),  # SXM, HBM3 (device_kind "NVIDIA H100 80GB HBM3")
  DevicePeak("H200", 989.0, 4800.0),
  DevicePeak("B200", 2250.0, 8000.0),
)


def device_peak(device_kind: str) -> DevicePeak | None:
  """The DEVICE_PEAKS row of a device kind, or None when unknown (e.g. a CPU)."""
  return next((row for row in DEVICE_PEAKS if row.name.lower() in device_kind.lower()), None)


def peak_tflops(device_kind: str, cpu_peak_tflops: float = 0.0) -> float | None:
  """Peak dense bf16 TFLOP/s of a device kind, or None when unknown (CPU unless cpu_peak_tflops is set)."""
  row = device_peak(device_kind)
  if row is not None:
    return row.bf16_tflops
  if device_kind.lower() == "cpu" and cpu_peak_tflops > 0:
    return cpu_peak_tflops
  return None


def peak_bandwidth_gbps(device_kind: str, memory_bandwidth_gbps: float = 0.0) -> float | None:
  """GB/s of one device: memory_bandwidth_gbps if set, else DEVICE_PEAKS, else None (unknown, e.g. a CPU)."""
  if memory_bandwidth_gbps > 0:
    return memory_bandwidth_gbps
  row = device_peak(device_kind)
  return None if row is None else row.memory_gbps


def device_memory_bytes(device: jax.Device) -> int | None:
  """Bytes a program may use on `device`: what its backend reports (GPUs, TPUs attached here), else the HBM of
  DEVICE_PEAKS (a topology's compile-only TPU devices report nothing), else None (a CPU: no fixed limit)."""
  try:
    stats = device.memory_stats() or {}
  except jax.errors.JaxRuntimeError:  # A topology's compile-only devices raise instead of returning None.
    stats = {}
  if "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  row = device_peak(device.device_kind)
  return None if row is None or row.hbm_gib is None else int(row.hbm_gib * 2**30)


@dataclasses.dataclass(frozen=True)
class TrainingFlops:
  """Model FLOPs of one training step on one device (forward + backward = 3x forward)."""

  weights: float  # matmuls against learned weights (attention projections, MLP, output projection)
  attention: float  # q.k^T and weights.v over the (query, key) pairs the layers' masks allow
  total: float

  def scaled(self, factor: float) -> "TrainingFlops":
    """These FLOPs `factor` times (a training objective's passes: objectives.base.Objective.flops)."""
    return TrainingFlops(self.weights * factor, self.attention * factor, self.total * factor)


def training_flops_per_device(config: Config) -> TrainingFlops:
  """Analytic model FLOPs per device per step, MaxText's `calculate_tflops_training_per_device`.

  A matmul [m, k] x [k, n] costs 2mkn. Each layer stack's decoder layer class gives its own costs (layers/llama.py's
  hooks, which a family's layer overrides where it computes something else, e.g. MLA in layers/deepseek.py): its
  attention's projections and MLP per token (a mixture of experts: the router and the active experts only), the
  FLOPs per (query, key) pair its attention computes (4*H*D for grouped-query attention: q.k and the weighted v),
  and the pairs each of its layers attends in a sequence of max_target_length, which its masks decide: causal,
  within a sliding window, within a chunk, with the diagonal counted half as MaxText counts causal attention
  (llama.causal_pairs; L^2/2 pairs for a full causal mask). The output projection costs 2*E*V per token once.
  Training is 3x the forward pass (Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1). Rematerialisation is not
  counted: these are model FLOPs, so MFU is comparable across remat policies. These are one training pass over
  each row's tokens: an objective that does more (DPO's two sequences per row, a reference model's forward pass)
  scales them (objectives.base.Objective.flops). LoRA (lora_rank > 0) computes no gradient of the frozen weights:
  their matmuls count 2x the forward pass (the adapters' own, rank-thin, are left out).
  """
  tokens = config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps
  length = config.max_target_length
  per_token, per_sequence = 2 * config.emb_dim * config.vocab_size, 0.0  # weight FLOPs per token, attention's
  for stack in decoders.layer_stacks(config):
    attention = stack.layer.attention_flops(config)
    per_token += (attention.projections + stack.layer.mlp_flops(config)) * stack.count
    for index in range(stack.start, stack.start + stack.count):
      per_sequence += attention.per_pair * stack.layer.attention_pairs(config, index, length)
  passes = 2 if config.lora_rank > 0 else 3  # forward and backward (activations, and weights unless frozen)
  weights = passes * tokens * per_token
  attention = 3 * tokens / length * per_sequence
  return TrainingFlops(weights=weights, attention=attention, total=weights + attention)


def count_params(params) -> int:
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def peak_memory_bytes() -> tuple[int, str]:
  """Peak memory of device 0 if the backend reports it, else the process's peak RSS."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"


class StepClock:
  """Seconds per step between logged steps, and the throughput figures of one device derived from them.

  The first lap, the run's first step, also gives the time to first step: from `started` (when train.main or
  train.train was called; Python's and JAX's own import time is not the run's), so start-up, restore and
  compilation are included; the steps after it are the step times.
  """

  def __init__(  # noqa: PLR0913 (the run's four, then what the objective says of its work)
    self,
    config: Config,
    device_kind: str,
    first_step: int,
    started: float,
    *,
    flops: TrainingFlops | None = None,
    sequences_per_row: int = 1,
  ):
    """flops: the step's (the objective's; by default training_flops_per_device's). sequences_per_row: the
    sequences of a batch row whose tokens count (DPO's rows hold a chosen and a rejected one)."""
    self.flops = training_flops_per_device(config) if flops is None else flops
    self.peak = peak_tflops(device_kind, config.cpu_peak_tflops)
    tokens = sequences_per_row * config.global_batch_size * config.max_target_length
    self.tokens_per_device = tokens / config.num_devices
    self.started = started
    self.last_time, self.last_step = time.time(), first_step
    self.time_to_first_step: float | None = None
    self.step_times: list[float] = []  # one entry per step after the first

  def lap(self, completed: int) -> dict[str, float | None]:
    """The perf/ scalars of the steps since the last lap, which ended after step `completed`."""
    now = time.time()
    step_time = (now - self.last_time) / (completed - self.last_step)
    if self.time_to_first_step is None:  # The first lap is the first step alone (train.py always logs it).
      self.time_to_first_step = now - self.started
    else:
      self.step_times.extend([step_time] * (completed - self.last_step))
    self.last_time, self.last_step = now, completed
    achieved = self.flops.total / step_time / 1e12
    return {
      "perf/step_time_seconds": step_time,
      "perf/per_device_tflops_per_sec": achieved,
      "perf/per_device_tokens_per_sec": self.tokens_per_device / step_time,
      "perf/mfu": None if self.peak is None else achieved / self.peak,
    }

  def pause_until_now(self) -> None:
    """Time since the last lap (an evaluation, say) is not step time."""
    self.last_time = time.time()


class Goodput:
  """Where a run's wall time went, from its start (`started`: when train.main or train.train was called): start-up
  and compilation (until the loop starts), the loop's waits for data, checkpoint saves that blocked it, evaluation,
  and the rest of the loop (training steps, logging included). Work lost to a restart is read from the metrics file:
  the steps an earlier run of the same metrics file logged at or after the checkpoint this run resumed from, which
  it trains again."""

  WAITS = ("data", "checkpoint", "evaluation")

  def __init__(self, started: float):
    self.started = started
    self.loop_start = time.time()
    self.waits = dict.fromkeys(self.WAITS, 0.0)
    self.recomputed_steps, self.recomputed_seconds = 0, 0.0

  @contextlib.contextmanager
  def waiting(self, what: str):
    start = time.time()
    try:
      yield
    finally:
      self.waits[what] += time.time() - start

  def read_earlier_metrics(self, metrics_file: str, first_step: int) -> None:
    """Counts the steps at or after `first_step` that earlier processes logged to `metrics_file` (a resumed run)."""
    if not metrics_file or not storage.isfile(metrics_file):
      return
    times = {}
    for line in storage.read_text(metrics_file).splitlines():
      try:
        record = json.loads(line)
      except ValueError:
        continue  # A line cut short by a kill.
      if isinstance(record, dict) and record.get("step", -1) >= first_step and "perf/step_time_seconds" in record:
        times[record["step"]] = record["perf/step_time_seconds"]
    if times:
      self.recomputed_steps = max(times) + 1 - first_step
      self.recomputed_seconds = statistics.median(times.values()) * self.recomputed_steps

  def report(self) -> dict[str, float]:
    now = time.time()
    total = now - self.started
    startup = self.loop_start - self.started
    steps = now - self.loop_start - sum(self.waits.values())
    return {
      "goodput/wall_seconds": total,
      # Steps trained again after a restart are not progress: their earlier time comes off the productive part.
      "goodput/productive_fraction": max(steps - self.recomputed_seconds, 0.0) / total if total > 0 else 0.0,
      "goodput/step_seconds": steps,
      "goodput/startup_seconds": startup,
      **{f"goodput/{what}_seconds": seconds for what, seconds in self.waits.items()},
      "goodput/recomputed_steps": self.recomputed_steps,
      "goodput/recomputed_seconds": self.recomputed_seconds,
    }


def format_goodput(report: dict[str, float]) -> str:
  line = (
    f"Goodput: {100 * report['goodput/productive_fraction']:.1f}% of {report['goodput/wall_seconds']:.1f} s in "
    f"training steps ({report['goodput/step_seconds']:.1f} s); start-up and compilation "
    f"{report['goodput/startup_seconds']:.1f} s, checkpoints {report['goodput/checkpoint_seconds']:.1f} s (blocking "
    f"the loop), waiting for data {report['goodput/data_seconds']:.1f} s, evaluation "
    f"{report['goodput/evaluation_seconds']:.1f} s"
  )
  if report["goodput/recomputed_steps"]:
    line += (
      f"; {report['goodput/recomputed_steps']} steps (about {report['goodput/recomputed_seconds']:.1f} s) trained "
      "again after the restart"
    )
  return line


PROFILERS = section.PROFILERS  # `profiler`: none, or a JAX (XPlane) trace that TensorBoard's profile plugin reads


class Profiler:
  """profiler=xplane: a JAX trace of steps [skip_first_n_steps_for_profiler, + profiler_steps) into `directory`."""

  def __init__(self, config: Config, directory: str):
    self.enabled = config.profiler == "xplane"
    self.start_step = config.skip_first_n_steps_for_profiler
    self.stop_after = self.start_step + config.profiler_steps
    self.directory = directory

  def before_step(self, step: int) -> None:
    if self.enabled and step == self.start_step:
      jax.profiler.start_trace(self.directory)

  def after_step(self, completed: int, outputs) -> None:
    if self.enabled and completed == self.stop_after:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()


class WriteError(OSError):
  """A metrics output (TensorBoard's events, metrics_file) could not be written; the message says which and why."""


def _summary_writer_class():
  """tensorboardX's SummaryWriter (lazy: not installed on every machine), imported without PyTorch: tensorboardX
  imports torch when it can, only to accept torch tensors, which a run never logs, and that import was 1.5 s of a
  2-core machine's time to the first step wherever torch is installed. A torch already imported is kept."""
  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # (an `import torch` now raises ImportError, which tensorboardX expects)
  try:
    from tensorboardX import SummaryWriter
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter


class MetricWriter:
  """Writes one record per logged step to TensorBoard, `metrics_file` and, with gcs_metrics=true (MaxText's key),
  {run_dir}/metrics/metrics.jsonl (process 0 only). Any of them may be on a bucket (storage.AppendedText).

  A write that fails (a full disk) raises WriteError naming the output, once: the writer is then broken, and its
  later writes and its close do nothing, so the run's own error line is not buried under the same failure again."""

  def __init__(self, config: Config, run_dir: str):
    self.config = config
    self.is_main = jax.process_index() == 0
    self.tensorboard = None
    self.files = []
    self.broken = False
    if not self.is_main:
      return
    if config.enable_tensorboard:
      try:
        SummaryWriter = _summary_writer_class()
      except ImportError:
        print("warning: tensorboardX is not installed; set enable_tensorboard=false to silence this", flush=True)
      else:
        with self._writing("TensorBoard events in", storage.join(run_dir, "tensorboard")):
          self.tensorboard = SummaryWriter(storage.join(run_dir, "tensorboard"))
    paths = [config.metrics_file] if config.metrics_file else []
    if config.gcs_metrics:
      paths.append(metrics_path(run_dir))
    for path in paths:
      with self._writing("metrics to", path):
        self.files.append(storage.AppendedText(path))

  @contextlib.contextmanager
  def _writing(self, what: str, path: str):
    try:
      yield
    except OSError as e:
      self.broken = True
      reason = e.strerror or str(e).splitlines()[0][:200]
      raise WriteError(f"cannot write {what} {path}: {reason}; free space (or fix the path), then run again") from None

  def write_goodput(self, step: int, report: dict[str, float]) -> None:
    """The run's goodput report: scalars at its last step in TensorBoard, a {"goodput": ...} line in the file."""
    if not self.is_main or self.broken:
      return
    if self.tensorboard is not None:
      for name, value in report.items():
        self.tensorboard.add_scalar(name, value, step)
    line = json.dumps({"goodput": {k.removeprefix("goodput/"): v for k, v in report.items()}})
    for file in self.files:
      with self._writing("metrics to", file.path):
        file.write_line(line)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.is_main or self.broken:
      return
    if self.tensorboard is not None:
      for name, value in scalars.items():
        if value is not None:
          self.tensorboard.add_scalar(name, value, step)
    for file in self.files:
      with self._writing("metrics to", file.path):
        file.write_line(json.dumps({"step": step, **scalars}))

  def close(self) -> None:
    """Flushes and closes every output; after a failed write only releases them (a flush would fail again)."""
    outputs = [("TensorBoard events in", self.tensorboard.logdir, self.tensorboard)] if self.tensorboard else []
    outputs += [("metrics to", file.path, file) for file in self.files]
    error = None
    for what, path, output in outputs:
      if self.broken:  # The other outputs are still closed, quietly.
        with contextlib.suppress(OSError):
          output.close()
        continue
      try:
        with self._writing(what, path):
          output.close()
      except WriteError as e:
        error = e
    if error is not None:
      raise error


def metrics_path(run_dir: str) -> str:
  """Where gcs_metrics=true writes the run's metrics."""
  return storage.join(run_dir, "metrics", "metrics.jsonl")


def format_step(step: int, scalars: dict[str, float]) -> str:
  mfu = scalars.get("perf/mfu")
  return (
    f"completed step: {step}, seconds: {scalars['perf/step_time_seconds']:.3f}, "
    f"TFLOP/s/device: {scalars['perf/per_device_tflops_per_sec']:.3f}, "
    f"Tokens/s/device: {scalars['perf/per_device_tokens_per_sec']:.1f}, "
    f"MFU: {'n/a' if mfu is None else f'{100 * mfu:.2f}%'}, "
    f"loss: {scalars['learning/loss']:.4f}, grad_norm: {scalars['learning/grad_norm']:.4f}, "
    f"lr: {scalars['learning/current_learning_rate']:.3e}"
    + (f", moe_lb_loss: {scalars['learning/moe_lb_loss']:.4f}" if "learning/moe_lb_loss" in scalars else "")
  )


def median(values):
  return statistics.median(values) if values else float("nan")
