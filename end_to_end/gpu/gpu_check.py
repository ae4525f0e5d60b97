"""The GPU check: on one NVIDIA H100 or H200, in under 8 minutes, the figures the performance pages want.

    python3 end_to_end/gpu/gpu_check.py [--json PATH] [--only ROW,ROW] [--window-s 10] [--total-s 360]
    python3 end_to_end/gpu/gpu_check.py --quick [--json PATH]     # CI: the same code on the CPU, a tiny model

The model: a ~1B Llama 2 shaped decoder (decoder_block=llama2: emb 2048, 16 layers, 16 query and 16 KV heads of
128, MLP 5632, vocabulary 32000, untied; 0.95B parameters), sequences of 2048, per_device_batch_size=8,
remat_policy=minimal, bf16 activations with float32 weights and AdamW state, synthetic data. The rows, in the order
they run (the least needed last, where --total-s may cut it off):
  - train bf16 dot_product / train bf16 cudnn_flash_jax: XLA's attention against cuDNN fused attention
    (jax.nn.dot_product_attention's cuDNN kernel; base.yml's cudnn_flash_te runs the same one);
  - train fp8 cudnn_flash_jax: quantization=fp8 (qwix: e4m3 matmuls forward and backward), against bf16 cudnn;
  - decode step / decode loop: batched greedy decoding through the inference engine (inference_microbenchmark.py:
    64 rows, prompts of 128, 896 generated tokens each), one step per dispatch and the compiled generate loop;
  - train fp8 dot_product: fp8 against bf16 dot_product (the fp8 row that runs on the CPU too).
Each training row is the step train.py runs (step.build, step.jit_train_step, step.compile_while: compiled ahead
of time and checked to fit), a few warm-up steps, then a timed window of whole steps (about --window-s seconds,
ended by block_until_ready). Its figures are the project's own (metrics.py): tokens/s per device, model TFLOP/s per
device from metrics.training_flops_per_device (MaxText's count: 6 x the matmul parameters per token, plus the
causal attention's 4*H*D per (query, key) pair x 3, L^2/2 pairs a sequence), and MFU against the dense bf16 peak of
metrics.DEVICE_PEAKS (989 TFLOP/s for both cards). An fp8 row also gives its fraction of the dense fp8 peak (twice
the bf16 one on Hopper and Blackwell: 1979 TFLOP/s). The decode rows are inference_microbenchmark.benchmark's:
tokens/s, and bytes read per step (the parameters, bf16, plus the engine's whole KV cache pool) over the step's
time, against the card's HBM bandwidth (metrics.DEVICE_PEAKS: H100 SXM 3.35 TB/s, H200 4.8 TB/s).

It uses one GPU (CUDA_VISIBLE_DEVICES=0 unless set) with hardware=gpu (NVIDIA's XLA flags, MaxText/cli.py) and
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 unless set. A row whose variant this device or this install cannot run (cuDNN
attention off a GPU, fp8 without qwix or below compute capability 8.9, a step that does not fit) says "skipped"
and why; a row that fails otherwise says "failed" and makes the exit status 1. No row starts after --total-s
from the start (it is "skipped: out of time"). It prints one table (the device, each row's figures and the
command of the project's that gives the same figures) and writes it as JSON to --json, after every row.

Without a GPU: with --quick it runs every row it can on the CPU (the cuDNN rows are skipped) with a tiny model for
a few steps, so the code cannot rot, and marks the table "CPU, short mode: figures mean nothing" (fp8 dots run as
float there: the row runs, its speed is not fp8's); --quick always runs on the CPU. Without --quick and without a
GPU it prints one line starting "SKIPPED:" (and writes {"skipped": reason} to --json) and exits 0: nothing to
measure here is not a failure. A mistake in its own arguments exits 2.
"""

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import jax  # noqa: E402 (after the path above)

from MaxText import cli, inference_microbenchmark, input_pipeline, metrics, pyconfig  # noqa: E402
from MaxText import state as state_lib  # noqa: E402
from MaxText import step as step_lib  # noqa: E402
from MaxText.common_types import Config, ConfigError  # noqa: E402

BASE_YML = "MaxText/configs/base.yml"
SHORT_MODE = "CPU, short mode: figures mean nothing"
# The ~1B Llama 2 shaped model (TinyLlama's width and MLP, 16 layers of full multi-head attention) and the tiny one.
MODEL = (
  "decoder_block=llama2 base_emb_dim=2048 base_num_decoder_layers=16 base_num_query_heads=16 base_num_kv_heads=16 "
  "head_dim=128 base_mlp_dim=5632 vocab_size=32000"
)
TINY_MODEL = (
  "decoder_block=llama2 base_emb_dim=64 base_num_decoder_layers=2 base_num_query_heads=4 base_num_kv_heads=4 "
  "head_dim=16 base_mlp_dim=128 vocab_size=256"
)
TRAIN = "max_target_length=2048 per_device_batch_size=8 remat_policy=minimal"
TINY_TRAIN = "max_target_length=64 per_device_batch_size=2 remat_policy=minimal"
DECODE = (
  "max_prefill_predict_length=128 max_target_length=1024 per_device_batch_size=64 decode_sampling_strategy=greedy "
  "inference_microbenchmark_prefill_lengths=128 inference_microbenchmark_stages=generate "
  "inference_microbenchmark_loop_iters=10"
)
TINY_DECODE = (
  "max_prefill_predict_length=8 max_target_length=24 per_device_batch_size=2 decode_sampling_strategy=greedy "
  "inference_microbenchmark_prefill_lengths=8 inference_microbenchmark_stages=generate "
  "inference_microbenchmark_loop_iters=2"
)
# (row name, the keys it sets on top of the model's); an fp8 row pairs with the bf16 row of the same attention.
TRAIN_ROWS = (
  ("train bf16 dot_product", "attention=dot_product"),
  ("train bf16 cudnn_flash_jax", "attention=cudnn_flash_jax"),
  ("train fp8 cudnn_flash_jax", "attention=cudnn_flash_jax quantization=fp8"),
  ("train fp8 dot_product", "attention=dot_product quantization=fp8"),
)
DECODE_ROWS = ("decode step", "decode loop")
# The order they run in, and are printed in: the least needed last, where --total-s may cut it off.
ROWS = (*(name for name, _ in TRAIN_ROWS[:3]), *DECODE_ROWS, TRAIN_ROWS[3][0])
# Dense fp8 is twice dense bf16 on these (NVIDIA's data sheets: H100 SXM / H200 1979 vs 989 TFLOP/s, B200 4500 vs
# 2250); metrics.DEVICE_PEAKS keeps bf16 only, so the fp8 row's second MFU is derived here for these kinds alone.
FP8_DOUBLES_BF16 = ("H100", "H200", "B200")


@dataclasses.dataclass
class Row:
  """One measured configuration; figures are per device and None where they do not apply or were not measured."""

  name: str
  command: str  # a command of the project's that gives the same figures (train.py logs them every step)
  status: str = "ok"  # ok, skipped or failed
  reason: str = ""  # why skipped or failed
  note: str = ""
  step_ms: float | None = None
  tokens_per_s: float | None = None
  flops_per_token: float | None = None  # training: model FLOPs per token (metrics.training_flops_per_device)
  tflops_per_s: float | None = None
  mfu: float | None = None  # of the dense bf16 peak
  mfu_fp8_peak: float | None = None  # fp8 rows on cards with fp8: of the dense fp8 peak
  bytes_per_step: float | None = None  # decoding: parameters + the KV cache pool
  bandwidth_gbps: float | None = None
  bandwidth_fraction: float | None = None  # of the card's HBM bandwidth
  timed_steps: int | None = None
  params: int | None = None  # training: the model's parameter count


@dataclasses.dataclass(frozen=True)
class Plan:
  """What one invocation measures: the model, its keys, and how long each part may take."""

  quick: bool
  model: str
  train: str
  decode: str
  warmup: int
  window_s: float  # the timed window of a training row
  min_steps: int
  max_steps: int
  total_s: float  # no row starts after this many seconds from the start


def plan(args) -> Plan:
  if args.quick:
    return Plan(True, TINY_MODEL, TINY_TRAIN, TINY_DECODE, 1, window_s=0.0, min_steps=2, max_steps=2, total_s=args.total_s)
  return Plan(
    False, MODEL, TRAIN, DECODE, warmup=3, window_s=args.window_s, min_steps=5, max_steps=500, total_s=args.total_s
  )


def commands(p: Plan, hardware: str) -> dict[str, str]:
  """Each row's command of the project's own that gives the same figures: train.py logs tokens/s, TFLOP/s and MFU
  per step; inference_microbenchmark.py prints both decode rows."""
  common = f"hardware={hardware} dataset_type=synthetic enable_checkpointing=false"
  steps = p.warmup + 1 + p.max_steps if p.quick else 30
  train = f"python3 MaxText/train.py {BASE_YML} run_name=gpu_check {p.model} {p.train} {{}} {common} steps={steps}"
  decode = f"python3 MaxText/inference_microbenchmark.py {BASE_YML} {p.model} {p.decode} hardware={hardware}"
  keys = dict(TRAIN_ROWS)
  return {name: decode if name in DECODE_ROWS else train.format(keys[name]) for name in ROWS}


def changes(command: str) -> dict[str, str]:
  """The key=value arguments of one of `commands`' commands: the in-process run is that command's config."""
  return dict(arg.split("=", 1) for arg in command.split() if "=" in arg)


def measure_training(config: Config, p: Plan, row: Row) -> None:
  """The train step of train.py, compiled ahead of time and checked to fit, then a warm-up and a timed window."""
  parts = step_lib.build(config)
  jitted = step_lib.jit_train_step(
    config, parts.mesh, model=parts.model, schedule=parts.schedule, tx=parts.tx, layout=parts.layout
  )
  compiled, state = step_lib.compile_while(
    config, parts.mesh, jitted, lambda: state_lib.init_state(parts.model, config, parts.tx, parts.layout)
  )
  batch = next(input_pipeline.create_iterator(config, parts.mesh))  # one batch, reused (reuse_example_batch's way)
  for _ in range(p.warmup):
    state, out = compiled(state, batch)
  jax.block_until_ready(out)
  start = time.perf_counter()
  state, out = compiled(state, batch)
  jax.block_until_ready(out)
  first = time.perf_counter() - start
  # The window: whole steps dispatched back to back, timed until the last one's loss is read back.
  steps = min(max(int(p.window_s / first), p.min_steps), p.max_steps)
  start = time.perf_counter()
  for _ in range(steps):
    state, out = compiled(state, batch)
  loss = float(jax.device_get(out["learning/loss"]))
  step_s = (time.perf_counter() - start) / steps
  if not math.isfinite(loss):
    raise RuntimeError(f"the loss is {loss} after {p.warmup + 1 + steps} steps")
  flops = metrics.training_flops_per_device(config)
  tokens = config.global_batch_size * config.max_target_length / config.num_devices  # per device per step
  kind = parts.mesh.devices.flat[0].device_kind
  row.step_ms, row.timed_steps = step_s * 1e3, steps
  row.tokens_per_s = tokens / step_s
  row.flops_per_token = flops.total / tokens
  row.tflops_per_s = flops.total / step_s / 1e12
  peak = metrics.peak_tflops(kind)
  row.mfu = None if peak is None else row.tflops_per_s / peak
  if config.quantization.startswith("fp8") and peak is not None and any(k in kind for k in FP8_DOUBLES_BF16):
    row.mfu_fp8_peak = row.tflops_per_s / (2 * peak)
  row.params = metrics.count_params(parts.layout.abstract.params)
  row.note = f"loss {loss:.3f}, {row.params / 1e6:.4g}M params, {steps} steps timed"
  del state, compiled, batch, out


def measure_decoding(config: Config, rows: list[Row]) -> None:
  """inference_microbenchmark.benchmark on `config`'s batch: one step per dispatch, and the compiled loop."""
  (result,) = inference_microbenchmark.benchmark(config)
  step, loop = rows
  step_s, loop_s = result["step_ms"] / 1e3, result["loop_ms_per_step"] / 1e3
  peak = metrics.peak_bandwidth_gbps(jax.devices()[0].device_kind, config.memory_bandwidth_gbps)
  for row, seconds, rate in ((step, step_s, result["step_tokens_per_s"]), (loop, loop_s, result["loop_tokens_per_s"])):
    row.step_ms, row.tokens_per_s = seconds * 1e3, rate
    row.bytes_per_step = float(result["bytes_per_step"])
    row.bandwidth_gbps = row.bytes_per_step / seconds / 1e9 / config.num_devices
    row.bandwidth_fraction = None if peak is None else row.bandwidth_gbps / peak
    row.note = f"batch {result['batch']}, prompt {result['prefill_length']}"


def unavailable(name: str, device) -> str | None:
  """Why this install or device cannot run row `name`, known before building it; None when it can try."""
  if "cudnn" in name and device.platform != "gpu":
    return f"cuDNN fused attention needs an NVIDIA GPU (device: {device.device_kind})"
  if "fp8" in name and importlib.util.find_spec("qwix") is None:
    return "quantization=fp8 needs qwix (pip install qwix==0.1.8, as requirements.txt)"
  return None


def run_row(row: Row, measure, deadline: float, skip: str | None = None) -> None:
  """Runs `measure()` into `row`: a ConfigError (the project refusing the variant here) skips it, anything else
  fails it; both keep the one-line reason."""
  if skip:
    row.status, row.reason = "skipped", skip
    return
  if time.time() > deadline:
    row.status, row.reason = "skipped", "out of time (--total-s)"
    return
  try:
    measure()
  except ConfigError as e:
    row.status, row.reason = "skipped", str(e).splitlines()[0]
  except Exception as e:  # noqa: BLE001 (a row's failure is reported in its row; the others still run)
    row.status, row.reason = "failed", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
  finally:
    gc.collect()
    jax.clear_caches()


def fmt(value: float | None, kind: str) -> str:
  if value is None:
    return "-"
  if kind == "%":
    return f"{100 * value:.1f}%"
  return f"{value:.4g}"


def table(rows: list[Row], header: str) -> str:
  lines = [
    header,
    "",
    "| row | tokens/s | step ms | TFLOP/s/device | MFU | HBM GB/s | of HBM peak | status |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    status = "ok" + (f" ({r.note})" if r.note else "") if r.status == "ok" else f"{r.status}: {r.reason}"
    mfu = fmt(r.mfu, "%") + (f" ({fmt(r.mfu_fp8_peak, '%')} of fp8 peak)" if r.mfu_fp8_peak is not None else "")
    cells = [r.name, fmt(r.tokens_per_s, ""), fmt(r.step_ms, ""), fmt(r.tflops_per_s, ""), mfu]
    cells += [fmt(r.bandwidth_gbps, ""), fmt(r.bandwidth_fraction, "%"), status]
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Commands (the same figures from the project's own scripts):"]
  lines += [f"  {r.name}: {r.command}" for r in rows]
  return "\n".join(lines)


def check(args) -> int:
  p = plan(args)
  started = time.time()
  only = [n.strip() for n in args.only.split(",")] if args.only else list(ROWS)
  unknown = sorted(set(only) - set(ROWS))
  if unknown:
    raise ConfigError(f"--only names {unknown}, not rows of this check; choose from {', '.join(ROWS)}")
  hardware = "cpu" if p.quick else "gpu"
  try:
    base = cli.load_config([BASE_YML, *p.model.split(), f"hardware={hardware}"])
  except ConfigError as e:
    if p.quick or not str(e).startswith("hardware=gpu"):  # cli.load_config's two lines for a missing GPU backend
      raise
    reason = f"needs an NVIDIA GPU, and JAX here has none ({str(e).splitlines()[0]}); --quick runs its short mode on the CPU"
    print(f"SKIPPED: gpu_check {reason}", flush=True)
    if args.json:
      write_json(args.json, {"skipped": reason})
    return 0
  device = jax.devices()[0]
  when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
  versions = f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}"
  report = {
    "device": device.device_kind,
    "platform": device.platform,
    "date": when,
    "versions": versions,
    "short_mode": SHORT_MODE if p.quick else None,
    "command": " ".join(["python3", "end_to_end/gpu/gpu_check.py", *sys.argv[1:]]),
    "model": p.model,
    "training": p.train,
    "decoding": p.decode,
  }
  deadline = started + p.total_s
  rows = [Row(name, command) for name, command in commands(p, hardware).items()]
  by_name = {row.name: row for row in rows}
  for name in ROWS:  # in the order they run
    row = by_name[name]
    if name == "decode step" and set(DECODE_ROWS) & set(only):  # both decode rows come from one benchmark run
      loop = by_name["decode loop"]
      run_row(row, lambda: measure_decoding(pyconfig.replace(base, **changes(row.command)), [row, loop]), deadline)
      loop.status, loop.reason = row.status, row.reason
      done = [row, loop]
    elif name in only and name not in DECODE_ROWS:
      skip = unavailable(name, device)
      run_row(row, lambda: measure_training(pyconfig.replace(base, **changes(row.command)), p, row), deadline, skip)
      done = [row]
    else:
      continue
    for r in done:
      print(f"{r.name}: {r.status} {r.reason}".strip(), flush=True)
    report |= {"seconds": time.time() - started, "rows": [dataclasses.asdict(r) for r in rows if r.name in only]}
    if args.json:  # after every row: a run stopped midway keeps what it measured
      write_json(args.json, report)
  shown = [row for row in rows if row.name in only]
  header = f"gpu_check on 1 x {device.device_kind} ({device.platform}), {when}, {versions}, {time.time() - started:.0f} s"
  print(table(shown, header + (f"\n{SHORT_MODE}" if p.quick else "")), flush=True)
  return 1 if any(r.status == "failed" for r in shown) else 0


def write_json(path: str, report: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(report, f, indent=1)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="CI's short mode: the CPU, a tiny model, a few steps")
  parser.add_argument("--json", default="", help="write the table here as JSON")
  parser.add_argument("--only", default="", help=f"comma-separated rows to run, of: {', '.join(ROWS)}")
  parser.add_argument("--window-s", type=float, default=10.0, help="seconds of timed steps per training row")
  parser.add_argument("--total-s", type=float, default=360.0, help="no row starts after this many seconds")
  args = parser.parse_args()
  # Read when the GPU backend starts (cli.load_config queries the devices first, in check()).
  os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # One GPU: the figures are per device.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")  # As end_to_end/gpu/llama2_7b_1node.sh.
  os.chdir(REPO)  # the commands it prints run from the repository root
  try:
    return check(args)
  except ConfigError as e:
    print(f"gpu_check: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
