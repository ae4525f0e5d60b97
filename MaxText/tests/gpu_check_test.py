"""end_to_end/gpu/gpu_check.py: its short mode on the CPU, its one-line skip without a GPU, and the GPU plan's
configs and FLOP count.

The FLOP count is checked against MaxText's formula written out here from the model's shapes (6 x the matmul
parameters per token, plus 3 x the causal attention's 4*H*D per (query, key) pair, L^2/2 pairs a sequence: Kaplan
et al. 2020, arXiv:2001.08361, sec. 2.1; MaxText's calculate_tflops_training_per_device), not from metrics.py, and
the parameters are counted from the same shapes.
"""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest

from MaxText import metrics, pyconfig
from MaxText import state as state_lib
from MaxText.tests.helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "end_to_end", "gpu", "gpu_check.py")
CUDNN_ROWS = {"train bf16 cudnn_flash_jax", "train fp8 cudnn_flash_jax"}


def gpu_check():
  spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def shapes(keys: str) -> dict[str, int]:
  """The model's shapes from its key=value string (base_* keys: global_parameter_scale stays 1)."""
  values = dict(kv.split("=", 1) for kv in keys.split())
  names = {"E": "base_emb_dim", "N": "base_num_decoder_layers", "H": "base_num_query_heads", "KV": "base_num_kv_heads"}
  names |= {"D": "head_dim", "M": "base_mlp_dim", "V": "vocab_size", "S": "max_target_length"}
  return {short: int(values[key]) for short, key in names.items() if key in values}


def matmul_params(s: dict[str, int]) -> int:
  """Llama 2 with untied embeddings: per layer q, k, v, o and the gated MLP's three matrices, then the output
  projection; the embedding table is a gather, not a matmul."""
  per_layer = s["E"] * (s["H"] + 2 * s["KV"]) * s["D"] + s["H"] * s["D"] * s["E"] + 3 * s["E"] * s["M"]
  return s["N"] * per_layer + s["E"] * s["V"]


def all_params(s: dict[str, int]) -> int:
  """Matmul parameters, the embedding table and the RMSNorm scales (two per layer, one final)."""
  return matmul_params(s) + s["E"] * s["V"] + (2 * s["N"] + 1) * s["E"]


def flops_per_token(s: dict[str, int]) -> float:
  attention_pairs_per_token = s["S"] / 2  # L^2/2 causal pairs over L tokens
  return 6 * matmul_params(s) + 3 * s["N"] * 4 * s["H"] * s["D"] * attention_pairs_per_token


def load(command: str):
  """The Config of one of gpu_check.commands' commands (`python3 SCRIPT CONFIG.yml key=value ...`), on one device."""
  argv = command.split()[2:]
  return pyconfig.load([os.path.join(REPO_ROOT, argv[0]), *argv[1:]], num_devices=1)


def run(args: list[str], env_changes: dict[str, str]) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, not the tests' 8
  env |= env_changes
  return subprocess.run(
    [sys.executable, SCRIPT, *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
  )


def table_cells(stdout: str) -> dict[str, list[str]]:
  """The printed table's rows by name: the cells after the name."""
  rows = {}
  for line in stdout.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| ") and len(cells) == 8 and cells[0] not in ("row", "---"):
      rows[cells[0]] = cells[1:]
  return rows


@pytest.mark.slow
def test_short_mode_runs_every_row_on_the_cpu(tmp_path):
  """About 55-65 s on the 2-core VM (load average 7 from other work; compiles dominate). Every row is there; the
  CPU rows measured positive, finite figures whose TFLOP/s is tokens/s x the FLOPs per token of the model's shapes;
  the cuDNN rows are skipped, saying why."""
  out = tmp_path / "gpu_check.json"
  proc = run(["--quick", "--json", str(out)], {"JAX_PLATFORMS": "cpu", "M_JAX_CACHE_DIR": ""})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "CPU, short mode: figures mean nothing" in proc.stdout
  report = json.loads(out.read_text())
  module = gpu_check()
  rows = {r["name"]: r for r in report["rows"]}
  assert list(rows) == list(module.ROWS)
  assert report["platform"] == "cpu" and report["short_mode"]
  s = shapes(report["model"] + " " + report["training"])
  printed = table_cells(proc.stdout)
  assert set(printed) == set(rows)
  for name, row in rows.items():
    assert row["command"] and name in proc.stdout.split("Commands")[1], name
    if name in CUDNN_ROWS:
      assert row["status"] == "skipped" and "cuDNN" in row["reason"] and "GPU" in row["reason"], row
      assert printed[name][-1].startswith("skipped: cuDNN"), printed[name]
      continue
    assert row["status"] == "ok", row
    assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
    assert math.isfinite(row["step_ms"]) and row["step_ms"] > 0, row
    assert row["mfu"] is None and row["bandwidth_fraction"] is None  # a CPU has no data-sheet peak
    if name.startswith("train"):
      assert row["params"] == all_params(s), (row["params"], all_params(s))
      assert row["flops_per_token"] == pytest.approx(flops_per_token(s), rel=1e-12)
      tflops = row["tokens_per_s"] * flops_per_token(s) / 1e12
      assert row["tflops_per_s"] == pytest.approx(tflops, rel=1e-9)
      assert float(printed[name][2]) == pytest.approx(tflops, rel=1e-3)  # printed to 4 significant digits
      assert float(printed[name][0]) == pytest.approx(row["tokens_per_s"], rel=1e-3)
    else:
      # Both decode rows: each step gives one token of each of the batch's rows; bytes / time is the bandwidth.
      batch = int(re.search(r"per_device_batch_size=(\d+)", report["decoding"]).group(1))
      assert row["tokens_per_s"] * row["step_ms"] / 1e3 == pytest.approx(batch, rel=1e-6)
      assert row["bandwidth_gbps"] * row["step_ms"] * 1e6 == pytest.approx(row["bytes_per_step"], rel=1e-9)
      # float32 parameters on the CPU, then a KV cache of at least every row's max_target_length (bf16 k and v).
      length = int(re.search(r" max_target_length=(\d+)", report["decoding"]).group(1))
      kv_per_token = 2 * s["N"] * s["KV"] * s["D"] * 2
      kv = row["bytes_per_step"] - 4 * all_params(s)
      assert kv >= batch * length * kv_per_token and kv % kv_per_token == 0, (kv, kv_per_token)


@pytest.mark.slow
def test_no_row_starts_past_the_time_budget(tmp_path):
  """About 3 s. --total-s 0: every row is skipped (out of time, or cuDNN's reason first), nothing fails, exit 0."""
  out = tmp_path / "gpu_check.json"
  proc = run(["--quick", "--total-s", "0", "--json", str(out)], {"JAX_PLATFORMS": "cpu", "M_JAX_CACHE_DIR": ""})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
  assert list(rows) == list(gpu_check().ROWS)
  for name, row in rows.items():
    expected = "cuDNN" if name in CUDNN_ROWS else "out of time (--total-s)"
    assert row["status"] == "skipped" and expected in row["reason"] and row["tokens_per_s"] is None, row


@pytest.mark.slow
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path):
  """About 3 s. Without --quick on a machine without a GPU: one line on stdout, nothing measured, exit 0."""
  out = tmp_path / "gpu_check.json"
  proc = run(["--json", str(out)], {"JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.splitlines()
  assert len(lines) == 1 and lines[0].startswith("SKIPPED: gpu_check needs an NVIDIA GPU"), proc.stdout
  assert "--quick" in lines[0]
  assert json.loads(out.read_text())["skipped"] in lines[0]


def test_gpu_plan_configs_are_valid_and_count_the_model_flops():
  """The GPU rows' commands are valid configs (no GPU needed to check them), of the ~1B model whose FLOPs per token
  metrics.training_flops_per_device counts as the formula written out here."""
  module = gpu_check()
  p = module.Plan(False, module.MODEL, module.TRAIN, module.DECODE, 3, 15.0, 5, 500, 420.0)
  commands = module.commands(p, "gpu")
  assert set(commands) == set(module.ROWS)
  s = shapes(module.MODEL + " " + module.TRAIN)
  for name, command in commands.items():
    script = "MaxText/train.py" if name.startswith("train") else "MaxText/inference_microbenchmark.py"
    assert command.startswith(f"python3 {script} MaxText/configs/base.yml "), command
    config = load(command)
    assert config.hardware == "gpu" and config.emb_dim == 2048 and config.num_decoder_layers == 16
    if name.startswith("train"):
      assert config.dataset_type == "synthetic" and config.max_target_length == 2048
      assert config.quantization == ("fp8" if "fp8" in name else "")
      assert config.attention == name.split()[-1]
      flops = metrics.training_flops_per_device(config)
      tokens = config.per_device_batch_size * config.max_target_length
      assert flops.total / tokens == pytest.approx(flops_per_token(s), rel=1e-12)
  # ~1B parameters: counted from the shapes, and by the model's own abstract init.
  config = load(commands["train bf16 dot_product"])
  assert metrics.count_params(state_lib.abstract_params(config)) == all_params(s)
  assert 0.9e9 < all_params(s) < 1.0e9
