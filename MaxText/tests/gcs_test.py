"""gs:// for real, against a GCS emulator on loopback (gcs.py): a run checkpoints to a bucket, is killed with
kill -9, and resumes from the bucket with the uninterrupted run's losses; config.yml, the metrics (gcs_metrics),
TensorBoard events and checksums land in the bucket; decode.py and the Hugging Face export read from it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from MaxText import storage, train_tokenizer
from MaxText.tests import gcs
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, overrides, run

BUCKET = "maxtext-test"
# Saves to the emulator take a few tenths of a second: 30 of them leave time to kill the run after checkpoint 20.
RUN = ("steps=300", "checkpoint_period=10", "log_period=1", "max_target_length=64", "per_device_batch_size=2")
RUN += ("vocab_size=512", "override_model_config=true", "learning_rate_schedule_steps=300")


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
  """The emulator's URL and the environment of a process that uses it."""
  with gcs.emulator(BUCKET) as url:
    env = {**os.environ, **gcs.client_env(url), "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    yield url, env


def _train(env, *args, wait=True):
  command = [sys.executable, "MaxText/train.py", BASE_YML, *overrides(*RUN, *args)]
  if wait:
    return run(command, env, timeout=600)
  return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _losses(path) -> dict[int, float]:
  """{step: loss} of a metrics file; a line cut short by kill -9 is left out."""
  losses = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if "learning/loss" in record:
        losses[record["step"]] = record["learning/loss"]
  return losses


@pytest.mark.slow
def test_a_run_on_a_bucket_is_killed_and_resumes_from_it_exactly(bucket, tmp_path, monkeypatch):
  url, env = bucket
  for name, value in gcs.client_env(url).items():
    monkeypatch.setenv(name, value)  # This process reads the bucket too.
  straight = _train(env, "run_name=straight", f"base_output_directory={tmp_path}", f"metrics_file={tmp_path}/s.jsonl")
  assert straight.returncode == 0, straight.stderr

  runs = f"gs://{BUCKET}/runs"
  args = ("run_name=killed", f"base_output_directory={runs}", "enable_checkpointing=true", "gcs_metrics=true")
  args += ("enable_tensorboard=true", f"metrics_file={tmp_path}/k.jsonl")
  proc = _train(env, *args, wait=False)
  committed = f"{runs}/killed/checkpoints/20/commit_success.txt"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None and not storage.exists(committed):
    time.sleep(0.05)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  assert storage.exists(committed), "the run ended before checkpoint 20 was committed"
  saved = storage.listdir(f"{runs}/killed/checkpoints")
  assert "300" not in saved, f"the run finished before it was killed: {saved}"

  logged = max(_losses(tmp_path / "k.jsonl"))  # the last step the killed run logged
  resumed = _train(env, *args)
  assert resumed.returncode == 0, resumed.stderr
  first = int(resumed.stdout.split(f"resumed from {runs}/killed/checkpoints/", 1)[1].split(" ", 1)[0])
  assert first >= 20 and "arrays verified" in resumed.stdout
  want, got = _losses(tmp_path / "s.jsonl"), _losses(tmp_path / "k.jsonl")
  assert all(got[step] == want[step] for step in range(first, 300)), "the losses after the resume differ"

  names = storage.listdir(f"{runs}/killed")
  assert {"checkpoints", "config.yml", "metrics", "tensorboard"} <= set(names), names
  assert "300" in storage.listdir(f"{runs}/killed/checkpoints")
  assert "checksums" in storage.listdir(f"{runs}/killed/checkpoints/300")
  bucket_metrics = storage.read_text(f"{runs}/killed/metrics/metrics.jsonl").splitlines()
  assert json.loads(bucket_metrics[-1])["goodput"]["recomputed_steps"] == logged + 1 - first  # steps done twice
  assert json.loads(bucket_metrics[-2])["step"] == 299

  # decode.py and the Hugging Face export read the checkpoint from the bucket.
  texts = [f"The {w} is {n} and the sea is {n + 1}." for n in range(60) for w in ("sun", "moon")]
  train_tokenizer.train(texts * 5, vocab_size=300, output=str(tmp_path / "tok.model"))
  items = f"load_parameters_path={runs}/killed/checkpoints/300/items"
  decode_args = overrides(*RUN, items, f"tokenizer_path={tmp_path}/tok.model", "run_name=decode", "prompt=The sun")
  decode_args = overrides(*decode_args, "max_target_length=48", "max_prefill_predict_length=32", "per_device_batch_size=1")
  decoded = run([sys.executable, "MaxText/decode.py", BASE_YML, *decode_args], env)
  assert decoded.returncode == 0 and "Input `The sun` -> `" in decoded.stdout, decoded.stderr
  export = [sys.executable, "MaxText/convert_to_hf_checkpoint.py", BASE_YML, "model_name=tiny", "vocab_size=512"]
  export += ["override_model_config=true", items, f"hf_model_path={tmp_path}/hf", "jax_cache_dir="]
  exported = run(export, env)
  assert exported.returncode == 0, exported.stderr
  assert os.path.isfile(tmp_path / "hf" / "config.json")

  # How a damaged checkpoint is set aside on a bucket: its objects move, and it is no longer a step.
  storage.rename(f"{runs}/killed/checkpoints/300", f"{runs}/killed/checkpoints/300.damaged")
  assert "300" not in storage.listdir(f"{runs}/killed/checkpoints")
  assert "checksums" in storage.listdir(f"{runs}/killed/checkpoints/300.damaged")
