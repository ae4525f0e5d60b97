"""Parameter count, the FLOP formula and MFU against hand counts."""

import json

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
  clock = metrics.StepClock(config(), "cpu", first_step=0, process_start=90.0)
  assert clock.lap(1)["perf/step_time_seconds"] == 3.0 and clock.time_to_first_step == 13.0
  assert clock.lap(3)["perf/step_time_seconds"] == 2.0  # 4 s over steps 2 and 3
  clock.pause_until_now()
  perf = clock.lap(5)
  assert perf["perf/step_time_seconds"] == 5.0 and clock.step_times == [2.0, 2.0, 5.0, 5.0]
  assert perf["perf/per_device_tflops_per_sec"] == pytest.approx(metrics.training_flops_per_device(config()).total / 5e12)
  assert perf["perf/mfu"] is None  # no peak for a CPU unless cpu_peak_tflops is set
