"""Model FLOPs, MFU and the metric writers (stdout, TensorBoard, JSON lines)."""

import dataclasses
import json
import math
import os
import resource
import statistics

import jax

from MaxText.pyconfig import Config

# Dense bf16 peak TFLOP/s per device (per chip for TPUs), from the vendors' data sheets. Matched against
# jax's device_kind, most specific first.
PEAK_BF16_TFLOPS = (
  ("TPU v4", 275.0),
  ("TPU v5 lite", 197.0),
  ("TPU v5e", 197.0),
  ("TPU v5p", 459.0),
  ("TPU v5", 459.0),
  ("TPU v6 lite", 918.0),
  ("TPU v6e", 918.0),
  ("A100", 312.0),
  ("H100", 989.0),
  ("H200", 989.0),
  ("B200", 2250.0),
)


def peak_tflops(device_kind: str, cpu_peak_tflops: float = 0.0) -> float | None:
  """Peak dense bf16 TFLOP/s of a device kind, or None when unknown (CPU unless cpu_peak_tflops is set)."""
  for name, peak in PEAK_BF16_TFLOPS:
    if name.lower() in device_kind.lower():
      return peak
  if device_kind.lower() == "cpu" and cpu_peak_tflops > 0:
    return cpu_peak_tflops
  return None


@dataclasses.dataclass(frozen=True)
class TrainingFlops:
  """Model FLOPs of one training step on one device (forward + backward = 3x forward)."""

  weights: float  # matmuls against learned weights (attention projections, MLP, output projection)
  attention: float  # q.k^T and weights.v, causal
  total: float


def training_flops_per_device(config: Config) -> TrainingFlops:
  """Analytic model FLOPs per device per step, MaxText's `calculate_tflops_training_per_device`.

  A matmul [m, k] x [k, n] costs 2mkn. Per token of a layer: q/k/v projections 2*E*(H + 2*KV)*D, output
  projection 2*E*H*D, MLP 2*E*M*(number of input projections + 1); attention 4*L*H*D per token, halved for
  the causal mask (as Megatron-LM and NeMo count it); the output projection 2*E*V once. Training is 3x the
  forward pass (Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1). Rematerialisation is not counted: these
  are model FLOPs, so MFU is comparable across remat policies.
  """
  tokens = config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps
  e, h, kv, d, m = config.emb_dim, config.num_query_heads, config.num_kv_heads, config.head_dim, config.mlp_dim
  per_layer = 2 * e * (h + 2 * kv) * d + 2 * e * h * d + 2 * e * m * (len(config.mlp_activations) + 1)
  weights = 3 * tokens * (per_layer * config.num_decoder_layers + 2 * e * config.vocab_size)
  attention = 3 * tokens * config.num_decoder_layers * 4 * config.max_target_length * h * d / 2
  return TrainingFlops(weights=weights, attention=attention, total=weights + attention)


def count_params(params) -> int:
  return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params))


def peak_memory_bytes() -> tuple[int, str]:
  """Peak memory of device 0 if the backend reports it, else the process's peak RSS."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"]), "device"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"


class MetricWriter:
  """Writes one record per logged step to stdout, TensorBoard and `metrics_file` (process 0 only)."""

  def __init__(self, config: Config, run_dir: str):
    self.config = config
    self.is_main = jax.process_index() == 0
    self.tensorboard = None
    self.json_file = None
    if not self.is_main:
      return
    if config.enable_tensorboard:
      try:
        from tensorboardX import SummaryWriter  # Lazy: not installed on every machine.
      except ImportError:
        print("warning: tensorboardX is not installed; set enable_tensorboard=false to silence this", flush=True)
      else:
        self.tensorboard = SummaryWriter(os.path.join(run_dir, "tensorboard"))
    if config.metrics_file:
      os.makedirs(os.path.dirname(os.path.abspath(config.metrics_file)), exist_ok=True)
      self.json_file = open(config.metrics_file, "a", encoding="utf-8")

  def write(self, step: int, scalars: dict[str, float]) -> None:
    if not self.is_main:
      return
    if self.tensorboard is not None:
      for name, value in scalars.items():
        if value is not None:
          self.tensorboard.add_scalar(name, value, step)
    if self.json_file is not None:
      self.json_file.write(json.dumps({"step": step, **scalars}) + "\n")
      self.json_file.flush()

  def close(self) -> None:
    if self.tensorboard is not None:
      self.tensorboard.close()
    if self.json_file is not None:
      self.json_file.close()


def format_step(step: int, scalars: dict[str, float]) -> str:
  mfu = scalars.get("perf/mfu")
  return (
    f"completed step: {step}, seconds: {scalars['perf/step_time_seconds']:.3f}, "
    f"TFLOP/s/device: {scalars['perf/per_device_tflops_per_sec']:.3f}, "
    f"Tokens/s/device: {scalars['perf/per_device_tokens_per_sec']:.1f}, "
    f"MFU: {'n/a' if mfu is None else f'{100 * mfu:.2f}%'}, "
    f"loss: {scalars['learning/loss']:.4f}, grad_norm: {scalars['learning/grad_norm']:.4f}, "
    f"lr: {scalars['learning/current_learning_rate']:.3e}"
  )


def median(values):
  return statistics.median(values) if values else float("nan")
