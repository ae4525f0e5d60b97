"""Parameter count, the FLOP formula and MFU against hand counts."""

import json

import jax

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


def test_metric_writer_json_lines(tmp_path):
  cfg = config(f"metrics_file={tmp_path}/m.jsonl")
  writer = metrics.MetricWriter(cfg, str(tmp_path))
  writer.write(3, {"learning/loss": 1.5})
  writer.close()
  assert json.loads((tmp_path / "m.jsonl").read_text()) == {"step": 3, "learning/loss": 1.5}
