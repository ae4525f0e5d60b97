"""The train step and the loop: gradient accumulation, resume exactness, checkpoints across meshes."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from MaxText import compiled_step, train
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.objectives import losses as losses_lib
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, flip_a_stored_bit, run
from MaxText.tests.helpers import overrides as overrides_of


def _losses(summary):
  return np.array([loss for _, loss in summary.losses])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cross_entropy_equals_a_float64_reference(dtype):
  """losses.cross_entropy (custom gradient, no float32 copy of the logits) against NumPy in float64 on the same
  (dtype-rounded) logits: the per-token values and the gradient of a weighted sum, whose zero weights stand for
  padding. The gradient is returned in the logits' dtype, so bfloat16 carries its own rounding (2^-8 relative)."""
  rng = np.random.default_rng(0)
  logits = jax.numpy.asarray(rng.normal(0, 4, (2, 5, 37)), dtype)
  targets = rng.integers(0, 37, (2, 5))
  weights = rng.uniform(0, 1, (2, 5)) * (rng.uniform(size=(2, 5)) > 0.3)
  values, grad = jax.value_and_grad(lambda x: jax.numpy.sum(weights * losses_lib.cross_entropy(x, targets)))(logits)

  x = np.asarray(logits.astype("float32"), np.float64)
  lse = np.log(np.sum(np.exp(x - x.max(-1, keepdims=True)), -1)) + x.max(-1)
  xent = lse - np.take_along_axis(x, targets[..., None], -1)[..., 0]
  softmax = np.exp(x - lse[..., None])
  expected_grad = weights[..., None] * (softmax - (np.arange(37) == targets[..., None]))
  assert grad.dtype == logits.dtype
  np.testing.assert_allclose(np.asarray(losses_lib.cross_entropy(logits, targets)), xent, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(float(values), np.sum(weights * xent), rtol=1e-6)
  grad_tol = 1e-6 if dtype == "float32" else 2**-8
  np.testing.assert_allclose(np.asarray(grad.astype("float32")), expected_grad, rtol=grad_tol, atol=grad_tol * 1e-2)


@pytest.mark.mesh
def test_gradient_accumulation_equals_one_big_batch():
  """4 micro-batches of 2 rows give the same losses and update as one batch of 8 rows (float32)."""
  common = ("steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "ici_fsdp_parallelism=2")
  big = config(*common, "per_device_batch_size=4", num_devices=2)
  accumulated = config(*common, "per_device_batch_size=1", "gradient_accumulation_steps=4", num_devices=2)
  assert big.global_batch_size == accumulated.global_batch_size == 8
  devices = jax.devices()[:2]
  np.testing.assert_allclose(_losses(train.train(accumulated, devices)), _losses(train.train(big, devices)), rtol=1e-5)


def _run_cli(tmp_path, *args, wait=True):
  args = [
    sys.executable,
    "MaxText/train.py",
    BASE_YML,
    *overrides_of("enable_checkpointing=true", f"base_output_directory={tmp_path}", *args),
  ]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  if not wait:  # Output to a file: an unread pipe could fill and stall the run.
    with open(f"{tmp_path}/background.log", "w", encoding="utf-8") as log:
      return subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  out, err = proc.communicate(timeout=300)
  return proc.returncode, out, err


def _metrics(path):
  """The step records of a metrics file (not the goodput reports at the end of each run)."""
  with open(path, encoding="utf-8") as f:
    return [record for record in map(json.loads, f) if "step" in record]


# Slow enough per step (~10 ms) that a kill lands mid-run; 2 devices, async saves every 10 steps.
KILL_RUN = ("max_target_length=128", "per_device_batch_size=4", "steps=120", "checkpoint_period=10", "log_period=1")


@pytest.mark.slow
@pytest.mark.parametrize(
  "optimizer",
  [
    (),
    ("opt_type=muon", "lr_schedule_type=wsd", "mu_dtype=bfloat16"),
    ("opt_type=adam_pax",),
    ("opt_type=sgd", "lr_schedule_type=wsd", "wsd_decay_style=cosine"),
    ("opt_type=adafactor",),
  ],
  ids=["adamw", "muon_wsd", "adam_pax", "sgd_wsd_cosine", "adafactor"],
)
def test_kill_9_and_resume_reproduces_the_uninterrupted_losses(tmp_path, optimizer):
  """A run killed with SIGKILL mid-way resumes from its last complete checkpoint with the uninterrupted run's
  losses, for every optimizer (opt_type) and both schedules: AdamW and cosine (the defaults), Muon with
  warmup-stable-decay and a bfloat16 first moment, adam_pax, SGD with a cosine wsd decay, Adafactor."""
  run = (*KILL_RUN, *optimizer)
  rc, _, err = _run_cli(tmp_path, "run_name=straight", *run, f"metrics_file={tmp_path}/straight.jsonl")
  assert rc == 0, err
  straight = {m["step"]: m["learning/loss"] for m in _metrics(tmp_path / "straight.jsonl")}
  assert sorted(straight) == list(range(120))
  for key in (
    "learning/loss",
    "learning/grad_norm",
    "learning/current_learning_rate",
    "perf/step_time_seconds",
    "perf/per_device_tflops_per_sec",
    "perf/per_device_tokens_per_sec",
  ):
    assert key in _metrics(tmp_path / "straight.jsonl")[0]

  metrics_file = tmp_path / "killed.jsonl"
  proc = _run_cli(tmp_path, "run_name=killed", *run, f"metrics_file={metrics_file}", wait=False)
  checkpoints = tmp_path / "killed" / "checkpoints"
  deadline = time.time() + 120
  while time.time() < deadline and not (checkpoints / "30").is_dir():
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate()
  killed_at = len(_metrics(metrics_file))
  assert killed_at < 120, "the run finished before it was killed; the test needs slower steps"

  rc, out, err = _run_cli(tmp_path, "run_name=killed", *run, f"metrics_file={metrics_file}")
  assert rc == 0, err
  assert "resumed from" in out
  records = _metrics(metrics_file)
  resumed = records[killed_at:]
  assert resumed[0]["step"] % 10 == 0 and resumed[0]["step"] <= killed_at
  assert resumed[-1]["step"] == 119
  for m in resumed:
    assert m["learning/loss"] == straight[m["step"]], f"step {m['step']} differs after resume"


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_sigterm_or_sigint_saves_after_the_step_and_the_rerun_resumes_exactly(tmp_path, sig):
  """A preemption notice or Ctrl-C: the step in progress finishes, a checkpoint is saved (none is due before step
  1000 here), exit 1 with one line; the same command then resumes with the uninterrupted run's losses."""
  run_args = ("max_target_length=128", "per_device_batch_size=4", "steps=300", "checkpoint_period=1000", "log_period=1")
  rc, _, err = _run_cli(tmp_path, "run_name=straight", *run_args, f"metrics_file={tmp_path}/straight.jsonl")
  assert rc == 0, err
  straight = {m["step"]: m["learning/loss"] for m in _metrics(tmp_path / "straight.jsonl")}

  metrics_file = tmp_path / "stopped.jsonl"
  proc = _run_cli(tmp_path, "run_name=stopped", *run_args, f"metrics_file={metrics_file}", wait=False)
  deadline = time.time() + 120
  while time.time() < deadline and (not metrics_file.exists() or len(metrics_file.read_text().splitlines()) < 3):
    time.sleep(0.01)
  os.kill(proc.pid, getattr(signal, sig))
  assert proc.wait(timeout=120) == 1
  log = (tmp_path / "background.log").read_text()
  what = "preempted" if sig == "SIGTERM" else "interrupted"
  # The signal lands in a step (saved after it) or in the wait for a step's data (saved before it).
  after = re.search(rf"error: {what} \({sig}\) after step (\d+); checkpoint (\d+) is saved", log)
  waiting = re.search(rf"error: {what} \({sig}\) while waiting for the data of step (\d+); checkpoint (\d+) is saved", log)
  stopped = after or waiting
  assert stopped and int(stopped.group(2)) == int(stopped.group(1)) + (1 if after else 0) < 300, log[-2000:]
  assert "Traceback" not in log
  assert os.listdir(tmp_path / "stopped" / "checkpoints") == [stopped.group(2)]

  rc, out, err = _run_cli(tmp_path, "run_name=stopped", *run_args, f"metrics_file={metrics_file}")
  assert rc == 0 and f"resumed from {tmp_path}/stopped/checkpoints/{stopped.group(2)}" in out, err
  resumed = _metrics(metrics_file)[int(stopped.group(2)) :]
  assert [m["step"] for m in resumed] == list(range(int(stopped.group(2)), 300))
  assert all(m["learning/loss"] == straight[m["step"]] for m in resumed)


def _du(path) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_full_disk_stops_the_run_with_one_line_and_the_rerun_resumes(tmp_path):
  """A run saving every step onto a tmpfs with room for about two checkpoints: the failed save ends the run at
  once with one line (no thread tracebacks), the complete checkpoints stay restorable, and after the disk is made
  larger the same command resumes from the newest of them and finishes."""
  run_args = ("steps=12", "checkpoint_period=1", "max_num_checkpoints_to_keep=0", f"metrics_file={tmp_path}/m.jsonl")
  rc, _, err = _run_cli(tmp_path, "run_name=measure", "steps=1", "checkpoint_period=1")
  assert rc == 0, err
  checkpoint_bytes = _du(tmp_path / "measure" / "checkpoints" / "1")
  disk = tmp_path / "disk"
  disk.mkdir()
  size_kib = (checkpoint_bytes * 5 // 2 + 2**18) // 1024
  subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(disk)], check=True)
  try:
    rc, out, err = _run_cli(tmp_path, "run_name=full", *run_args, f"base_output_directory={disk}")
    assert rc == 1, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"no space left on device for a checkpoint in {disk}/full/checkpoints (it needs about" in err, err
    complete = sorted(int(n) for n in os.listdir(disk / "full" / "checkpoints") if n.isdigit())
    assert complete and complete == list(range(complete[0], complete[-1] + 1)) and complete[-1] < 12, complete
    assert f"run the same command again to resume from checkpoint {complete[-1]}" in err

    subprocess.run(["mount", "-o", f"remount,size={size_kib * 8}k", str(disk)], check=True)
    rc, out, err = _run_cli(tmp_path, "run_name=full", *run_args, f"base_output_directory={disk}")
    assert rc == 0, err
    assert f"resumed from {disk}/full/checkpoints/{complete[-1]}" in out
    assert 12 in [int(n) for n in os.listdir(disk / "full" / "checkpoints") if n.isdigit()]
  finally:
    subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.slow
def test_interrupted_save_is_never_taken_as_a_checkpoint(tmp_path):
  rc, _, err = _run_cli(tmp_path, "run_name=r", "steps=4", "checkpoint_period=2")
  assert rc == 0, err
  checkpoints = tmp_path / "r" / "checkpoints"
  # What a save cut short leaves behind: Orbax's temporary folder, not yet renamed to its step.
  partial = checkpoints / "6.orbax-checkpoint-tmp-1234567"
  partial.mkdir()
  (partial / "items").mkdir()
  rc, out, err = _run_cli(tmp_path, "run_name=r", "steps=6", "checkpoint_period=2")
  assert rc == 0, err
  assert f"resumed from {checkpoints}/4" in out
  assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "6"]


@pytest.mark.slow
def test_restore_on_another_mesh(tmp_path):
  """A checkpoint written under fsdp=8 resumes under fsdp=4 x tensor=2 with the uninterrupted losses."""
  common = (
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "per_device_batch_size=1",
    "enable_checkpointing=true",
    "async_checkpointing=false",
    f"base_output_directory={tmp_path}",
    "checkpoint_period=2",
    "learning_rate_schedule_steps=4",
  )
  straight = _losses(train.train(config(*common, "run_name=a", "steps=4", "ici_fsdp_parallelism=8", num_devices=8)))
  train.train(config(*common, "run_name=b", "steps=2", "ici_fsdp_parallelism=8", num_devices=8))
  resumed = train.train(
    config(*common, "run_name=b", "steps=4", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", num_devices=8)
  )
  assert resumed.first_step == 2
  np.testing.assert_allclose(_losses(resumed), straight[2:], rtol=1e-5)


@pytest.mark.slow
def test_load_parameters_then_fresh_optimizer(tmp_path):
  common = ("enable_checkpointing=true", "async_checkpointing=false", f"base_output_directory={tmp_path}")
  train.train(config(*common, "run_name=src", "steps=3", "learning_rate=1e-2", num_devices=1), jax.devices()[:1])
  path = f"{tmp_path}/src/checkpoints/3/items"
  loaded = train.train(
    config(*common, "run_name=dst", "steps=1", f"load_parameters_path={path}", num_devices=1), jax.devices()[:1]
  )
  fresh = train.train(config(*common, "run_name=dst2", "steps=1", num_devices=1), jax.devices()[:1])
  assert loaded.first_step == 0 and _losses(loaded)[0] < _losses(fresh)[0]
  full = train.train(
    config(*common, "run_name=dst3", "steps=4", f"load_full_state_path={path}", num_devices=1), jax.devices()[:1]
  )
  assert full.first_step == 3


@pytest.mark.slow
def test_incompatible_checkpoint_exits_2_and_keeps_it(tmp_path):
  rc, _, err = _run_cli(tmp_path, "run_name=r", "steps=2")
  assert rc == 0, err
  before = sorted(os.listdir(tmp_path / "r" / "checkpoints"))
  rc, out, err = _run_cli(tmp_path, "run_name=r", "steps=4", "base_emb_dim=48", "override_model_config=true")
  assert rc == 2 and "stores params" in err and "Traceback" not in err, err
  assert len(err.strip().splitlines()) == 1
  assert sorted(os.listdir(tmp_path / "r" / "checkpoints")) == before


@pytest.mark.slow
def test_nan_loss_stops_with_one_line(tmp_path):
  rc, _, err = _run_cli(
    tmp_path,
    "run_name=nan",
    "steps=5",
    "learning_rate=1e30",
    "gradient_clipping_threshold=0",
    "adam_eps=0",
    "adam_eps_root=0",
    "checkpoint_period=1",
  )
  assert rc == 1 and "nan" in err and "learning_rate" in err and "Traceback" not in err, err
  assert len(err.strip().splitlines()) == 1
  bad_step = int(re.search(r"after step (\d+)", err).group(1))
  # Checkpoint <n> holds the state after n steps: only states from before the bad step may be saved.
  checkpoints = tmp_path / "nan" / "checkpoints"  # Made by the first save: none if the first step failed.
  saved = [int(name) for name in os.listdir(checkpoints)] if checkpoints.is_dir() else []
  assert all(n <= bad_step for n in saved), (saved, bad_step)


def test_cadence_logs_evaluates_and_saves_when_the_config_says():
  """After which completed steps the loop logs (every log_period, the first and the last), evaluates and saves."""
  cfg = config("steps=20", "log_period=5", "eval_interval=8", "eval_steps=1", "checkpoint_period=6")
  cadence = train.Cadence(cfg, first_step=3, checkpointing=True)
  assert [n for n in range(4, 21) if cadence.log(n)] == [4, 5, 10, 15, 20]
  assert [n for n in range(4, 21) if cadence.evaluate(n)] == [8, 16, 20]
  assert [n for n in range(4, 21) if cadence.save(n, preempted=False)] == [6, 12, 18, 20]
  assert cadence.save(7, preempted=True) and not train.Cadence(cfg, 3, checkpointing=False).save(6, preempted=True)
  assert not any(train.Cadence(cfg.replace(eval_interval=-1), 3, True).evaluate(n) for n in range(4, 21))


def test_synthetic_batches_depend_only_on_seed_and_step():
  from MaxText.input_pipeline.synthetic import synthetic_rows

  whole = synthetic_rows(0, 7, range(8), 16, 100)
  halves = [synthetic_rows(0, 7, range(0, 4), 16, 100), synthetic_rows(0, 7, range(4, 8), 16, 100)]
  np.testing.assert_array_equal(whole["inputs"], np.concatenate([h["inputs"] for h in halves]))
  np.testing.assert_array_equal(whole["inputs"][:, 1:], whole["targets"][:, :-1])
  assert not np.array_equal(whole["inputs"], synthetic_rows(0, 8, range(8), 16, 100)["inputs"])


@pytest.mark.slow
def test_cli_entry_points(tmp_path):
  """`python3 MaxText/train.py` and `python3 -m MaxText.train` both run, and train alike: the same losses."""
  rc, out, err = _run_cli(tmp_path, "run_name=s", "steps=2", "enable_checkpointing=false")
  assert rc == 0 and "completed step: 1" in out, err
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  module_args = [
    "-m",
    "MaxText.train",
    BASE_YML,
    *overrides_of("run_name=m", "steps=2", f"base_output_directory={tmp_path}", "enable_checkpointing=false"),
  ]
  proc = run([sys.executable, *module_args], env)
  assert proc.returncode == 0 and "completed step: 1" in proc.stdout, proc.stderr
  losses = [re.findall(r"completed step: (\d+),.* loss: ([\d.]+)", text) for text in (out, proc.stdout)]
  assert len(losses[0]) == 2 and losses[0] == losses[1], losses


@pytest.mark.slow
def test_relative_base_output_directory_checkpoints_where_it_says(tmp_path):
  """NVIDIA's base_output_directory=local_train: resolved against the working directory, the run saves there
  (Orbax refused the relative path at the first save before)."""
  args = [sys.executable, f"{REPO_ROOT}/MaxText/train.py", BASE_YML]
  args += overrides_of("run_name=rel", "steps=2", "checkpoint_period=1", "enable_checkpointing=true")
  proc = run([*args, "base_output_directory=local_train"], {**os.environ, "JAX_PLATFORMS": "cpu"}, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  assert sorted(os.listdir(tmp_path / "local_train" / "rel" / "checkpoints")) == ["1", "2"]
  assert not any(name.endswith("tmp") for name in os.listdir(tmp_path / "local_train" / "rel" / "checkpoints"))


def test_profiler_and_tensorboard_outputs(tmp_path):
  """profiler=xplane leaves a trace of the chosen steps; TensorBoard gets the logged scalars."""
  cfg = config(
    "steps=3",
    "profiler=xplane",
    "skip_first_n_steps_for_profiler=1",
    "profiler_steps=1",
    "enable_tensorboard=true",
    f"base_output_directory={tmp_path}",
  )
  train.train(cfg, jax.devices()[:1])
  tensorboard = tmp_path / "test" / "tensorboard"
  assert list(tensorboard.glob("events.out.tfevents.*")), "no TensorBoard event file"
  assert list(tensorboard.rglob("*.xplane.pb")), "no profiler trace"


def test_reuse_example_batch_trains_on_the_first_batch_every_step():
  """With the learning rate at 0 the params stay put, so the loss changes only with the batch."""
  common = ("steps=3", "learning_rate=0", "max_target_length=16", "per_device_batch_size=1")
  reused = _losses(train.train(config(*common, "reuse_example_batch=1"), jax.devices()[:1]))
  fresh = _losses(train.train(config(*common), jax.devices()[:1]))
  assert reused[0] == fresh[0] and np.all(reused == reused[0])
  assert len(set(fresh.tolist())) == 3


@pytest.mark.slow
def test_a_damaged_checkpoint_is_skipped_and_the_rerun_resumes_from_the_one_before(tmp_path):
  """A bit flipped in the newest checkpoint: the rerun names it, sets it aside as 4.damaged (as it was), resumes
  from the one before with the uninterrupted run's losses and saves step 4 again."""
  common = ("async_checkpointing=false", "checkpoint_period=2", "log_period=1", "learning_rate_schedule_steps=6")
  rc, _, err = _run_cli(tmp_path, "run_name=straight", "steps=6", *common, f"metrics_file={tmp_path}/straight.jsonl")
  assert rc == 0, err
  rc, _, err = _run_cli(tmp_path, "run_name=r", "steps=4", *common)
  assert rc == 0, err
  checkpoints = tmp_path / "r" / "checkpoints"
  flip_a_stored_bit(str(checkpoints / "4"), "params.decoder_norm.scale")
  damaged = {p: p.read_bytes() for p in (checkpoints / "4").rglob("*") if p.is_file()}

  rc, out, err = _run_cli(tmp_path, "run_name=r", "steps=6", *common, f"metrics_file={tmp_path}/resumed.jsonl")
  assert rc == 0, err
  assert f"skipped: checkpoint {checkpoints}/4 is damaged: params.decoder_norm.scale differs from what was saved" in out
  assert f"resumed from {checkpoints}/2 (" in out and "arrays verified)" in out
  assert f"set aside as {checkpoints}/4.damaged" in out and f"saving checkpoint 4 to {checkpoints}" in out
  straight = {m["step"]: m["learning/loss"] for m in _metrics(tmp_path / "straight.jsonl")}
  resumed = _metrics(tmp_path / "resumed.jsonl")
  assert [m["step"] for m in resumed] == [2, 3, 4, 5]
  assert all(m["learning/loss"] == straight[m["step"]] for m in resumed)
  aside = {
    checkpoints / "4" / p.relative_to(checkpoints / "4.damaged"): p.read_bytes()
    for p in (checkpoints / "4.damaged").rglob("*")
    if p.is_file()
  }
  assert aside == damaged
  assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "4.damaged", "6"]


@pytest.mark.parametrize(
  "args, what",
  [
    (("base_emb_dim=40000000", "override_model_config=true"), "the train state (params and optimizer) needs"),
    (("per_device_batch_size=1000000",), "the train step (state, batch and activations) needs"),
  ],
)
@pytest.mark.mesh
def test_a_run_that_cannot_fit_is_refused_before_anything_is_written(tmp_path, args, what):
  """An absurd size is a ConfigError with the figures: the state's size before it is allocated, the compiled step's
  memory analysis before the first file is written (on CPU against the host's RAM, all devices together)."""
  cfg = config(*args, "enable_checkpointing=true", f"base_output_directory={tmp_path}", num_devices=2)
  with pytest.raises(ConfigError) as e:
    train.train(cfg, jax.devices()[:2])
  message = str(e.value)
  assert message.startswith(what) and "GiB per device (" in message and "GiB for the 2 devices of this host)" in message
  assert f"more than this host's {compiled_step.host_memory_bytes() / 2**30:.2f} GiB of RAM; try " in message
  assert os.listdir(tmp_path) == []


def test_memory_check_compares_with_the_memory_there_is(tmp_path, monkeypatch):
  """The same tiny run fits in the host's RAM and is refused, with the figures, when the host has 1 MiB."""
  cfg = config("steps=1", f"base_output_directory={tmp_path}", "enable_checkpointing=true", num_devices=1)
  state_bytes = compiled_step.state_bytes_per_device(step_lib.build(cfg, jax.devices()[:1])[-1].abstract)
  assert 0 < state_bytes < 2**30
  monkeypatch.setattr(compiled_step, "host_memory_bytes", lambda: 2**20)
  with pytest.raises(ConfigError, match=r"needs \d+\.\d\d GiB per device, more than this host's 0\.00 GiB of RAM"):
    train.train(cfg, jax.devices()[:1])
  monkeypatch.setattr(compiled_step, "host_memory_bytes", lambda: state_bytes + 2**10)  # the state fits, the step not
  with pytest.raises(ConfigError, match=r"^the train step \(state, batch and activations\) needs"):
    train.train(cfg, jax.devices()[:1])
  assert os.listdir(tmp_path) == []


def test_goodput_accounts_for_the_wall_time_and_the_steps_trained_again(tmp_path):
  """The report's wall time is the call's; saves and evaluations are counted apart from the steps; a resumed
  run counts the steps an earlier process logged after the checkpoint it resumes from (as after a kill)."""
  common = (
    "enable_checkpointing=true", "async_checkpointing=true", "checkpoint_period=4", "eval_interval=2",
    "eval_steps=1", "learning_rate_schedule_steps=8", f"metrics_file={tmp_path}/m.jsonl",
    f"base_output_directory={tmp_path}",
  )  # fmt: skip
  first_config = config(*common, "steps=4", "log_period=1", num_devices=1)
  before = time.time()
  first = train.train(first_config, jax.devices()[:1])
  elapsed = time.time() - before
  report = first.goodput
  # (That the parts add up to the wall time is metrics.Goodput's construction; metrics_test checks each part
  # against a clock of its own. Here: the wall time is this call's, by the test's clock.)
  assert 0.5 * elapsed < report["goodput/wall_seconds"] <= elapsed
  assert report["goodput/checkpoint_seconds"] > 0 and report["goodput/evaluation_seconds"] > 0
  assert 0 < report["goodput/productive_fraction"] < 1 and report["goodput/recomputed_steps"] == 0
  lines = (tmp_path / "m.jsonl").read_text().splitlines()
  assert json.loads(lines[-1]) == {"goodput": {k.removeprefix("goodput/"): v for k, v in report.items()}}

  # An earlier process got to step 6 after checkpoint 4 and was killed: its records of steps 4-6 are lost work.
  with open(tmp_path / "m.jsonl", "a", encoding="utf-8") as f:
    for step, seconds in ((4, 0.5), (5, 0.7), (6, 0.6)):
      f.write(json.dumps({"step": step, "learning/loss": 1.0, "perf/step_time_seconds": seconds}) + "\n")
    f.write('{"step": 7, "learning/lo')  # the line the kill cut short
  resumed = train.train(config(*common, "steps=8", num_devices=1), jax.devices()[:1])
  assert resumed.first_step == 4
  assert resumed.goodput["goodput/recomputed_steps"] == 3
  assert resumed.goodput["goodput/recomputed_seconds"] == pytest.approx(3 * 0.6)
  lines = (tmp_path / "m.jsonl").read_text().splitlines()
  cut = lines.index('{"step": 7, "learning/lo')  # ended by the resumed run, whose records follow, one per line
  after = [json.loads(line) for line in lines[cut + 1 :]]
  assert after[0]["step"] == 4 and after[-2]["step"] == 7 and "goodput" in after[-1]


def test_each_run_in_a_process_counts_its_own_start(tmp_path, capsys):
  """Three runs in one process, through train() and main(): the goodput wall time and the time to first step of
  the later ones count from their own call (bounded by this test's clock around it), not from when train.py was
  imported, which would add the earlier runs' time to their start-up."""
  common = ("steps=2", "log_period=1", f"base_output_directory={tmp_path}")
  train.train(config(*common, "run_name=first", num_devices=1), jax.devices()[:1])
  before = time.time()
  second = train.train(config(*common, "run_name=second", num_devices=1), jax.devices()[:1])
  elapsed = time.time() - before
  assert 0 < second.goodput["goodput/wall_seconds"] <= elapsed
  assert 0 < second.goodput["goodput/startup_seconds"] < second.time_to_first_step <= elapsed

  capsys.readouterr()
  before = time.time()
  args = overrides_of(*common, "run_name=third", f"metrics_file={tmp_path}/m.jsonl")
  assert train.main(["train.py", BASE_YML, *args]) == 0
  elapsed = time.time() - before
  report = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])["goodput"]
  assert 0 < report["wall_seconds"] <= elapsed
  first_step = re.search(r"time to first step (\d+\.\d) s", capsys.readouterr().out)
  assert first_step and float(first_step[1]) <= elapsed + 0.05  # printed to 0.1 s


def test_resuming_with_another_schedule_says_how_the_rate_changes(tmp_path, capsys):
  """Extending `steps` stretches the cosine schedule (learning_rate_schedule_steps follows steps): the resumed run
  says so, with the rates of the cited formula (optimizers.learning_rate_schedule); the same schedule says nothing."""
  common = ("run_name=r", f"base_output_directory={tmp_path}", "enable_checkpointing=true", "warmup_steps_fraction=0")
  assert train.main(["train.py", BASE_YML, *overrides_of(*common, "steps=2")]) == 0
  capsys.readouterr()
  assert train.main(["train.py", BASE_YML, *overrides_of(*common, "steps=4")]) == 0
  out = capsys.readouterr().out
  peak, final = 3e-4, 3e-5  # base.yml's learning_rate and learning_rate_final_fraction x it

  def cosine(step, total):  # half a cosine from the peak at step 0 to the final rate at step total - 1
    weight = 0.5 * (np.cos(np.pi * step / (total - 1)) + 1)
    return peak * weight + final * (1 - weight)

  assert (
    "warning: the learning-rate schedule differs from this run's last start (learning_rate_schedule_steps 2 -> 4): "
    f"the rate was {cosine(1, 2):.3e} at step 1 and is now {cosine(2, 4):.3e} at step 2, where the earlier schedule "
    f"gives {0.0:.3e}; to keep the earlier schedule, pass learning_rate_schedule_steps=2"
  ) in out, out
  assert train.main(["train.py", BASE_YML, *overrides_of(*common, "steps=6", "learning_rate_schedule_steps=4")]) == 0
  assert "resumed from" in (out := capsys.readouterr().out) and "schedule differs" not in out, out


class _Stalls:
  """A training iterator that stops yielding before batch `at` (a stalled bucket or loader) and has a SIGTERM
  sent to this process once it waits."""

  def __init__(self, iterator, at: int):
    self.iterator, self.at, self.given = iterator, at, 0

  def __next__(self):
    if self.given == self.at:
      threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
      threading.Event().wait(60)
      raise AssertionError("the wait for data was not interrupted")
    self.given += 1
    return next(self.iterator)

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state):
    self.iterator.set_state(state)


def _text_data(tmp_path) -> tuple[str, ...]:
  """Overrides for training on an ArrayRecord file of 200 English documents with a SentencePiece model of them."""
  from array_record.python.array_record_module import ArrayRecordWriter

  from MaxText import train_tokenizer
  from MaxText.tests.input_pipeline_test import _english

  documents = _english(200)
  os.makedirs(tmp_path / "data")
  writer = ArrayRecordWriter(str(tmp_path / "data" / "train.array_record"), "group_size:1")
  for doc in documents:
    writer.write(doc.encode("utf-8"))
  writer.close()
  train_tokenizer.train(documents, vocab_size=400, output=str(tmp_path / "tok.model"))
  return (
    "dataset_type=grain", f"grain_train_files={tmp_path}/data/*", f"tokenizer_path={tmp_path}/tok.model",
    "vocab_size=512", "override_model_config=true", "per_device_batch_size=2",
  )  # fmt: skip


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread")
@pytest.mark.slow  # Its fast sibling: data that runs out takes the same save-and-stop path (below).
def test_sigterm_while_waiting_for_data_saves_and_the_rerun_resumes_exactly(tmp_path, capsys, monkeypatch):
  """A wait for data that never ends is cut short by SIGTERM: the steps done are saved with the data position
  from before the wait, exit 1 with one line; the same command then resumes with the uninterrupted losses."""
  from MaxText import input_pipeline

  common = (*_text_data(tmp_path), "steps=6", "log_period=1", "checkpoint_period=100", "enable_checkpointing=true",
            f"base_output_directory={tmp_path}")  # fmt: skip
  assert (
    train.main(["train.py", BASE_YML, *overrides_of(*common, "run_name=straight", f"metrics_file={tmp_path}/a.jsonl")]) == 0
  )
  straight = {m["step"]: m["learning/loss"] for m in _metrics(tmp_path / "a.jsonl")}
  assert sorted(straight) == list(range(6))
  stalled = (*common, "run_name=stalled", f"metrics_file={tmp_path}/b.jsonl")

  real = input_pipeline.create_iterator
  monkeypatch.setattr(input_pipeline, "create_iterator", lambda *a, **k: _Stalls(real(*a, **k), at=3))
  capsys.readouterr()
  assert train.main(["train.py", BASE_YML, *overrides_of(*stalled)]) == 1
  err = capsys.readouterr().err
  assert err == (
    "error: preempted (SIGTERM) while waiting for the data of step 3; checkpoint 3 is saved: run the same command "
    "again to resume\n"
  ), err
  assert os.listdir(tmp_path / "stalled" / "checkpoints") == ["3"]

  monkeypatch.undo()
  assert train.main(["train.py", BASE_YML, *overrides_of(*stalled)]) == 0
  assert f"resumed from {tmp_path}/stalled/checkpoints/3" in capsys.readouterr().out
  assert {m["step"]: m["learning/loss"] for m in _metrics(tmp_path / "b.jsonl")} == straight


@contextlib.contextmanager
def _small_disk(path, kib: int):
  """A tmpfs of `kib` KiB mounted at `path` (made) for the block."""
  path.mkdir()
  subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)], check=True)
  try:
    yield path
  finally:
    subprocess.run(["umount", str(path)], check=False)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_a_disk_that_fills_during_the_first_save_ends_in_one_line(tmp_path):
  """Another writer fills the disk while the first (async) save runs, so the room check passed: the run ends with
  the one full-disk line; no traceback from Orbax's writer threads, TensorBoard's flush at exit or the metrics
  file on the same disk, and no checkpoint is taken as complete."""
  with _small_disk(tmp_path / "disk", 2048) as disk:
    # At the first save, after the room check, another writer leaves 64 KiB of the disk free.
    code = f"""
import os, sys
from MaxText import checkpointing, train
def another_writer(*_):
  if os.path.exists("{disk}/other"):  # Once: reopening it would free the disk while the first save is in flight.
    return
  with open("{disk}/other", "wb", buffering=0) as f:
    try:
      while True:
        f.write(bytes(4096))
    except OSError:
      f.truncate(max(f.tell() - 65536, 0))
checkpointing.check_room = another_writer
sys.exit(train.main(sys.argv))
"""
    args = overrides_of(
      "run_name=full", f"base_output_directory={disk}", "enable_checkpointing=true", "enable_tensorboard=true",
      "steps=4", "checkpoint_period=1", f"metrics_file={disk}/m.jsonl",
    )  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    proc = run([sys.executable, "-c", code, BASE_YML, *args], env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: no space left on device for a checkpoint in") and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stdout + proc.stderr and "Exception ignored" not in proc.stdout + proc.stderr
    assert not [n for n in os.listdir(disk / "full" / "checkpoints") if n.isdigit()]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a small tmpfs needs root")
def test_an_output_on_a_full_disk_is_refused_before_anything_is_written(tmp_path):
  """metrics_file (or the run folder) on a disk with no room: exit 2 with one line naming it, nothing written
  anywhere (config.yml and TensorBoard's events are written first otherwise)."""
  with _small_disk(tmp_path / "disk", 64) as disk:
    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
      f.write(b"\0" * (1 << 20))
    for key, value in (("metrics_file", f"{disk}/m.jsonl"), ("base_output_directory", f"{disk}/runs")):
      args = overrides_of(
        "run_name=r", f"base_output_directory={tmp_path}/runs", "enable_tensorboard=true", f"{key}={value}"
      )
      env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
      proc = run([sys.executable, "MaxText/train.py", BASE_YML, *args], env)
      assert proc.returncode == 2, proc.stdout + proc.stderr
      assert proc.stderr.startswith(f"error: {key}={value}: no space left on") and proc.stderr.count("\n") == 1, proc.stderr
      assert sorted(os.listdir(disk)) == ["filler"] and not (tmp_path / "runs").exists()


@pytest.mark.mesh
def test_data_that_runs_out_saves_and_says_so_in_one_line(tmp_path, capsys):
  """num_epoch=1 over 200 documents cannot feed 1000 steps: the steps done are saved, exit 1 with one line."""
  args = (*_text_data(tmp_path), "num_epoch=1", "steps=1000", "checkpoint_period=500", "enable_checkpointing=true",
          f"base_output_directory={tmp_path}", "run_name=r", f"metrics_file={tmp_path}/m.jsonl")  # fmt: skip
  assert train.main(["train.py", BASE_YML, *overrides_of(*args)]) == 1
  err = capsys.readouterr().err
  ran_out = re.fullmatch(
    r"error: the training data ran out before step (\d+) \(num_epoch=1\); checkpoint (\d+) is saved: raise num_epoch "
    r"or lower steps, then run again to resume\n",
    err,
  )
  assert ran_out and ran_out[1] == ran_out[2] and 0 < int(ran_out[1]) < 1000, err
  assert os.listdir(tmp_path / "r" / "checkpoints") == [ran_out[1]]
  assert [m["step"] for m in _metrics(tmp_path / "m.jsonl")] == list(range(int(ran_out[1])))


def test_the_config_line_lists_only_the_keys_that_differ_from_base_yml(tmp_path, capsys):
  """The first line names each key whose value differs from base.yml's (checked against the run's config.yml and
  base.yml read here), and points at config.yml for the rest."""
  import yaml

  args = overrides_of("run_name=c", f"base_output_directory={tmp_path}", "log_config=true", "steps=1")
  assert train.main(["train.py", BASE_YML, *args]) == 0
  first = capsys.readouterr().out.splitlines()[0]
  prefix = f"Config (where it differs from base.yml; every key: {tmp_path}/c/config.yml): "
  assert first.startswith(prefix), first
  with open(BASE_YML, encoding="utf-8") as f:
    base = yaml.safe_load(f)
  with open(tmp_path / "c" / "config.yml", encoding="utf-8") as f:
    resolved = yaml.safe_load(f)
  # config.yml writes the preset's keys out and model_name as 'default' (its header names the preset).
  differ = sorted(f"{k}={v}" for k, v in {**resolved, "model_name": "tiny"}.items() if k in base and v != base[k])
  assert first[len(prefix) :].split(" ") == differ
  assert {"model_name=tiny", "steps=1", "dtype=float32"} <= set(differ) and len(differ) < 25, differ
  assert not any(key.startswith(("num_pipeline", "pipeline_parallel")) for key in differ)  # derived, not set


def test_a_data_state_that_lost_its_seal_is_damaged_and_the_run_resumes_from_the_one_before(tmp_path, capsys):
  """The data iterator's state of a checkpoint with checksums, rewritten without its SHA-256 seal (as one saved
  before checksums looks): the resume skips that checkpoint, naming why, for the one before."""
  import json as json_lib

  args = (*_text_data(tmp_path), "checkpoint_period=2", "enable_checkpointing=true", "async_checkpointing=false",
          f"base_output_directory={tmp_path}", "run_name=r")  # fmt: skip
  assert train.main(["train.py", BASE_YML, *overrides_of(*args, "steps=4")]) == 0
  data_file = tmp_path / "r" / "checkpoints" / "4" / "data" / "process_0-of-1.json"
  data_file.write_text(json_lib.loads(data_file.read_text())["iterator_state"])  # the state, unsealed
  capsys.readouterr()
  assert train.main(["train.py", BASE_YML, *overrides_of(*args, "steps=6")]) == 0
  out = capsys.readouterr().out
  assert "has no seal (SHA-256), though its checkpoint was saved with one" in out, out
  assert f"resumed from {tmp_path}/r/checkpoints/2" in out, out
