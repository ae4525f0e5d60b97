"""multihost_job.py for real, through local stand-ins for gcloud and gsutil (MaxText/tests/fake_cloud).

The stand-ins keep the bucket and the queued resources in a folder and run every worker's startup script as a
separate local process with the variables a multi-slice TPU runtime sets, so the upload, the startup script,
a 2-process JAX job running train.py, the logs in the bucket and the clean-up all really happen.
"""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from MaxText.tests.helpers import REPO_ROOT, metrics_losses, run
from MaxText.tests.helpers import overrides as overrides_of

FAKE_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cloud")
JOB = os.path.join(REPO_ROOT, "multihost_job.py")
PROJECT, ZONE, BUCKET = "test-project", "us-central2-b", "test-bucket"
QR = ["gcloud", "alpha", "compute", "tpus", "queued-resources"]
# Names a shell would act on if any of them reached one unquoted: each would create a file named pwned*.
AWKWARD = 'it\'s "q" $(touch pwned1) `touch pwned2`;touch pwned3 &&touch pwned4'
WAIT_SECONDS = 180


class Cloud:
  """The fake cloud of one test: its state folder, the environment that puts the stand-ins first on PATH."""

  def __init__(self, root):
    self.root = str(root)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "FAKE_CLOUD_"))}
    # The stand-ins first, then this interpreter, so `python3` on a "VM" is the one running the tests.
    env["PATH"] = os.pathsep.join([FAKE_BIN, os.path.dirname(sys.executable), env.get("PATH", "")])
    env["FAKE_CLOUD_ROOT"] = self.root
    self.env = env

  def run(self, *args, cwd=None, timeout=60):
    return subprocess.run(args, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)

  def job(self, *flags, cwd=None):
    return self.run(sys.executable, JOB, *flags, cwd=cwd)

  def object_path(self, *parts):
    return os.path.join(self.root, "gcs", BUCKET, *parts)

  def queued_resources(self):
    folder = os.path.join(self.root, "queued_resources")
    return sorted(f[: -len(".json")] for f in os.listdir(folder) if f.endswith(".json")) if os.path.isdir(folder) else []

  def processes(self):
    """Live processes started by this cloud's "VMs" (they carry FAKE_CLOUD_VM=ROOT|...)."""
    needle, found = f"FAKE_CLOUD_VM={self.root}|".encode(), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/environ", "rb") as f:
          tagged = any(v.startswith(needle) for v in f.read().split(b"\0"))
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
          zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
      except OSError:
        continue
      if tagged and not zombie:
        found.append(int(pid))
    return found

  def consoles(self):
    """What every worker's startup script printed, for failure messages."""
    out = []
    for folder, _, files in os.walk(os.path.join(self.root, "vms")):
      for name in sorted(f for f in files if f.endswith(".console") or f.startswith("main_command_log")):
        with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
          out.append(f"--- {os.path.join(folder, name)}\n{f.read()[-3000:]}")
    return "\n".join(out)

  def wait_until_gone(self, run_name, timeout=WAIT_SECONDS):
    """Waits until the queued resource is deleted and no process of its VMs is left; returns the seconds taken."""
    start = time.time()
    while time.time() - start < timeout:
      if run_name not in self.queued_resources() and not self.processes():
        return time.time() - start
      time.sleep(0.25)
    pytest.fail(f"queued resource {run_name} still there after {timeout} s:\n{self.consoles()}")

  def clean_up(self):
    for name in self.queued_resources():
      self.run(*QR, "delete", name, "--force", "--quiet", f"--project={PROJECT}", f"--zone={ZONE}")
    for pid in self.processes():
      os.kill(pid, signal.SIGKILL)


@pytest.fixture
def cloud(tmp_path):
  c = Cloud(tmp_path / "cloud")
  assert c.run("gsutil", "mb", f"gs://{BUCKET}").returncode == 0
  yield c
  c.clean_up()


def _flags(run_name, script_dir, command, *extra):
  return (
    f"--RUN_NAME={run_name}",
    f"--SCRIPT_DIR={script_dir}",
    f"--COMMAND={command}",
    f"--BUCKET_NAME={BUCKET}",
    f"--PROJECT={PROJECT}",
    f"--ZONE={ZONE}",
    *extra,
  )


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _cmdline(pid):
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().decode(errors="replace")
  except OSError:
    return ""


def _no_pwned_file(*folders):
  for folder in folders:
    for _, dirs, files in os.walk(folder):
      assert not [n for n in files + dirs if n.startswith("pwned")], f"an injected command ran in {folder}"


@pytest.mark.slow
def test_two_slices_train_like_one_process_of_8_devices(cloud, tmp_path):
  """2 slices x 1 worker x 4 CPU devices form one 2-process JAX job: its losses are those of one process with 8
  devices (float32, rtol 1e-5: the same math, summed in another order), the logs reach the bucket, and worker 0
  deletes the queued resource, leaving no process behind."""
  train = ["python3", "MaxText/train.py", "MaxText/configs/base.yml"]
  train += overrides_of("run_name=r", "dataset_type=synthetic", "steps=4")
  reference = tmp_path / "reference.jsonl"
  env = {**cloud.env, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  # One process, 8 devices, the data x fsdp mesh that 2 slices of 4 devices make with dcn_data_parallelism=2.
  # A worker training alone (4 devices, half the batch) would see losses 0.1-1.5% away from these.
  single = run([*train, f"base_output_directory={tmp_path}", "ici_data_parallelism=2", f"metrics_file={reference}"], env)
  assert single.returncode == 0, single.stderr

  code = tmp_path / "code"
  shutil.copytree(
    os.path.join(REPO_ROOT, "MaxText"), code / "MaxText", ignore=shutil.ignore_patterns("__pycache__", "tests")
  )
  run_name, bucket_path = "train-2-slices", f"gs://{BUCKET}/runs/train-2-slices"
  # Only process 0 writes the metrics file; the worker that has it copies it to the bucket.
  command = (
    "XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu "
    f"{shlex.join([*train, 'base_output_directory=out', 'dcn_data_parallelism=2', 'metrics_file=metrics.jsonl'])} && "
    f"if [ -f metrics.jsonl ]; then gsutil cp metrics.jsonl {shlex.quote(bucket_path + '/metrics.jsonl')}; fi"
  )
  submitted = cloud.job(*_flags(run_name, code, command, "--NUM_SLICES=2", "--TPU_TYPE=v4-8", "--BUCKET_DIR=runs"))
  assert submitted.returncode == 0, submitted.stderr
  assert f"{bucket_path}/main_command_log_slice_<S>_worker_<W>" in submitted.stdout
  cloud.wait_until_gone(run_name)

  logs = {s: _read(cloud.object_path("runs", run_name, f"main_command_log_slice_{s}_worker_0")) for s in (0, 1)}
  for s, log in logs.items():
    assert "COMMAND exited with status 0" in log, f"slice {s}:\n{log}\n{cloud.consoles()}"
  assert "completed step: 3" in logs[0] and "completed step" not in logs[1]  # One job: process 0 logs for all.
  assert logs[0].rstrip().endswith("2 of 2 logs uploaded; deleting the queued resource train-2-slices")
  job_losses, reference_losses = (
    metrics_losses(cloud.object_path("runs", run_name, "metrics.jsonl")),
    metrics_losses(reference),
  )
  assert sorted(job_losses) == sorted(reference_losses)
  np.testing.assert_allclose(list(job_losses.values()), list(reference_losses.values()), rtol=1e-5)
  assert cloud.run(*QR, "list", f"--project={PROJECT}", f"--zone={ZONE}").stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("num_slices", [1, 2])
def test_every_worker_runs_with_the_tpu_runtime_env_and_awkward_paths_stay_data(cloud, tmp_path, num_slices):
  """v4-16 has 2 hosts a slice. A SCRIPT_DIR and BUCKET_DIR full of quotes, `;`, `$(...)` and backquotes work and
  are never executed; each worker's log names its slice and worker and shows the runtime's variables."""
  code = tmp_path / f"my code {AWKWARD}"
  code.mkdir()
  (code / "hello.sh").write_text("echo hello from the archive\n")
  bucket_dir = f"logs/{AWKWARD}"
  command = "bash hello.sh && env | grep -E '^(MEGASCALE_|TPU_WORKER|JAX_COORD)' | sort; echo \"ids=$SLICE_ID,$WORKER_ID\""
  run_name = f"env-{num_slices}"
  submitted = cloud.job(
    *_flags(run_name, code, command, f"--NUM_SLICES={num_slices}", "--TPU_TYPE=v4-16", f"--BUCKET_DIR={bucket_dir}"),
    cwd=tmp_path,
  )
  assert submitted.returncode == 0, submitted.stderr
  cloud.wait_until_gone(run_name)

  uploaded = sorted(os.listdir(cloud.object_path(*bucket_dir.split("/"), run_name)))
  expected = [f"main_command_log_slice_{s}_worker_{w}" for s in range(num_slices) for w in (0, 1)]
  assert uploaded == sorted([*expected, f"script_dir_zip_{run_name}.tar.gz"])
  port = None
  for s in range(num_slices):
    for w in (0, 1):
      log = _read(cloud.object_path(*bucket_dir.split("/"), run_name, f"main_command_log_slice_{s}_worker_{w}"))
      variables = dict(line.split("=", 1) for line in log.splitlines() if line.startswith(("MEGASCALE_", "TPU_", "JAX_")))
      port = port or variables["JAX_COORDINATOR_PORT"]
      want = {"TPU_WORKER_ID": str(w), "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1", "JAX_COORDINATOR_PORT": port}
      if num_slices > 1:  # As on real TPUs, only a multi-slice job has MEGASCALE_* variables.
        want.update(
          MEGASCALE_COORDINATOR_ADDRESS="127.0.0.1",
          MEGASCALE_NUM_SLICES=str(num_slices),
          MEGASCALE_SLICE_ID=str(s),
          MEGASCALE_PORT="8080",
        )
      assert variables == want, log
      assert "hello from the archive" in log and f"ids={s},{w}" in log and "exited with status 0" in log
  _no_pwned_file(tmp_path, REPO_ROOT)


@pytest.mark.slow
def test_stop_command_ends_a_running_job_and_a_second_create_is_refused(cloud, tmp_path):
  """The Watch and Stop commands multihost_job.py prints work: delete ends workers still running."""
  code = tmp_path / "code"
  code.mkdir()
  submitted = cloud.job(*_flags("sleeper", code, "echo started; sleep 120", "--NUM_SLICES=2"))
  assert submitted.returncode == 0, submitted.stderr
  printed = {
    line.split(":", 1)[0]: shlex.split(line.split(":", 1)[1]) for line in submitted.stdout.splitlines() if ":  " in line
  }
  deadline = time.time() + 60
  while len([p for p in cloud.processes() if _cmdline(p).startswith("sleep")]) < 2:
    assert time.time() < deadline, cloud.consoles()
    time.sleep(0.1)

  # The same RUN_NAME again: refused before anything is uploaded over the running job's code.
  again = cloud.job(*_flags("sleeper", code, "true", "--NUM_SLICES=2"))
  assert again.returncode == 2 and "gs://test-bucket/sleeper/ already holds the files" in again.stderr, again.stderr
  # In another folder the upload goes ahead and gcloud refuses the second queued resource of that name.
  again = cloud.job(*_flags("sleeper", code, "true", "--NUM_SLICES=2", "--BUCKET_DIR=other"))
  assert again.returncode == 1 and "ALREADY_EXISTS" in again.stderr and len(again.stderr.splitlines()) == 1, again.stderr

  described = cloud.run(*printed["Watch"])
  assert described.returncode == 0 and json.loads(described.stdout)["workers"] == {
    "sleeper-0/worker-0": "RUNNING",
    "sleeper-1/worker-0": "RUNNING",
  }
  start = time.time()
  stopped = cloud.run(*printed["Stop"])
  assert stopped.returncode == 0, stopped.stderr
  cloud.wait_until_gone("sleeper", timeout=30)
  assert time.time() - start < 30


def test_dry_run_prints_the_commands_a_user_would_type(tmp_path):
  """--DRY_RUN runs nothing (gcloud and gsutil here only record that they were called) and prints MaxText's
  commands: multi-slice with --node-prefix/--node-count, one slice with --node-id."""
  tripwire = tmp_path / "bin"
  tripwire.mkdir()
  for tool in ("gcloud", "gsutil"):
    (tripwire / tool).write_text(f"#!/bin/sh\necho {tool} >> {shlex.quote(str(tmp_path / 'called'))}\n")
    (tripwire / tool).chmod(0o755)
  env = {**os.environ, "PATH": f"{tripwire}{os.pathsep}{os.environ['PATH']}"}
  code = tmp_path / f"code {AWKWARD}"
  code.mkdir()

  def dry_run(*flags):
    result = subprocess.run(
      [sys.executable, JOB, "--DRY_RUN", *flags], env=env, cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert subprocess.run(["bash", "-n"], input=result.stdout, text=True, check=False).returncode == 0
    return [shlex.split(line) for line in result.stdout.splitlines() if not line.startswith("#")]

  extra = "--reserved --service-account='sa@p.iam.gserviceaccount.com'"
  flags = _flags("my-run", code, "python3 MaxText/train.py MaxText/configs/base.yml run_name=my-run", "--BUCKET_DIR=jobs/")
  commands = dry_run(
    *flags, "--NUM_SLICES=2", "--TPU_TYPE=v5litepod-16", f"--CQR_EXTRA_ARGS={extra}", "--ENABLE_AUTOCHECKPOINT=true"
  )
  archive, script = commands[2][2], commands[4][-1].split("=", 2)[2]
  assert commands == [
    ["gsutil", "ls", "-b", "gs://test-bucket"],
    ["gsutil", "ls", "gs://test-bucket/jobs/my-run/"],
    ["tar", "-czf", archive, "--exclude=./.git", "--exclude=__pycache__", "-C", str(code), "."],
    ["gsutil", "cp", archive, "gs://test-bucket/jobs/my-run/script_dir_zip_my-run.tar.gz"],
    [
      *QR,
      "create",
      "my-run",
      "--accelerator-type=v5litepod-16",
      "--runtime-version=tpu-ubuntu2204-base",
      "--project=test-project",
      "--zone=us-central2-b",
      "--node-prefix=my-run",
      "--node-count=2",
      "--reserved",
      "--service-account=sa@p.iam.gserviceaccount.com",
      "--autocheckpoint-enabled",
      f"--metadata-from-file=startup-script={script}",
    ],
  ]
  assert os.path.basename(archive) == "script_dir_zip_my-run.tar.gz" and not os.path.exists(archive)
  startup = _read(script)
  shutil.rmtree(os.path.dirname(script))
  assert subprocess.run(["bash", "-n"], input=startup, text=True, check=False).returncode == 0
  assert "BUCKET_PATH=gs://test-bucket/jobs/my-run\n" in startup and "JAX_COORDINATOR" not in startup
  assert 'queued-resources delete "$RUN_NAME" --force --quiet --project="$PROJECT" --zone="$ZONE"' in startup

  # No --RUN_NAME: USER-date-time, a valid TPU name.
  one_slice = [f for f in _flags("-", code, "true", "--NUM_SLICES=1", "--VERSION=v2-alpha-tpuv5") if f != "--RUN_NAME=-"]
  commands = dry_run(*one_slice)
  shutil.rmtree(os.path.dirname(commands[4][-1].split("=", 2)[2]))
  name = commands[4][6]
  assert re.fullmatch(r"[a-z][-a-z0-9]*-20\d\d-\d\d-\d\d-\d\d-\d\d-\d\d", name), name
  assert commands[3][3] == f"gs://test-bucket/{name}/script_dir_zip_{name}.tar.gz"
  assert commands[4][:-1] == [
    *QR,
    "create",
    name,
    "--accelerator-type=v4-8",
    "--runtime-version=v2-alpha-tpuv5",
    "--project=test-project",
    "--zone=us-central2-b",
    f"--node-id={name}",
  ]
  assert not (tmp_path / "called").exists()
  _no_pwned_file(tmp_path)


BAD_INPUTS = {
  "missing SCRIPT_DIR": ({"--SCRIPT_DIR": "/no/such/folder"}, "--SCRIPT_DIR='/no/such/folder' is not a folder"),
  "missing bucket": ({"--BUCKET_NAME": "no-such-bucket"}, "bucket gs://no-such-bucket is not reachable"),
  "no COMMAND": ({"--COMMAND": None}, "--COMMAND is missing"),
  "COMMAND that does not parse": ({"--COMMAND": "echo 'unclosed"}, "--COMMAND is not valid shell"),
  "zero slices": ({"--NUM_SLICES": "0"}, "'0' is not a number of slices"),
  "slices not a number": ({"--NUM_SLICES": "two"}, "'two' is not a number of slices"),
  "RUN_NAME with a command": ({"--RUN_NAME": "run;touch pwned"}, "--RUN_NAME='run;touch pwned' is not a valid TPU name"),
  "RUN_NAME too long": ({"--RUN_NAME": "r" * 62}, "is not a valid TPU name"),
  "wildcard in BUCKET_DIR": ({"--BUCKET_DIR": "logs/*"}, "--BUCKET_DIR='logs/*' is not a plain folder path"),
  "unknown flag": ({"--TPU_TPYE": "v4-8"}, "unrecognized arguments: --TPU_TPYE=v4-8"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_code_2(cloud, tmp_path, case):
  changes, message = BAD_INPUTS[case]
  (tmp_path / "code").mkdir()
  flags = dict(arg.split("=", 1) for arg in _flags("bad-input", tmp_path / "code", "true", "--NUM_SLICES=2"))
  flags.update(changes)
  result = cloud.job(*[f"{k}={v}" for k, v in flags.items() if v is not None], cwd=tmp_path)
  assert result.returncode == 2, result.stderr
  assert result.stderr.startswith("error: ") and len(result.stderr.splitlines()) == 1, result.stderr
  assert message in result.stderr and "; " in result.stderr and "Traceback" not in result.stderr
  assert cloud.queued_resources() == [] and os.listdir(cloud.object_path()) == []
  _no_pwned_file(tmp_path)
