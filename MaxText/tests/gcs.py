"""A local GCS emulator for tests (fake_cloud/gcs_emulator.py) and the environment that points gcsfs,
google-cloud-storage and TensorStore at it: gs://BUCKET/... then works for real, on loopback only."""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

EMULATOR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cloud", "gcs_emulator.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def client_env(url: str) -> dict[str, str]:
  """What a process needs to reach the emulator at `url` without credentials."""
  return {
    "STORAGE_EMULATOR_HOST": url,  # gcsfs (etils.epath's gs://) and google-cloud-storage (Orbax's deletes)
    "TENSORSTORE_GCS_HTTP_URL": url,  # TensorStore (Orbax's arrays)
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",  # no gRPC bucket-layout lookup per bucket
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",  # TensorStore: no search for credentials
    "NO_GCE_CHECK": "true",
    "FSSPEC_GS": '{"token": "anon", "use_listings_cache": false}',  # TensorStore writes behind gcsfs's back
    "EPATH_USE_TF": "false",
  }


@contextlib.contextmanager
def emulator(bucket: str, timeout: float = 20.0):
  """Runs the emulator with an empty in-memory `bucket`; yields its URL. Its log goes to a file (an unread pipe
  would fill and stall it), and it exits by itself if this process dies without stopping it."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  command = [sys.executable, EMULATOR, "start", "--host", "127.0.0.1", "--port", str(port)]
  command += ["--default-bucket", bucket, "--in-memory", "-q"]
  env = {**os.environ, "GCS_EMULATOR_PARENT_PID": str(os.getpid())}
  with tempfile.TemporaryFile() as log:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)
    try:
      deadline = time.monotonic() + timeout
      while True:
        try:
          with urllib.request.urlopen(url + "/", timeout=1) as response:
            if response.status == 200:
              break
        except OSError:
          if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            raise RuntimeError(f"the GCS emulator did not start: {log.read().decode()[-2000:]}") from None
          time.sleep(0.05)
      yield url
    finally:
      proc.send_signal(signal.SIGINT)
      try:
        proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
