"""cli.py: exit codes and one-line errors for each kind of failure, config loading, JAX set-up, and every entry
point run as a file."""

import json
import os
import sys

import jax
import pytest
import yaml

from MaxText import cli, pyconfig, storage
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, deadline, overrides, run

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


def test_the_resolved_config_loads_back_as_the_same_config(tmp_path):
  """config.yml is a config file: loaded back on the same devices it gives the run's config, every key and derived
  value equal, a preset key the run overrode included (a preset's keys would override a file's: model_name is
  written as 'default'); its derived values, listed as comments, are the run's."""
  cfg = config("steps=7", "mlp_activations=['gelu','linear']", "base_emb_dim=48", "ici_fsdp_parallelism=-1",
               override_model_config="true", num_devices=4)  # fmt: skip
  cli.write_resolved_config(cfg, str(tmp_path / "run"))
  path = tmp_path / "run" / "config.yml"
  again = pyconfig.load([str(path)], num_devices=4, env={})
  assert {**again.as_dict(), "model_name": "tiny"} == cfg.as_dict()
  assert again.emb_dim == 48 and again.steps == 7 and again.mlp_activations == ("gelu", "linear")
  written = yaml.safe_load(path.read_text())
  assert written["ici_fsdp_parallelism"] == -1 and "mesh_shape" not in written  # as given; derived ones are comments
  derived = cli.read_derived(path.read_text())
  assert derived["mesh_shape"] == list(cfg.mesh_shape) and derived["num_devices"] == 4 and derived["emb_dim"] == 48
  assert set(derived) | set(written) == set(cfg.as_dict())
  keyed = config(server_api_key="s3cret")  # serve.py's secret is never written to disk
  cli.write_resolved_config(keyed, str(tmp_path / "keyed"))
  text = (tmp_path / "keyed" / "config.yml").read_text()
  assert "s3cret" not in text and yaml.safe_load(text)["server_api_key"] == "", text


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


def _one_line_exit_2(capsys, argv, writes_run_dir=True) -> str:
  """Runs `argv` through run_cli with a body that must not be reached; returns the one `error: ` line."""
  called = []
  code, out = _run(called.append, capsys, argv=argv, writes_run_dir=writes_run_dir)
  lines = out.err.strip().splitlines()
  assert code == 2 and not called and len(lines) == 1 and lines[0].startswith("error: "), out
  return lines[0]


def test_a_metrics_file_that_is_not_one_is_refused_and_left_as_it_was(tmp_path, capsys):
  """Before: JSON lines were appended to a copy of /etc/passwd given as metrics_file."""
  passwd = tmp_path / "passwd"
  passwd.write_text("root:x:0:0:root:/root:/bin/bash\nbin:x:1:1:bin:/bin:/usr/sbin/nologin\n")
  arrays = tmp_path / "arrays.jsonl"
  arrays.write_text('{"step": 0}\n[1, 2]\n')  # JSON, but line 2 is no object.
  out = tmp_path / "out"
  for path, line in ((passwd, 1), (arrays, 2)):
    before = path.read_bytes()
    err = _one_line_exit_2(capsys, ["prog", BASE_YML, *overrides(f"base_output_directory={out}", f"metrics_file={path}")])
    assert err == (
      f"error: metrics_file={path} exists and is not a metrics file (its line {line} is not a JSON object); pass a new "
      "path, or the metrics_file of the run you resume"
    )
    assert path.read_bytes() == before and not out.exists()


def test_a_metrics_file_written_by_a_run_is_accepted_to_resume_even_cut_short(tmp_path, capsys):
  """A run's own metrics file (its step lines and goodput line), and the same with a last line cut short by a
  kill, pass the check; a run then appends to it."""
  from MaxText import train

  metrics_file = tmp_path / "m.jsonl"
  common = (f"base_output_directory={tmp_path}/out", f"metrics_file={metrics_file}")
  assert train.main(["train.py", BASE_YML, *overrides(*common, "steps=2")]) == 0
  lines = metrics_file.read_text().splitlines()
  assert len(lines) >= 3 and all(isinstance(json.loads(line), dict) for line in lines)
  cli.check_metrics_file(str(metrics_file))
  with open(metrics_file, "a", encoding="utf-8") as f:
    f.write('{"step": 2, "learning/lo')  # killed while writing
  cli.check_metrics_file(str(metrics_file))
  assert train.main(["train.py", BASE_YML, *overrides(*common, "run_name=second", "steps=1")]) == 0
  text = metrics_file.read_text()
  assert text.startswith("\n".join(lines)) and '{"step": 2, "learning/lo\n' in text and text.count('"step": 0,') == 2
  # The cut record now stands mid-file, its line ended by the resumed run: the next start still accepts the file.
  assert train.main(["train.py", BASE_YML, *overrides(*common, "run_name=third", "steps=1")]) == 0
  assert metrics_file.read_text().count('"step": 0,') == 3


def test_outputs_that_are_fifos_or_devices_are_refused_without_opening_them(tmp_path, capsys):
  """Opening a FIFO to append waits for a reader for ever; the check only stats it."""
  os.mkfifo(tmp_path / "fifo")
  out = tmp_path / "out"
  for key, path, kind in [
    ("metrics_file", tmp_path / "fifo", "a FIFO"),
    ("metrics_file", "/dev/zero", "a character device"),
    ("base_output_directory", tmp_path / "fifo", "a FIFO"),
  ]:
    argv = ["prog", BASE_YML, *overrides(f"base_output_directory={out}", f"{key}={path}")]
    with deadline(20):  # (opening the FIFO would wait for a writer for ever)
      err = _one_line_exit_2(capsys, argv)
    wanted = "a folder" if key == "base_output_directory" else "a regular file"
    assert err == f"error: {key}={path} is {kind}; pass the path of {wanted}"
  assert not out.exists()


def test_a_jax_cache_dir_that_is_a_file_is_refused(tmp_path, capsys):
  """Before: JAX silently ran without its cache."""
  a_file = tmp_path / "a_file"
  a_file.write_text("keep me")
  for path, message in [
    (a_file, f"jax_cache_dir={a_file} is a file; pass the path of a folder"),
    (a_file / "cache", f"jax_cache_dir={a_file / 'cache'}: {a_file} is a file, so no folder can be made there"),
  ]:
    argv = ["prog", BASE_YML, *overrides(f"jax_cache_dir={path}")]
    assert _one_line_exit_2(capsys, argv, writes_run_dir=False).startswith(f"error: {message}")
  assert a_file.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["a_file"]


def test_a_compiled_trainstep_file_that_cannot_be_a_file_is_refused_before_compiling(tmp_path, capsys):
  """Before: train_compile.py compiled for a minute, then failed and left a .partial file beside the folder."""
  from MaxText import train_compile

  (tmp_path / "a_folder").mkdir()
  (tmp_path / "a_file").write_text("keep me")
  for path, message in [
    (tmp_path / "a_folder", f"compiled_trainstep_file={tmp_path / 'a_folder'} is a folder; pass the path of a regular file"),
    (tmp_path / "a_file" / "step.bin", f"{tmp_path / 'a_file'} is a file, so no folder can be made there"),
  ]:
    argv = ["train_compile.py", BASE_YML, *overrides(f"compiled_trainstep_file={path}")]
    assert train_compile.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err
  assert sorted(os.listdir(tmp_path)) == ["a_file", "a_folder"] and not os.listdir(tmp_path / "a_folder")


def test_an_error_line_is_one_line_and_capped(capsys):
  def body(config):
    raise ConfigError("first\nsecond " + "x" * 1_000_000)

  code, out = _run(body, capsys)
  assert code == 2 and out.err.count("\n") == 1 and out.err.startswith("error: first second xxx")
  assert len(out.err) < cli.ERROR_LINE_CHARS + 100 and out.err.endswith(f"... ({1_000_013} characters)\n")


def test_remote_paths_are_checked_with_storage_check_access_before_anything_is_written(tmp_path, capsys, monkeypatch):
  """base_output_directory and metrics_file on a bucket are checked for writing, the load paths for reading, each
  before the body (storage.check_access itself, against a bucket, is tested in gcs_test.py)."""
  calls = []

  def check_access(key, url, write):
    calls.append((key, url, write))
    if url.startswith("gs://denied"):
      raise ConfigError(f"{key}={url}: no access to bucket denied")

  monkeypatch.setattr(storage, "check_access", check_access)
  argv = ["prog", BASE_YML, *overrides("base_output_directory=gs://ok/runs", "metrics_file=gs://ok/m.jsonl")]
  argv += ["load_parameters_path=gs://ok/ckpt/0/items"]
  seen = []
  assert _run(seen.append, capsys, argv=argv, writes_run_dir=True)[0] == 0 and len(seen) == 1
  assert calls == [
    ("load_parameters_path", "gs://ok/ckpt/0/items", False),
    ("base_output_directory", "gs://ok/runs", True),
    ("metrics_file", "gs://ok/m.jsonl", True),
  ]
  calls.clear()
  assert _run(seen.append, capsys, argv=argv, writes_run_dir=False)[0] == 0  # No run folder: only the load path.
  assert calls == [("load_parameters_path", "gs://ok/ckpt/0/items", False)]
  for denied in ("base_output_directory=gs://denied/runs", "load_full_state_path=gs://denied/c/0/items"):
    argv = ["prog", BASE_YML, *overrides(f"base_output_directory={tmp_path}/out", denied)]
    assert _one_line_exit_2(capsys, argv).startswith(f"error: {denied}: no access to bucket denied")
  assert not os.path.exists(tmp_path / "out")


def test_a_writer_thread_that_fails_again_at_exit_is_not_echoed():
  """A failed run's writer thread (Orbax's) that is still running as the process exits fails again on the executors
  Python has shut down; its log record and its exception are echoes of the reported failure, not new lines."""
  code = """
import concurrent.futures, logging, sys, threading, time
from absl import logging as absl_logging
from MaxText import cli
pool = concurrent.futures.ThreadPoolExecutor(1)
def writer():
  time.sleep(0.5)  # until Python shuts the executors down and joins this thread
  try:
    pool.submit(print)
  except RuntimeError:
    absl_logging.exception("the writer failed")
    logging.getLogger("asyncio").exception("Task exception was never retrieved")
    raise
def body(config):
  threading.Thread(target=writer).start()
  raise cli.TrainingError("no space left on device")
sys.exit(cli.run_cli(body, sys.argv))
"""
  proc = run([sys.executable, "-c", code, BASE_YML, *overrides()], {**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=120)
  assert proc.returncode == 1 and proc.stderr == "error: no space left on device\n", proc.stderr


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs procfs")
def test_an_output_under_proc_is_a_virtual_file_system_not_a_full_disk(capsys):
  """/proc has no blocks (0 bytes total, 0 free): a path there is refused as what it is. It was reported as "no space
  left on the device", which sends the user looking for disk space."""
  with pytest.raises(ConfigError, match=r"^save_quantized_params_path=/proc/q: /proc is on a virtual file system"):
    cli.check_writable("save_quantized_params_path", "/proc/q", folder=True)
  from MaxText import decode

  args = overrides("quantization=int8w", "save_quantized_params_path=/proc/maxtext_quantized")
  assert decode.main(["decode.py", BASE_YML, *args]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "virtual file system" in err and "no space" not in err, err
