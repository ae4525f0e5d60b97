"""multihost_runner.py against a real sshd on loopback: 127.0.0.1 and 127.0.0.2 are two "hosts" sharing one file system.

The sshd runs as a child of the tests with throwaway keys in a temporary folder and listens on those two
addresses only; the workers' copies go under the test's tmp_path (--REMOTE_DIR), so nothing is left in $HOME.
"""

import dataclasses
import getpass
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from MaxText.tests.helpers import REPO_ROOT, free_port, metrics_losses
from MaxText.tests.helpers import overrides as overrides_of
from MaxText.tests.helpers import run as run_command

RUNNER = os.path.join(REPO_ROOT, "multihost_runner.py")
SSHD = "/usr/sbin/sshd"
# Starts the program in argv[1:] with SIGINT at its default and no signal blocked, as an interactive shell does.
# Children inherit ignored and blocked signals, and a pytest started in the background by a non-interactive shell
# (`bash .ci/run &`) has SIGINT and SIGQUIT ignored (POSIX): the runner then never saw the test's Ctrl-C. Tests
# of what Ctrl-C does must not depend on how pytest was started.
FRESH_SIGNALS = (
  "import os, signal, sys; signal.pthread_sigmask(signal.SIG_SETMASK, ()); signal.signal(signal.SIGINT, signal.SIG_DFL); "
  "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)
HOSTS = ("127.0.0.1", "127.0.0.2")
JOB_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_ID")


def wait_for(condition, timeout: float, what: str):
  """Polls condition() every 0.1 s until it returns something truthy; fails after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = condition()
    if value:
      return value
    time.sleep(0.1)
  pytest.fail(f"timed out after {timeout} s waiting for {what}")


@dataclasses.dataclass(frozen=True)
class Sshd:
  port: int
  key: str
  known_hosts: str

  def runner(self, *flags: str, hosts=HOSTS) -> list[str]:
    """The runner's command line for these hosts, as the sshd's user, with the test's key and known_hosts, started
    with the signal state a shell gives it (FRESH_SIGNALS)."""
    return [
      sys.executable,
      "-c",
      FRESH_SIGNALS,
      RUNNER,
      f"--HOSTS={','.join(hosts)}",
      f"--SSH_PORT={self.port}",
      f"--SSH_KEY={self.key}",
      f"--SSH_USER={getpass.getuser()}",
      f"--SSH_OPTION=UserKnownHostsFile={self.known_hosts}",
      *flags,
    ]


def _listening(port: int) -> bool:
  for host in HOSTS:
    try:
      socket.create_connection((host, port), timeout=1).close()
    except OSError:
      return False
  return True


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
  """An sshd on 127.0.0.1 and 127.0.0.2 (a free port), accepting only a key made here; stopped afterwards."""
  if not os.path.exists(SSHD) or not shutil.which("ssh") or not shutil.which("ssh-keygen"):
    pytest.skip(f"needs OpenSSH's {SSHD}, ssh and ssh-keygen (apt-get install openssh-server openssh-client)")
  d = tmp_path_factory.mktemp("sshd")
  for name in ("host_key", "client_key"):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
  shutil.copy(d / "client_key.pub", d / "authorized_keys")
  if os.geteuid() == 0:  # sshd started as root refuses to run without its privilege separation folder.
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # Left in place: another sshd may be using it by then.
  proc = None
  for _ in range(3):  # The free port may be taken before sshd binds it.
    port = free_port()
    (d / "sshd_config").write_text(
      f"Port {port}\nListenAddress 127.0.0.1\nListenAddress 127.0.0.2\nHostKey {d}/host_key\n"
      f"AuthorizedKeysFile {d}/authorized_keys\nPidFile {d}/sshd.pid\nUsePAM no\nStrictModes no\n"
      "PasswordAuthentication no\nKbdInteractiveAuthentication no\nAllowTcpForwarding no\nX11Forwarding no\n"
    )
    with open(d / "sshd.log", "ab") as log:
      proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(d / "sshd_config")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while proc.poll() is None and not _listening(port) and time.monotonic() < deadline:
      time.sleep(0.1)
    if proc.poll() is None and _listening(port):
      break
    proc.kill()
    proc.wait()
    proc = None
  if proc is None:
    pytest.fail(f"sshd did not start; its log: {(d / 'sshd.log').read_text()[-2000:]}")
  try:
    yield Sshd(port, str(d / "client_key"), str(d / "known_hosts"))
  finally:
    proc.terminate()
    proc.wait(10)


def run(argv, tmp_path, timeout=120, **kwargs):
  """Runs the runner to the end; TMPDIR keeps its default log folder inside tmp_path."""
  env = {**os.environ, "TMPDIR": str(tmp_path)}
  return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, check=False, **kwargs)


def pids_with(token: str) -> list[int]:
  """Processes whose command line contains `token` (pgrep -f), this one excluded."""
  out = subprocess.run(["pgrep", "-f", token], capture_output=True, text=True, check=False).stdout
  return [int(pid) for pid in out.split() if int(pid) != os.getpid()]


def environ_of(pid: int) -> dict[str, str]:
  try:
    with open(f"/proc/{pid}/environ", "rb") as f:
      entries = f.read().split(b"\0")
  except OSError:
    return {}
  return dict(e.decode(errors="replace").split("=", 1) for e in entries if b"=" in e)


def worker_processes(token: str, process_id: int, program: str) -> list[int]:
  """Processes of worker `process_id` (by JAX_PROCESS_ID in their environment) running `program` (argv[0])."""
  found = []
  for pid in pids_with(token):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv0 = f.read().split(b"\0")[0].decode()
    except OSError:
      continue
    if os.path.basename(argv0).startswith(program) and environ_of(pid).get("JAX_PROCESS_ID") == str(process_id):
      found.append(pid)
  return found


def assert_nothing_left(token: str) -> None:
  """Nothing carrying `token` runs any more (worker processes, remote shells, local ssh): polled for 10 s."""
  left = []

  def gone():
    nonlocal left
    left = pids_with(token)
    return not left

  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and not gone():
    time.sleep(0.1)
  assert not left, subprocess.run(
    ["ps", "-o", "pid,ppid,pgid,cmd", "-p", ",".join(map(str, left))], capture_output=True, text=True, check=False
  ).stdout


# ---------------------------------------------------------------------------------------------- training
def _train_args(tmp_path, run_name, metrics, *extra) -> list[str]:
  return [
    "MaxText/train.py",
    "MaxText/configs/base.yml",
    *overrides_of(f"run_name={run_name}", f"base_output_directory={tmp_path}/out", f"metrics_file={metrics}", *extra),
  ]


def _worker_command(args: list[str]) -> str:
  """COMMAND for train.py on one process of 4 simulated CPU devices."""
  return "XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu " + shlex.join([sys.executable, *args])


@pytest.mark.slow
def test_two_hosts_train_as_one_job_with_the_losses_of_one_process(sshd, tmp_path):
  """Two workers over ssh are one 8-device JAX job, data parallel across the processes (dcn_data_parallelism=2): the
  same float32 losses as one process of 8 devices with the same mesh inside it (ici_data_parallelism=2).

  rtol 1e-5: both runs compute the same sums on the same synthetic rows; only the collectives carrying them differ
  (gloo across processes), so they differ only by float32 rounding of reductions (~1e-7 relative).
  """
  multi = tmp_path / "multi.jsonl"
  command = _worker_command(_train_args(tmp_path, "two_hosts", multi, "steps=4", "dcn_data_parallelism=2"))
  logs = tmp_path / "logs"
  result = run(
    sshd.runner(
      f"--COMMAND={command}",
      f"--SCRIPT_DIR={REPO_ROOT}",
      f"--REMOTE_DIR={tmp_path}/remote",
      f"--LOG_DIR={logs}",
      "--RUN_NAME=two_hosts",
      f"--COORDINATOR_PORT={free_port()}",
    ),
    tmp_path,
    timeout=240,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr

  env = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  single = tmp_path / "single.jsonl"
  one_process = _train_args(tmp_path, "one_process", single, "steps=4", "ici_data_parallelism=2")
  reference = run_command([sys.executable, *one_process], env, 240)
  assert reference.returncode == 0, reference.stderr[-3000:]

  one, two = metrics_losses(single), metrics_losses(multi)
  # Process 0 alone writes the metrics: two independent 4-device jobs would each be a process 0 and write 8 rows.
  assert sorted(two) == sorted(one) == [0, 1, 2, 3]
  np.testing.assert_allclose([two[s] for s in range(4)], [one[s] for s in range(4)], rtol=1e-5)
  # Each worker's full log is kept, and every line of it was shown with its prefix.
  for i in range(2):
    lines = (logs / f"worker_{i}.log").read_text().splitlines()
    assert lines, f"worker {i}'s log is empty"
    shown = {line[len(f"[worker {i}] ") :] for line in result.stdout.splitlines() if line.startswith(f"[worker {i}] ")}
    assert set(lines) <= shown
  log_0 = (logs / "worker_0.log").read_text()
  assert "completed step: 3" in log_0 and "mesh {'data': 2, 'stage': 1, 'fsdp': 4," in log_0


@pytest.mark.slow
def test_killing_a_worker_stops_the_job_names_it_and_leaves_nothing(sshd, tmp_path):
  """SIGKILL to worker 1's python mid-run: the runner stops worker 0, names worker 1 and exits 1 within 60 s."""
  token = f"killrun{os.getpid()}x{time.time_ns()}"
  metrics = tmp_path / "metrics.jsonl"
  command = _worker_command(_train_args(tmp_path, token, metrics, "steps=100000"))
  logs = tmp_path / "logs"
  argv = sshd.runner(
    f"--COMMAND={command}",
    f"--SCRIPT_DIR={REPO_ROOT}",
    f"--REMOTE_DIR={tmp_path}/remote",
    f"--LOG_DIR={logs}",
    f"--RUN_NAME={token}",
    f"--COORDINATOR_PORT={free_port()}",
    "--STOP_GRACE=5",
  )
  with open(tmp_path / "runner.out", "wb") as out, open(tmp_path / "runner.err", "wb") as err:
    runner = subprocess.Popen(argv, stdout=out, stderr=err)
  try:
    # Two whole lines of metrics (a third may be half written): the job is mid-run.
    wait_for(lambda: _exited(runner, tmp_path) or _read(metrics).count("\n") >= 2, 180, "2 training steps")
    victims = worker_processes(token, 1, "python")
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    killed_at = time.monotonic()
    code = runner.wait(60)
    elapsed = time.monotonic() - killed_at
  finally:
    if runner.poll() is None:
      runner.kill()
      runner.wait()
  stderr = (tmp_path / "runner.err").read_text()
  assert code == 1, stderr
  assert elapsed < 60
  assert stderr.startswith(f"error: worker 1 (127.0.0.2) exited with code 137; last lines of its log ({logs}/worker_1.log)")
  assert "Traceback" not in stderr
  assert_nothing_left(token)


# ---------------------------------------------------------------------------------------------- stopping
def _exited(runner: subprocess.Popen, tmp_path) -> bool:
  """Fails the test if the runner has ended early; else False."""
  if runner.poll() is not None:
    pytest.fail(f"the runner ended early (exit code {runner.returncode}): {_read(tmp_path / 'runner.err')[-3000:]}")
  return False


def _wait_ready(runner, tmp_path, count: int) -> None:
  logs = tmp_path / "logs"
  wait_for(
    lambda: _exited(runner, tmp_path) or all("ready" in _read(logs / f"worker_{i}.log") for i in range(count)),
    30,
    "the workers' 'ready'",
  )


def _read(path) -> str:
  try:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read()
  except OSError:
    return ""


def _sleeping_job(sshd, tmp_path, token: str, *flags: str):
  """A runner whose two workers print 'ready' and sleep; output to files."""
  src = tmp_path / "src"
  src.mkdir(exist_ok=True)
  argv = sshd.runner(
    f"--COMMAND=echo ready; sleep 300; : {token}",
    f"--SCRIPT_DIR={src}",
    f"--REMOTE_DIR={tmp_path}/remote",
    f"--LOG_DIR={tmp_path}/logs",
    f"--RUN_NAME={token}",
    *flags,
  )
  with open(tmp_path / "runner.out", "wb") as out, open(tmp_path / "runner.err", "wb") as err:
    return subprocess.Popen(argv, stdout=out, stderr=err)


def _warn_if_sigint_is_off_here():
  """A warning (in pytest's summary) when this process has SIGINT ignored or blocked, which FRESH_SIGNALS undoes
  for the runner."""
  with open("/proc/self/status", encoding="ascii") as f:
    masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in f.read().splitlines()) if k in ("SigBlk", "SigIgn")}
  off = [k for k, mask in masks.items() if mask & (1 << (signal.SIGINT - 1))]
  if off:
    warnings.warn(f"SIGINT is {' and '.join(off)} in the test process ({masks}); the runner starts without it", stacklevel=2)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_stopping_the_runner_stops_every_worker(sshd, tmp_path, how):
  """SIGTERM or Ctrl-C: the runner stops the workers and exits 128+signal; SIGKILL: its ssh connections' stdin
  closes, and each worker's watchdog ends COMMAND by itself."""
  token = f"stoprun{how}{time.time_ns()}"
  _warn_if_sigint_is_off_here()
  runner = _sleeping_job(sshd, tmp_path, token, "--STOP_GRACE=3")
  try:
    _wait_ready(runner, tmp_path, 2)
    signum = getattr(signal, how)
    runner.send_signal(signum)
    try:
      code = runner.wait(30)
    except subprocess.TimeoutExpired:  # Keep what the runner and the workers said: pytest's tmp_path is rotated.
      logs = sorted(tmp_path.rglob("*.out")) + sorted(tmp_path.rglob("*.err")) + sorted(tmp_path.rglob("*.log"))
      said = "\n".join(f"== {p.name}:\n{p.read_text(errors='replace')[-2000:]}" for p in logs)
      raise AssertionError(
        f"the runner did not exit within 30 s of {how}; its output and the workers' logs:\n{said}"
      ) from None
  finally:
    if runner.poll() is None:
      runner.kill()
      runner.wait()
  if how == "SIGKILL":
    assert code == -signal.SIGKILL
  else:
    assert code == 128 + signum
    assert (tmp_path / "runner.err").read_text() == f"error: interrupted by {how}; the workers were stopped\n"
  assert_nothing_left(token)


@pytest.mark.slow
def test_a_silent_worker_is_detected_by_keepalives(sshd, tmp_path):
  """A worker that stops answering (its sshd session frozen by SIGSTOP) fails the job after ~3 keep-alives."""
  token = f"silentrun{time.time_ns()}"
  runner = _sleeping_job(sshd, tmp_path, token, "--SSH_ALIVE_INTERVAL=1", "--STOP_GRACE=3")
  frozen = None
  try:
    _wait_ready(runner, tmp_path, 2)
    frozen = min(worker_processes(token, 1, ""))  # COMMAND's shell; its sshd session is the nearest sshd above it.
    while frozen > 1 and not _read(f"/proc/{frozen}/comm").startswith("sshd"):
      frozen = int(_read(f"/proc/{frozen}/stat").rsplit(")", 1)[1].split()[1])  # The parent's pid.
    assert frozen > 1
    os.kill(frozen, signal.SIGSTOP)
    frozen_at = time.monotonic()
    code = runner.wait(30)
    elapsed = time.monotonic() - frozen_at
  finally:
    if runner.poll() is None:
      runner.kill()
      runner.wait()
    if frozen and frozen > 1:  # The session's end closes the worker's stdin: its watchdog ends COMMAND.
      os.kill(frozen, signal.SIGKILL)
  stderr = (tmp_path / "runner.err").read_text()
  assert code == 1, stderr
  assert elapsed < 20
  assert stderr.startswith("error: worker 1 (127.0.0.2) lost its ssh connection")
  assert_nothing_left(token)


# ---------------------------------------------------------------------------------------------- copying, quoting
# Were any of them run as shell code, it would create a file named PWNED (in /tmp) or PWNED2 to PWNED5 (somewhere).
MARKERS = ("PWNED", "PWNED2", "PWNED3", "PWNED4", "PWNED5")
NASTY_RUN_NAMES = ("a b'c;touch /tmp/PWNED", 'it\'s "$(touch PWNED3)" `touch PWNED4`; touch PWNED5 #')


def _markers(root) -> list[str]:
  """Marker files under `root`, in $HOME (where a login shell starts) or /tmp/PWNED."""
  found = [os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f in MARKERS]
  home = os.path.expanduser("~")
  return found + [p for p in ["/tmp/PWNED", *(os.path.join(home, m) for m in MARKERS)] if os.path.exists(p)]


@pytest.mark.slow
@pytest.mark.parametrize("run_name", NASTY_RUN_NAMES)
def test_names_with_spaces_quotes_and_semicolons_are_data_not_code(sshd, tmp_path, run_name):
  """RUN_NAME, SCRIPT_DIR and REMOTE_DIR with shell syntax in them are passed literally, never run."""
  assert not os.path.exists("/tmp/PWNED"), "/tmp/PWNED exists before the test; remove it"
  remote_dir = tmp_path / 'remote "$(touch PWNED2)" `touch PWNED2`; touch PWNED2 \'x'
  src = tmp_path / "src 'dir' ;x"
  src.mkdir()
  (src / "hello.txt").write_text("hello\n")
  port = free_port()
  command = 'printf "%s|%s|%s|%s\\n" "$JAX_PROCESS_ID" "$JAX_PROCESS_COUNT" "$JAX_COORDINATOR_ADDRESS" "$PWD"; cat hello.txt'
  result = run(
    sshd.runner(
      f"--COMMAND={command}",
      f"--SCRIPT_DIR={src}",
      f"--REMOTE_DIR={remote_dir}",
      f"--RUN_NAME={run_name}",
      f"--COORDINATOR_PORT={port}",
    ),
    tmp_path,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert _markers(tmp_path) == []
  target = f"{remote_dir}/{run_name}"
  assert _read(f"{target}/hello.txt") == "hello\n"
  for i in range(2):
    assert f"[worker {i}] {i}|2|127.0.0.1:{port}|{target}\n" in result.stdout
    assert f"[worker {i}] hello\n" in result.stdout
    # The default log folder is the temporary folder (here TMPDIR=tmp_path) / RUN_NAME.
    assert (tmp_path / run_name / f"worker_{i}.log").read_text().endswith("hello\n")


@pytest.mark.slow
def test_a_hostfile_with_users_and_comments(sshd, tmp_path):
  """--HOSTFILE: one host a line, `#` comments and extra words ignored; `user@host` wins over --SSH_USER (here a
  user that does not exist), and the coordinator address is worker 0's host without the user."""
  user, port = getpass.getuser(), free_port()
  hostfile = tmp_path / "hosts"
  hostfile.write_text(f"# the job's machines\n{user}@127.0.0.1 slots=4\n\n  {user}@127.0.0.2   # the second\n")
  src = tmp_path / "src"
  src.mkdir()
  argv = [a for a in sshd.runner() if not a.startswith(("--HOSTS=", "--SSH_USER="))]
  result = run(
    [
      *argv,
      f"--HOSTFILE={hostfile}",
      "--SSH_USER=no_such_user",
      f"--SCRIPT_DIR={src}",
      f"--REMOTE_DIR={tmp_path}/r",
      f"--LOG_DIR={tmp_path}/logs",
      f"--COORDINATOR_PORT={port}",
      '--COMMAND=echo "$(whoami) $JAX_COORDINATOR_ADDRESS"',
    ],
    tmp_path,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  for i in range(2):
    assert f"[worker {i}] {user} 127.0.0.1:{port}\n" in result.stdout


@pytest.mark.slow
def test_a_new_copy_replaces_the_old_one_and_use_existing_folder_reuses_it(sshd, tmp_path):
  """Four workers on one file system (each address twice) race to put the copy in place: one complete copy wins,
  an older copy's files are gone, no temporary folder is left; --USE_EXISTING_FOLDER runs in it without copying."""
  src, remote = tmp_path / "src", tmp_path / "remote"
  src.mkdir()
  (src / "version.txt").write_text("1\n")
  (src / "old_only.txt").write_text("old\n")
  for excluded in ("__pycache__", ".git"):
    (src / excluded).mkdir()
    (src / excluded / "x").write_text("")
  hosts = HOSTS * 2
  common = [f"--REMOTE_DIR={remote}", "--RUN_NAME=job", f"--LOG_DIR={tmp_path}/logs", f"--COORDINATOR_PORT={free_port()}"]
  first = run(sshd.runner("--COMMAND=cat version.txt", f"--SCRIPT_DIR={src}", *common, hosts=hosts), tmp_path)
  assert first.returncode == 0, first.stdout + first.stderr
  assert sorted(os.listdir(remote / "job")) == [".multihost_runner_copy", "old_only.txt", "version.txt"]

  (src / "version.txt").write_text("2\n")
  (src / "old_only.txt").unlink()
  second = run(sshd.runner("--COMMAND=cat version.txt", f"--SCRIPT_DIR={src}", *common, hosts=hosts), tmp_path)
  assert second.returncode == 0, second.stdout + second.stderr
  assert sorted(os.listdir(remote)) == ["job"]  # No temporary folders left.
  assert sorted(os.listdir(remote / "job")) == [".multihost_runner_copy", "version.txt"]
  assert all(f"[worker {i}] 2\n" in second.stdout for i in range(4))

  (src / "version.txt").write_text("3\n")  # Not copied: the workers run in their existing folder.
  reuse = run(
    sshd.runner("--COMMAND=cat version.txt", f"--SCRIPT_DIR={tmp_path}/missing", "--USE_EXISTING_FOLDER=true", *common),
    tmp_path,
  )
  assert reuse.returncode == 0, reuse.stdout + reuse.stderr
  assert all(f"[worker {i}] 2\n" in reuse.stdout for i in range(2))


@pytest.mark.slow
def test_a_failing_worker_stops_the_others_and_its_log_tail_is_shown(sshd, tmp_path):
  """Worker 1 exits 7 while worker 0 ignores SIGTERM: worker 0 is killed after STOP_GRACE and stderr names worker 1."""
  token = f"failrun{time.time_ns()}"
  src = tmp_path / "src"
  src.mkdir()
  command = (
    'if [ "$JAX_PROCESS_ID" = 1 ]; then for i in $(seq 30); do echo line $i; done; exit 7; fi; '
    f"trap '' TERM; sleep 300; : {token}"
  )
  start = time.monotonic()
  result = run(
    sshd.runner(
      f"--COMMAND={command}",
      f"--SCRIPT_DIR={src}",
      f"--REMOTE_DIR={tmp_path}/remote",
      f"--LOG_DIR={tmp_path}/logs",
      "--STOP_GRACE=2",
    ),
    tmp_path,
    timeout=60,
  )
  assert result.returncode == 1
  assert time.monotonic() - start < 30
  lines = result.stderr.splitlines()
  assert lines[0] == f"error: worker 1 (127.0.0.2) exited with code 7; last lines of its log ({tmp_path}/logs/worker_1.log):"
  assert lines[1:] == [f"line {i}" for i in range(11, 31)]
  assert_nothing_left(token)


# ---------------------------------------------------------------------------------------------- user mistakes
BAD_INPUT = {
  "no hosts": (["--HOSTS=", "--COMMAND=true"], "--HOSTS names no host"),
  "no workers named": (["--COMMAND=true"], "no workers named"),
  "unreachable host": (["--HOSTS=127.0.0.1", "--SSH_PORT={closed_port}", "--COMMAND=true"], "cannot reach worker 0"),
  "missing SCRIPT_DIR": (["--HOSTS=127.0.0.1", "--SCRIPT_DIR={tmp}/missing", "--COMMAND=true"], "--SCRIPT_DIR="),
  "missing COMMAND": (["--HOSTS=127.0.0.1"], "--COMMAND is missing"),
  "COMMAND not shell": (["--HOSTS=127.0.0.1", "--COMMAND=echo ("], "--COMMAND is not valid shell"),
  "missing HOSTFILE": (["--HOSTFILE={tmp}/hosts", "--COMMAND=true"], "cannot be read"),
  "option as host": (["--HOSTS=-oProxyCommand=touch {tmp}/x", "--COMMAND=true"], "is not a host"),
  "RUN_NAME escapes": (["--HOSTS=127.0.0.1", "--RUN_NAME=../x", "--COMMAND=true"], "--RUN_NAME='../x'"),
  "bad port": (["--HOSTS=127.0.0.1", "--SSH_PORT=99999", "--COMMAND=true"], "is not a port"),
  "TPUs and hosts": (["--TPU_PREFIX=t", "--HOSTS=127.0.0.1", "--COMMAND=true"], "are both given"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, case):
  flags, expected = BAD_INPUT[case]
  flags = [f.format(tmp=tmp_path, closed_port=free_port()) for f in flags]
  src = tmp_path / "src"
  src.mkdir()
  start = time.monotonic()
  result = run([sys.executable, RUNNER, f"--SCRIPT_DIR={src}", f"--LOG_DIR={tmp_path}/logs", *flags], tmp_path, timeout=60)
  assert time.monotonic() - start < 20  # An unreachable host fails fast: BatchMode, ConnectTimeout.
  assert result.returncode == 2, result.stdout + result.stderr
  assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
  assert expected in result.stderr
  assert "Traceback" not in result.stderr
  assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_use_existing_folder_without_one_is_a_user_error(sshd, tmp_path):
  run_name = NASTY_RUN_NAMES[1]
  result = run(
    sshd.runner(
      "--COMMAND=true",
      "--USE_EXISTING_FOLDER",
      f"--RUN_NAME={run_name}",
      f"--REMOTE_DIR={tmp_path}",
      f"--LOG_DIR={tmp_path}/logs",
    ),
    tmp_path,
  )
  assert result.returncode == 2
  assert result.stderr == (
    f"error: worker 0 (127.0.0.1) has no folder {run_name!r} in '{tmp_path}'; run once without "
    "--USE_EXISTING_FOLDER to copy SCRIPT_DIR there\n"
  )
  assert _markers(tmp_path) == []


# ---------------------------------------------------------------------------------------------- Cloud TPU (gcloud)
FAKE_GCLOUD = r'''#!PYTHON
"""A stand-in for gcloud: TPUs mytpu-0 and mytpu-1 (two workers each) whose workers are folders under $FAKE_ROOT."""
import json, os, shutil, sys
root, args = os.environ["FAKE_ROOT"], sys.argv[1:]
with open(os.path.join(root, "calls.jsonl"), "a") as f:
  f.write(json.dumps(args) + "\n")
flag = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if a.startswith("--") and "=" in a}
home = lambda name: os.path.join(root, "vms", name, flag["--worker"])
if args[:2] == ["config", "get"]:
  print({"project": "fake-project", "compute/zone": "fake-zone"}[args[2]])
elif args[:4] == ["compute", "tpus", "tpu-vm", "list"]:  # gcloud's own filter is loose: the runner must match.
  print("projects/fake-project/locations/fake-zone/nodes/mytpu-1\nmytpu-0\nmytpu-extra\nmytpu-1-old")
elif args[:4] == ["compute", "tpus", "tpu-vm", "describe"]:
  n = args[4].rsplit("-", 1)[1]
  print(f"10.0.{n}.1\n10.0.{n}.2")
elif args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
  name, path = args[5].split(":", 1)
  os.makedirs(home(name), exist_ok=True)
  shutil.copy(args[4], os.path.join(home(name), path))
elif args[:4] == ["compute", "tpus", "tpu-vm", "ssh"]:
  os.makedirs(home(args[4]), exist_ok=True)
  os.chdir(home(args[4]))
  path = os.path.join(root, "bin") + ":" + os.environ["PATH"]  # Its sudo does nothing: no TPU processes to end.
  env = {"HOME": home(args[4]), "SHELL": "/bin/sh", "PATH": path, "FAKE_ROOT": root}  # A login's, not ours.
  os.execvpe("sh", ["sh", "-c", args[args.index("--command") + 1]], env)
else:
  sys.exit(f"fake gcloud: unknown command {args}")
'''


def test_gcloud_mode_copies_to_every_tpu_worker_and_sets_the_multislice_variables(tmp_path):
  """--TPU_PREFIX=mytpu finds slices mytpu-0 and mytpu-1 through gcloud; every worker gets the code and MEGASCALE_*."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "gcloud").write_text(FAKE_GCLOUD.replace("PYTHON", sys.executable))
  (bin_dir / "sudo").write_text('#!/bin/sh\necho "sudo $*" >> "$FAKE_ROOT/sudo.log"\n')
  for name in ("gcloud", "sudo"):
    os.chmod(bin_dir / name, 0o755)
  src = tmp_path / "src"
  src.mkdir()
  (src / "hello.txt").write_text("hello\n")
  command = 'env | grep -E "^(MEGASCALE|JAX)_" | sort > env.txt; cat hello.txt'
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_ROOT": str(tmp_path)}
  result = subprocess.run(
    [
      sys.executable,
      RUNNER,
      "--TPU_PREFIX=mytpu",
      f"--COMMAND={command}",
      f"--SCRIPT_DIR={src}",
      "--RUN_NAME=tpu_run",
      f"--LOG_DIR={tmp_path}/logs",
      "--INTERNAL_IP=true",
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert result.returncode == 0, result.stdout + result.stderr
  workers = [(s, w) for s in range(2) for w in range(2)]
  for index, (s, w) in enumerate(workers):
    folder = tmp_path / "vms" / f"mytpu-{s}" / str(w)
    assert (folder / "tpu_run" / "hello.txt").read_text() == "hello\n"
    assert (folder / "tpu_run" / "env.txt").read_text().splitlines() == [
      "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.1:8080",
      "MEGASCALE_NUM_SLICES=2",
      "MEGASCALE_PORT=8080",
      f"MEGASCALE_SLICE_ID={s}",
    ]
    assert [p for p in os.listdir(folder) if p.endswith(".tar.gz")] == []  # The uploaded archive was removed.
    assert f"[worker {index}] hello" in result.stdout
  assert "4 workers (0: mytpu-0 worker 0, 1: mytpu-0 worker 1, 2: mytpu-1 worker 0, 3: mytpu-1 worker 1)" in result.stdout
  with open(tmp_path / "calls.jsonl", encoding="utf-8") as f:
    calls = [json.loads(line) for line in f]
  tpu_calls = [c for c in calls if c[:3] == ["compute", "tpus", "tpu-vm"]]
  assert all("--project=fake-project" in c and "--zone=fake-zone" in c for c in tpu_calls)
  scps = [c for c in tpu_calls if c[3] == "scp"]
  sshs = [c for c in tpu_calls if c[3] == "ssh"]
  assert sorted((c[5].split(":")[0], c[6]) for c in scps) == [(f"mytpu-{s}", f"--worker={w}") for s, w in workers]
  assert len(sshs) == 8 and all("--internal-ip" in c and "--ssh-flag=-oBatchMode=yes" in c for c in sshs)
  assert (tmp_path / "sudo.log").read_text().count("lsof") == 4  # MaxText's clean-up of the TPU, once a worker.
