"""gs:// for real, against a GCS emulator on loopback (gcs.py): a run checkpoints to a bucket, is killed with
kill -9, and resumes from the bucket with the uninterrupted run's losses; config.yml, the metrics (gcs_metrics),
TensorBoard events and checksums land in the bucket; decode.py and the Hugging Face export read from it.

storage.check_access, before a run writes anything: a bucket that exists passes; a missing bucket, an endpoint
that does not answer, missing or refused credentials and a missing write permission are one line each, within
seconds. No test reaches a real cloud endpoint: the ones without an emulator refuse any connection off loopback."""

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import google.auth
import google.auth.exceptions
import jax
import numpy as np
import pytest
from flax import linen as nn
from safetensors.numpy import load_file

from MaxText import checkpointing, storage, train_tokenizer
from MaxText.common_types import ConfigError
from MaxText.layers import models
from MaxText.tests import gcs
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, metrics_losses, overrides, run

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

  logged = max(metrics_losses(tmp_path / "k.jsonl", killed=True))  # the last step the killed run logged
  resumed = _train(env, *args)
  assert resumed.returncode == 0, resumed.stderr
  first = int(resumed.stdout.split(f"resumed from {runs}/killed/checkpoints/", 1)[1].split(" ", 1)[0])
  assert first >= 20 and "arrays verified" in resumed.stdout
  want, got = metrics_losses(tmp_path / "s.jsonl"), metrics_losses(tmp_path / "k.jsonl", killed=True)
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
  # The exported tensors are the checkpoint's, bit for bit (the export keeps the stored dtype).
  cfg = config(*RUN, items)
  abstract = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  params, _ = checkpointing.restore_host_params(cfg, nn.meta.unbox(abstract)["params"])
  tensors = load_file(os.path.join(tmp_path, "hf", "model.safetensors"))
  np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], params["token_embedder"]["embedding"])
  np.testing.assert_array_equal(tensors["lm_head.weight"], params["logits_dense"]["kernel"].T)
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 512

  # How a damaged checkpoint is set aside on a bucket: its objects move, and it is no longer a step.
  storage.rename(f"{runs}/killed/checkpoints/300", f"{runs}/killed/checkpoints/300.damaged")
  assert "300" not in storage.listdir(f"{runs}/killed/checkpoints")
  assert "checksums" in storage.listdir(f"{runs}/killed/checkpoints/300.damaged")


def _closed_port() -> int:
  """A loopback port nothing listens on (bound, then released: connecting is refused)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture
def loopback_only(monkeypatch):
  """Any connection off loopback fails the test (google.auth's metadata probe, storage.googleapis.com)."""
  connect = socket.socket.connect

  def guarded(sock, address):
    host = address[0] if isinstance(address, tuple) else address
    assert host in ("127.0.0.1", "::1", "localhost"), f"a test tried to reach {address}"
    return connect(sock, address)

  monkeypatch.setattr(socket.socket, "connect", guarded)
  for name in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS"):
    monkeypatch.delenv(name, raising=False)


def _access_error(key: str, url: str, write: bool) -> tuple[str, float]:
  """check_access's one-line message and how many seconds it took."""
  start = time.monotonic()
  with pytest.raises(ConfigError) as e:
    storage.check_access(key, url, write)
  message = str(e.value)
  assert "\n" not in message and message.startswith(f"{key}={url}: "), message
  return message, time.monotonic() - start


def test_check_access_on_the_emulator(bucket, monkeypatch):
  url, _ = bucket
  for name, value in gcs.client_env(url).items():
    monkeypatch.setenv(name, value)
  before = storage.listdir(f"gs://{BUCKET}")  # (the bucket is shared with this file's other tests)
  storage.check_access("base_output_directory", f"gs://{BUCKET}/checked", write=True)  # exists, writable: passes
  storage.check_access("load_parameters_path", f"gs://{BUCKET}/checked/x/checkpoints/5/items", write=False)
  message, _ = _access_error("base_output_directory", "gs://no-such-bucket/runs", True)
  assert "bucket no-such-bucket does not exist" in message and "gcloud storage buckets create" in message
  assert storage.listdir(f"gs://{BUCKET}") == before  # nothing was written to check


def test_check_access_leaves_local_paths_alone(tmp_path, loopback_only, monkeypatch):
  monkeypatch.setattr(google.auth, "default", lambda **_: pytest.fail("a local path looked for credentials"))
  storage.check_access("base_output_directory", str(tmp_path / "runs"), write=True)
  assert os.listdir(tmp_path) == []


def test_check_access_to_an_endpoint_that_is_not_there_is_unreachable(loopback_only, monkeypatch):
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{_closed_port()}")
  message, seconds = _access_error("metrics_file", f"gs://{BUCKET}/m.jsonl", True)
  assert f"bucket {BUCKET} is unreachable" in message and "Connection refused" in message, message
  assert seconds < 5


def test_check_access_without_credentials_never_calls_the_endpoint(loopback_only, monkeypatch):
  def no_credentials(**_):
    raise google.auth.exceptions.DefaultCredentialsError("Your default credentials were not found.")

  monkeypatch.setattr(google.auth, "default", no_credentials)
  message, seconds = _access_error("base_output_directory", f"gs://{BUCKET}/runs", True)
  assert f"no Google Cloud credentials to write to bucket {BUCKET}" in message, message
  assert "gcloud auth application-default login" in message and seconds < 5


class _Credentials:
  """What google.auth.default gives: refresh() sets a token, or raises RefreshError."""

  def __init__(self, token="ya29.test", refused=False):
    self.token, self.refused = None, refused
    self._token = token

  def refresh(self, request):
    if self.refused:
      raise google.auth.exceptions.RefreshError("invalid_grant: Token has been expired or revoked.")
    self.token = self._token


@contextlib.contextmanager
def _fake_endpoint(answers: dict[str, tuple[int, dict]]):
  """A loopback HTTP server answering GETs whose path starts with a key of `answers` with (status, JSON body);
  yields (its URL, the Authorization headers it saw)."""
  seen = []

  class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
      seen.append(self.headers.get("Authorization"))
      status, body = next((a for p, a in answers.items() if self.path.startswith(p)), (404, {}))
      data = json.dumps(body).encode()
      self.send_response(status)
      self.send_header("Content-Length", str(len(data)))
      self.end_headers()
      self.wfile.write(data)

    def log_message(self, *args):
      pass

  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
  finally:
    server.shutdown()
    server.server_close()


LIST = f"/storage/v1/b/{BUCKET}/o?"
PERMISSIONS = f"/storage/v1/b/{BUCKET}/iam/testPermissions?"
LISTED = (200, {"kind": "storage#objects"})


@pytest.mark.parametrize(
  "case, answers, credentials, write, expected",
  [
    ("refused token", {LIST: (401, {"error": {"message": "Invalid Credentials"}})}, _Credentials(), False,
     f"bucket {BUCKET} refused the credentials (HTTP 401"),
    ("refresh refused", {}, _Credentials(refused=True), True,
     f"the Google Cloud credentials for bucket {BUCKET} were refused (invalid_grant"),
    ("no read permission", {LIST: (403, {"error": {"message": "denied"}})}, _Credentials(), False,
     f"these credentials may not read bucket {BUCKET} (HTTP 403"),
    ("read-only", {LIST: LISTED, PERMISSIONS: (200, {"kind": "storage#testIamPermissionsResponse"})}, _Credentials(),
     True, f"these credentials may not write to bucket {BUCKET} (they lack storage.objects.create)"),
    ("private bucket, no credentials", {LIST: (401, {})}, None, False,
     f"no Google Cloud credentials to read bucket {BUCKET}"),
  ],
)  # fmt: skip
def test_check_access_with_credentials_the_endpoint_does_not_accept(
  case, answers, credentials, write, expected, loopback_only, monkeypatch
):
  """Google Cloud Storage's answers, from a loopback stand-in for its endpoint."""

  def default(**_):
    if credentials is None:
      raise google.auth.exceptions.DefaultCredentialsError("Your default credentials were not found.")
    return credentials, "project"

  monkeypatch.setattr(google.auth, "default", default)
  with _fake_endpoint(answers) as (endpoint, seen):
    monkeypatch.setattr(storage, "GCS_ENDPOINT", endpoint)
    message, seconds = _access_error("base_output_directory", f"gs://{BUCKET}/runs", write)
  assert expected in message and seconds < 5, message
  assert all(header == (f"Bearer {credentials.token}" if credentials else None) for header in seen), seen


def test_check_access_passes_what_the_endpoint_allows(loopback_only, monkeypatch):
  granted = (200, {"kind": "storage#testIamPermissionsResponse", "permissions": ["storage.objects.create"]})
  monkeypatch.setattr(google.auth, "default", lambda **_: (_Credentials(), "project"))
  with _fake_endpoint({LIST: LISTED, PERMISSIONS: granted}) as (endpoint, seen):
    monkeypatch.setattr(storage, "GCS_ENDPOINT", endpoint)
    storage.check_access("base_output_directory", f"gs://{BUCKET}/runs", write=True)
  assert seen == ["Bearer ya29.test"] * 2


def test_check_access_gives_up_on_a_hung_credentials_lookup(loopback_only, monkeypatch):
  """google.auth.default can wait on the GCE metadata server: the whole check is bounded."""
  monkeypatch.setattr(google.auth, "default", lambda **_: time.sleep(30))
  monkeypatch.setattr(storage, "ACCESS_DEADLINE", 0.5)
  message, seconds = _access_error("base_output_directory", f"gs://{BUCKET}/runs", True)
  assert "is unreachable: no answer within 0.5 s while looking for Google Cloud credentials" in message
  assert seconds < 2


def test_a_hung_credentials_lookup_leaves_reading_to_the_storage_library(loopback_only, monkeypatch):
  """Off Google Cloud the lookup may wait on a metadata server that is not there; a public bucket needs no
  credentials to be read, so a read is not refused for it (a write is, above)."""
  monkeypatch.setattr(google.auth, "default", lambda **_: time.sleep(30))
  monkeypatch.setattr(storage, "ACCESS_DEADLINE", 0.5)
  start = time.monotonic()
  storage.check_access("load_parameters_path", f"gs://{BUCKET}/public/items", write=False)
  assert time.monotonic() - start < 2


def test_a_credentials_file_that_cannot_be_read_is_one_line(loopback_only, monkeypatch):
  def malformed(**_):
    raise ValueError("Service account info was not in the expected format, missing fields token_uri.")

  monkeypatch.setattr(google.auth, "default", malformed)
  message, _ = _access_error("base_output_directory", f"gs://{BUCKET}/runs", True)
  assert f"bucket {BUCKET} cannot be checked (ValueError: Service account info was not in the expected" in message
  assert "GOOGLE_APPLICATION_CREDENTIALS" in message, message


def test_train_on_an_unreachable_bucket_exits_2_in_one_line_and_writes_nothing(tmp_path):
  """train.py with base_output_directory on a bucket whose endpoint is not there: one line, exit 2, nothing
  written locally (its metrics file, the working folder), instead of a minute of retries and tracebacks."""
  env = {**os.environ, **gcs.client_env(f"http://127.0.0.1:{_closed_port()}"), "JAX_PLATFORMS": "cpu"}
  env.pop("XLA_FLAGS", None)
  args = overrides("run_name=r", f"base_output_directory=gs://{BUCKET}/runs", f"metrics_file={tmp_path}/m.jsonl")
  start = time.monotonic()
  done = run([sys.executable, os.path.join(REPO_ROOT, "MaxText", "train.py"), BASE_YML, *args], env, cwd=tmp_path)
  seconds = time.monotonic() - start
  lines = done.stderr.strip().splitlines()
  assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
  assert lines[0].startswith(f"error: base_output_directory=gs://{BUCKET}/runs: bucket {BUCKET} is unreachable")
  assert os.listdir(tmp_path) == []
  assert seconds < 20, seconds  # start-up included; the check itself takes milliseconds (it took a minute before)
