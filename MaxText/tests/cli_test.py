"""cli.py: exit codes and one-line errors for each kind of failure, config loading, JAX set-up, and every entry
point run as a file."""

import json
import os
import sys

import jax
import pytest
import yaml

from MaxText import cli, pyconfig
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, overrides, run

ARGV = ["prog", BASE_YML, *overrides()]


def _run(body, capsys, argv=ARGV, **kw):
  code = cli.run_cli(body, argv, **kw)
  return code, capsys.readouterr()


def test_config_error_is_exit_2_and_one_line(capsys):
  def body(config):
    raise ConfigError(f"steps={config.steps} is wrong; try another")

  code, out = _run(body, capsys)
  assert code == 2 and out.err == "error: steps=20 is wrong; try another\n" and out.out == ""


def test_training_error_is_exit_1_and_one_line(capsys):
  def body(config):
    raise cli.TrainingError("loss=nan after step 3; lower learning_rate")

  code, out = _run(body, capsys)
  assert code == 1 and out.err == "error: loss=nan after step 3; lower learning_rate\n"


def test_a_bug_keeps_its_traceback_in_a_single_process():
  def body(config):
    raise KeyError("a bug")

  with pytest.raises(KeyError, match="a bug"):
    cli.run_cli(body, ARGV)


@pytest.mark.parametrize("returned, code", [(None, 0), (0, 0), (3, 3), ({"a": "summary"}, 0)])
def test_the_body_result_is_the_exit_code_when_it_is_an_int(returned, code, capsys):
  assert _run(lambda config: returned, capsys)[0] == code


def test_a_mistake_in_the_command_line_never_reaches_the_body(capsys):
  called = []
  code, out = _run(called.append, capsys, argv=["prog", BASE_YML, *overrides("steps=ten")])
  assert code == 2 and not called and out.err.startswith("error: steps='ten' is not an integer")


def test_run_name_is_demanded_only_by_scripts_that_write_a_run_directory(capsys):
  argv = ["prog", BASE_YML, *overrides("run_name=")]
  seen = []
  code, out = _run(seen.append, capsys, argv=argv, writes_run_dir=True)
  assert code == 2 and not seen and "run_name is empty" in out.err
  assert _run(seen.append, capsys, argv=argv)[0] == 0 and seen[0].run_name == ""


def test_unwritable_outputs_are_refused_before_anything_is_written(tmp_path, capsys):
  """A file as base_output_directory (or in its way), a folder as metrics_file, a read-only folder: exit 2 with
  one line naming the key, and neither the run folder nor the metrics file is created."""
  a_file = tmp_path / "a_file"
  a_file.write_text("keep me")
  (tmp_path / "a_folder").mkdir()
  out = tmp_path / "out"
  cases = [
    ([f"base_output_directory={a_file}"], "base_output_directory=" + str(a_file) + " is a file"),
    ([f"base_output_directory={a_file}/runs"], f"{a_file} is a file, so no folder can be made there"),
    ([f"base_output_directory={out}", f"metrics_file={tmp_path}/a_folder"], "metrics_file=" + str(tmp_path / "a_folder")),
    ([f"base_output_directory={out}", f"metrics_file={a_file}/m.jsonl"], "metrics_file="),
  ]
  if os.geteuid() != 0:  # Permissions do not bind root.
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o500)
    cases.append(([f"base_output_directory={read_only}/runs"], f"{read_only} is not writable"))
  for args, message in cases:
    called = []
    code, captured = _run(called.append, capsys, argv=["prog", BASE_YML, *overrides(*args)], writes_run_dir=True)
    assert code == 2 and not called, captured
    assert len(captured.err.strip().splitlines()) == 1 and message in captured.err, captured.err
  assert a_file.read_text() == "keep me" and not out.exists()
  made = sorted(p.name for p in tmp_path.iterdir())
  assert made == sorted(["a_file", "a_folder", *(["read_only"] if os.geteuid() else [])])


def test_configure_jax_sets_the_platform_of_the_hardware_unless_jax_platforms_is_set(monkeypatch):
  updates = {}
  monkeypatch.setattr(jax.config, "update", updates.__setitem__)
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  cli.configure_jax({"hardware": "gpu", "jax_cache_dir": ""})
  assert updates == {"jax_platforms": "cuda"}
  updates.clear()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  cli.configure_jax({"hardware": "tpu", "jax_cache_dir": "~/cache"})
  assert updates["jax_compilation_cache_dir"] == os.path.expanduser("~/cache") and "jax_platforms" not in updates


def test_the_resolved_config_is_written_as_it_was_resolved(tmp_path):
  cfg = config("steps=7", "mlp_activations=['gelu','linear']", override_model_config="true")
  cli.write_resolved_config(cfg, str(tmp_path / "run"))
  with open(tmp_path / "run" / "config.yml", encoding="utf-8") as f:
    written = yaml.safe_load(f)
  assert written == cfg.as_dict() and written["steps"] == 7 and written["mlp_activations"] == ["gelu", "linear"]


# Every entry point, run as a file: the script path preamble (MaxText/script_path.py, and its link in tests/)
# makes `import MaxText` work, and a config mistake is exit code 2 with one line.
ENTRY_POINTS = [
  "MaxText/train.py",
  "MaxText/decode.py",
  "MaxText/convert_hf_checkpoint.py",
  "MaxText/convert_to_hf_checkpoint.py",
  "MaxText/generate_param_only_checkpoint.py",
  "MaxText/inference_microbenchmark.py",
  "MaxText/standalone_dataloader.py",
  "MaxText/train_compile.py",
  "MaxText/tests/forward_pass_logit_checker.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_every_entry_point_runs_as_a_file_and_exits_2_on_a_config_mistake(script, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ""}
  # Run from tmp_path, not the repository root: the script must find the package itself.
  proc = run([sys.executable, os.path.join(REPO_ROOT, script), str(tmp_path / "missing.yml")], env, 120, cwd=tmp_path)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "missing.yml" in proc.stderr


def test_gpu_flags_are_added_unless_the_user_set_them():
  flags = cli.with_gpu_flags("--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/d")
  assert flags.split()[:2] == ["--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_dump_to=/tmp/d"]
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
  assert "--xla_gpu_enable_while_loop_double_buffering=true" in flags.split()
  assert len(flags.split()) == 2 + len(cli.GPU_XLA_FLAGS) - 1


def test_nvidia_llama2_7b_command_is_accepted_key_for_key(tmp_path):
  """end_to_end/gpu/llama2_7b_1node.sh (NVIDIA's seed command) resolves on 8 devices: every key exists."""
  fake_python = tmp_path / "python"
  fake_python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\"\n")
  fake_python.chmod(0o755)
  script = os.path.join(REPO_ROOT, "end_to_end", "gpu", "llama2_7b_1node.sh")
  result = run(["bash", script, "log_period=5"], env={**os.environ, "PYTHON": str(fake_python), "STEPS": "5"})
  assert result.returncode == 0, result.stderr
  argv = json.loads(result.stdout)
  assert argv[0] == "MaxText/train.py"
  config = pyconfig.load([os.path.join(REPO_ROOT, argv[1]), *argv[2:]], num_devices=8, env={})
  assert (config.model_name, config.hardware, config.attention, config.steps) == ("llama2-7b", "gpu", "dot_product", 5)
  assert config.use_iota_embed and not config.logits_dot_in_fp32 and config.remat_policy == "minimal"
  assert config.global_batch_size == 16 and config.max_target_length == 4096
