"""Parameter count, the FLOP formula and MFU against hand counts; goodput against a clock the test controls and
against one outside the code under test."""

import json
import time

import jax
import pytest

from MaxText import metrics, pyconfig
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, config


def _llama2_7b(**kw):
  args = [BASE_YML, "run_name=x", "model_name=llama2-7b", "max_target_length=4096", "per_device_batch_size=1"]
  return pyconfig.load(args + [f"{k}={v}" for k, v in kw.items()], num_devices=1, env={})


def test_llama2_7b_parameter_count_by_hand():
  """Llama 2 7B has 6,738,415,616 parameters (Touvron et al. 2023 report 6.74B)."""
  e, layers, vocab, mlp = 4096, 32, 32000, 11008
  by_hand = 2 * vocab * e + layers * (4 * e * e + 3 * e * mlp + 2 * e) + e
  assert by_hand == 6_738_415_616
  cfg = _llama2_7b()
  abstract = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  assert metrics.count_params(abstract["params"]) == by_hand


def test_llama2_7b_training_flops_by_hand():
  """6 FLOPs per matmul weight per token, plus causal attention 6 * L * T * H * D per token (fwd + bwd)."""
  cfg = _llama2_7b()
  tokens, t = 4096, 4096
  e, layers, vocab, mlp, h, d = 4096, 32, 32000, 11008, 32, 128
  matmul_weights = layers * (4 * e * e + 3 * e * mlp) + e * vocab  # the input embedding is a gather
  by_hand = tokens * (6 * matmul_weights + 6 * layers * t * h * d)
  flops = metrics.training_flops_per_device(cfg)
  assert flops.total == by_hand


def test_flops_scale_with_gradient_accumulation():
  one = metrics.training_flops_per_device(config()).total
  assert metrics.training_flops_per_device(config("gradient_accumulation_steps=3")).total == 3 * one


def test_peak_table():
  assert metrics.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
  assert metrics.peak_tflops("TPU v5 lite") == 197.0
  assert metrics.peak_tflops("TPU v5p") == 459.0
  assert metrics.peak_tflops("cpu") is None
  assert metrics.peak_tflops("cpu", cpu_peak_tflops=0.5) == 0.5
  # One table holds both peaks: decoding's bandwidth figures read the same rows.
  assert metrics.peak_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350.0
  assert metrics.peak_bandwidth_gbps("NVIDIA A100-SXM4-40GB") == 1555.0
  assert metrics.peak_bandwidth_gbps("TPU v5 lite") == 819.0
  assert metrics.peak_bandwidth_gbps("cpu") is None
  assert metrics.peak_bandwidth_gbps("cpu", memory_bandwidth_gbps=50.0) == 50.0


def test_metric_writer_json_lines(tmp_path):
  cfg = config(f"metrics_file={tmp_path}/m.jsonl")
  writer = metrics.MetricWriter(cfg, str(tmp_path))
  writer.write(3, {"learning/loss": 1.5})
  writer.close()
  assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 3, "learning/loss": 1.5}


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
  """tensorboardX imports PyTorch when it can (1.5 s of a 2-core machine's time to the first step): a run's writer
  keeps it out, and its events are still written (read back as TFRecords of tensorboardX's Event protos)."""
  import subprocess
  import sys

  pytest.importorskip("torch")  # (only where torch is installed is there anything to keep out)
  code = (
    "import sys; from MaxText import metrics; from MaxText.tests.helpers import config; "
    f"w = metrics.MetricWriter(config('enable_tensorboard=true'), {str(tmp_path)!r}); "
    "w.write(3, {'learning/loss': 1.5}); w.close(); print('torch' in sys.modules)"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
  assert out.stdout.split()[-1] == "False", out.stdout + out.stderr
  import struct

  from tensorboardX.proto import event_pb2

  [events] = (tmp_path / "tensorboard").iterdir()
  data, scalars = events.read_bytes(), []
  while data:  # TFRecord framing: length (u64), its CRC, the Event, its CRC
    (length,) = struct.unpack("<Q", data[:8])
    event = event_pb2.Event.FromString(data[12 : 12 + length])
    scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    data = data[16 + length :]
  assert scalars == [(3, "learning/loss", 1.5)]


# Parameter counts published with the Hugging Face checkpoints (the safetensors totals on the model cards).
PUBLISHED_PARAMS = {
  "llama3-70b": 70_553_706_496,
  "llama3.1-405b": 405_853_388_800,
  "mistral-7b": 7_241_732_096,
  "gemma-2b": 2_506_172_416,
  "gemma-7b": 8_537_680_896,
  "gemma2-2b": 2_614_341_888,
  "gemma2-9b": 9_241_705_984,
  "gemma2-27b": 27_227_128_320,
  "qwen3-0.6b": 596_049_920,
  "qwen3-8b": 8_190_735_360,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_the_published_checkpoint(preset):
  cfg = pyconfig.load([BASE_YML, "run_name=x", f"model_name={preset}", "max_target_length=64"], num_devices=1, env={})
  abstract = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  assert metrics.count_params(abstract["params"]) == PUBLISHED_PARAMS[preset]


def test_step_clock_splits_time_to_first_step_from_step_times(monkeypatch):
  """Hand-timed laps: the first lap (step 0) is the time to first step, from process start; later laps of k steps
  add k step times of lap / k each; time paused for an evaluation counts nowhere."""
  now = iter([100.0, 103.0, 107.0, 150.0, 160.0])  # construction, lap 1, lap 2, pause, lap 3
  monkeypatch.setattr(metrics.time, "time", lambda: next(now))
  clock = metrics.StepClock(config(), "cpu", first_step=0, started=90.0)
  assert clock.lap(1)["perf/step_time_seconds"] == 3.0 and clock.time_to_first_step == 13.0
  assert clock.lap(3)["perf/step_time_seconds"] == 2.0  # 4 s over steps 2 and 3
  clock.pause_until_now()
  perf = clock.lap(5)
  assert perf["perf/step_time_seconds"] == 5.0 and clock.step_times == [2.0, 2.0, 5.0, 5.0]
  assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(metrics.training_flops_per_device(config()).total / 5e12)
  assert perf["perf/mfu"] is None  # no peak for a CPU unless cpu_peak_tflops is set


def _mask_pairs(length: int, window: int = 0, chunk: int = 0) -> float:
  """(query, key) pairs a causal mask allows, counted on the mask itself (numpy), with the diagonal counted half."""
  import numpy as np

  q, k = np.arange(length)[:, None], np.arange(length)[None, :]
  allowed = (k <= q) & ((window <= 0) | (q - k < window)) & ((chunk <= 0) | (q // max(chunk, 1) == k // max(chunk, 1)))
  return int(allowed.sum()) - length / 2  # the diagonal (q == k) is always allowed


@pytest.mark.parametrize(
  "length, window, chunk",
  [(1, 0, 0), (7, 0, 0), (8, 3, 0), (8, 8, 0), (8, 20, 0), (9, 1, 0), (10, 0, 4), (10, 0, 10), (10, 0, 16),
   (12, 3, 5), (13, 5, 4), (64, 5, 0)],
)  # fmt: skip
def test_attended_pairs_are_those_the_mask_allows(length, window, chunk):
  """causal_pairs, the count the FLOPs use, against the mask counted pair by pair; a full causal mask is MaxText's
  L^2/2 (calculate_tflops_training_per_device: causal = noncausal / 2)."""
  from MaxText.layers.llama import causal_pairs

  assert causal_pairs(length, window, chunk) == _mask_pairs(length, window, chunk)
  assert causal_pairs(length) == length * length / 2


@pytest.mark.parametrize("family, windowed_layers", [("mistral", [0, 1, 2, 3]), ("gemma2", [0, 2])])
def test_flops_count_sliding_windows_as_computed(family, windowed_layers):
  """Mistral windows every layer, Gemma 2 its even layers (Gemma team 2024, arXiv:2408.00118): the attention FLOPs
  are 4 * heads * head_dim per pair each layer's mask allows, times 3 (forward and backward), per sequence; a window
  as long as the sequence changes nothing."""
  keys = (f"decoder_block={family}", "override_model_config=true", "base_num_decoder_layers=4", "per_device_batch_size=2")
  cfg = config(*keys, "sliding_window_size=5")
  length, h, d = cfg.max_target_length, cfg.num_query_heads, cfg.head_dim
  windows = [5 if i in windowed_layers else 0 for i in range(4)]
  expected = 3 * 2 * sum(4 * h * d * _mask_pairs(length, w) for w in windows)
  assert metrics.training_flops_per_device(cfg).attention == expected
  unwindowed = metrics.training_flops_per_device(config(*keys, "sliding_window_size=0")).attention
  assert metrics.training_flops_per_device(config(*keys, f"sliding_window_size={length}")).attention == unwindowed
  assert unwindowed == 3 * 2 * 4 * 4 * h * d * length * length / 2


# ------------------------------------------------------------------------------------------ goodput
class _FakeClock:
  """A clock that moves only when the test spends time on it: every part of a report is then known exactly."""

  def __init__(self, now: float):
    self.now = now

  def __call__(self) -> float:
    return self.now

  def spend(self, seconds: float) -> None:
    self.now += seconds


def test_goodput_puts_each_second_where_the_clock_spent_it(monkeypatch, tmp_path):
  """On a clock the test moves by hand (whichever of time.time, monotonic or perf_counter Goodput reads): 7 s of
  start-up, 6 s of steps around 1 s of data waits (one of them failing), 1.25 s of checkpoint and 0.75 s of
  evaluation: 16 s of wall time, each part exactly as spent; 3 steps that an earlier process logged after the
  checkpoint this run resumed from (median 0.6 s) come off the productive part."""
  clock = _FakeClock(1000.0)
  for name in ("time", "monotonic", "perf_counter"):
    monkeypatch.setattr(metrics.time, name, clock)
  earlier = tmp_path / "m.jsonl"
  earlier.write_text(
    "".join(json.dumps({"step": s, "perf/step_time_seconds": t}) + "\n" for s, t in ((3, 9.0), (4, 0.5), (5, 0.7), (6, 0.6)))
  )
  started = clock()
  clock.spend(7.0)  # start-up and compilation
  goodput = metrics.Goodput(started)
  goodput.read_earlier_metrics(str(earlier), first_step=4)
  clock.spend(2.0)
  with goodput.waiting("data"):
    clock.spend(0.5)
  clock.spend(3.0)
  with goodput.waiting("checkpoint"):
    clock.spend(1.25)
  with goodput.waiting("evaluation"):
    clock.spend(0.75)
  with pytest.raises(RuntimeError), goodput.waiting("data"):  # a wait that ends in an error was still spent waiting
    clock.spend(0.5)
    raise RuntimeError("the data loader failed")
  clock.spend(1.0)
  assert goodput.report() == {
    "goodput/wall_seconds": 16.0,
    "goodput/productive_fraction": (6.0 - 3 * 0.6) / 16.0,
    "goodput/step_seconds": 6.0,
    "goodput/startup_seconds": 7.0,
    "goodput/data_seconds": 1.0,
    "goodput/checkpoint_seconds": 1.25,
    "goodput/evaluation_seconds": 0.75,
    "goodput/recomputed_steps": 3,
    "goodput/recomputed_seconds": pytest.approx(1.8),
  }


# Slack between two clocks read back to back (time.time inside Goodput, perf_counter outside): their rates agree to
# parts per million over these seconds, and reading one takes microseconds.
CLOCKS = 2e-3


# What train() does outside its goodput report's window (after the report: write it, close the metrics file, log a
# line, read the peak memory): milliseconds; 0.25 s on a loaded 2-core machine.
TRAIN_TAIL = 0.25
# _next_batch's own work around the iterator's next() (a signal handler set and restored): microseconds; 50 ms.
TRAIN_CALL = 0.05


def _slept(seconds: float) -> float:
  """Sleeps; returns the seconds it took by perf_counter (at least `seconds`)."""
  start = time.perf_counter()
  time.sleep(seconds)
  return time.perf_counter() - start


def test_goodput_agrees_with_an_outside_clock_on_real_sleeps():
  """Real sleeps, each timed from inside its part (a lower bound of what Goodput may count there) and around it
  (an upper bound): every part lies between them, within CLOCKS. A Goodput that read CPU time, or put a wait in
  the wrong part, would be off by a whole sleep (30-80 ms)."""
  outer_start = time.perf_counter()
  started = time.time()
  startup = _slept(0.05)
  loop_start = time.perf_counter()
  goodput = metrics.Goodput(started)
  after_init = time.perf_counter()
  waits, steps = {}, []
  for what, seconds in (("data", 0.06), ("checkpoint", 0.03), ("evaluation", 0.04), ("data", 0.03)):
    steps.append(_slept(0.04))  # a step's work, in no wait
    before = time.perf_counter()
    with goodput.waiting(what):
      inner = _slept(seconds)
    low, high = waits.get(what, (0.0, 0.0))
    waits[what] = (low + inner, high + time.perf_counter() - before)
  before_report = time.perf_counter()
  report = goodput.report()
  end = time.perf_counter()

  def between(value, low, high):
    assert low - CLOCKS <= value <= high + CLOCKS, (value, low, high)

  between(report["goodput/wall_seconds"], before_report - outer_start, end - outer_start)
  between(report["goodput/startup_seconds"], startup, after_init - outer_start)
  for what, (low, high) in waits.items():
    between(report[f"goodput/{what}_seconds"], low, high)
  waited_low, waited_high = sum(low for low, _ in waits.values()), sum(high for _, high in waits.values())
  between(report["goodput/step_seconds"], sum(steps), end - loop_start - waited_low)
  assert report["goodput/step_seconds"] <= before_report - after_init - waited_low + CLOCKS
  assert sum(steps) >= 0.16 and waited_high < end - loop_start  # the bounds are the sleeps', not vacuous


def test_goodput_of_a_training_run_agrees_with_an_outside_clock(monkeypatch):
  """train.train with a data iterator that sleeps 0.2 s before each batch, timed from outside: the wall time is the
  call's (less what train() does after its report: closing files, one log line; TRAIN_TAIL allows for it); the
  data waits hold the iterator's calls (plus TRAIN_CALL each for _next_batch's own work); the steps' part holds the
  time between consecutive batches and fits in the loop; start-up holds the compilation, done before the iterator
  is made, and ends before the first batch is asked for."""
  from MaxText import input_pipeline, train

  sleep, steps = 0.2, 3
  made, fetches = [], []  # when the iterator was made; (start, end) of each batch the loop asked for
  create = input_pipeline.create_iterator

  class SlowData:
    def __init__(self, inner):
      self.inner = inner

    def __iter__(self):
      return self

    def __next__(self):
      start = time.perf_counter()
      time.sleep(sleep)
      batch = next(self.inner)
      fetches.append((start, time.perf_counter()))
      return batch

    def get_state(self):
      return self.inner.get_state()

  def slow_iterator(*args, **kwargs):
    data = SlowData(create(*args, **kwargs))
    made.append(time.perf_counter())
    return data

  monkeypatch.setattr(input_pipeline, "create_iterator", slow_iterator)
  cfg, devices = config(f"steps={steps}", "log_period=1", "enable_checkpointing=false"), jax.devices()[:1]
  start = time.perf_counter()
  summary = train.train(cfg, devices)
  end = time.perf_counter()
  report = summary.goodput
  assert len(made) == 1 and len(fetches) == steps  # the loop read its batches through SlowData

  assert end - start - TRAIN_TAIL <= report["goodput/wall_seconds"] <= end - start + CLOCKS
  fetched = sum(b - a for a, b in fetches)
  assert fetched >= steps * sleep
  assert fetched - CLOCKS <= report["goodput/data_seconds"] <= fetched + steps * TRAIN_CALL
  assert report["goodput/checkpoint_seconds"] == report["goodput/evaluation_seconds"] == 0.0
  between_batches = sum(fetches[i + 1][0] - fetches[i][1] for i in range(steps - 1))
  assert between_batches - CLOCKS <= report["goodput/step_seconds"] <= end - made[0] - fetched + CLOCKS
  assert made[0] - start - CLOCKS <= report["goodput/startup_seconds"] <= fetches[0][0] - start + CLOCKS
