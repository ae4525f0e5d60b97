"""Runs COMMAND on several machines at once as one JAX job; streams their output and stops them all if one fails.

  python3 multihost_runner.py --HOSTS=10.0.0.2,10.0.0.3 --COMMAND="bash setup.sh && python3 MaxText/train.py ..."
  python3 multihost_runner.py --TPU_PREFIX=my-tpu --COMMAND="bash setup.sh && python3 MaxText/train.py ..."

The workers are either
  - Cloud TPU VMs, reached through `gcloud compute tpus tpu-vm scp/ssh` as in MaxText: --TPU_PREFIX names one
    slice (the TPU of that name) or several (PREFIX-0, PREFIX-1, ...), in --PROJECT and --ZONE (default: gcloud's
    config); --INTERNAL_IP=true from inside Google Cloud. JAX finds its processes on TPUs by itself; with several
    slices every worker also gets MEGASCALE_COORDINATOR_ADDRESS (slice 0's worker 0), MEGASCALE_NUM_SLICES,
    MEGASCALE_SLICE_ID and MEGASCALE_PORT. Processes on the TPU are ended first, as MaxText does;
  - any machines over plain ssh (GPU clusters, VMs): --HOSTS=h1,h2,... or --HOSTFILE=FILE (one host a line, `#`
    comments, words after the host ignored), each `host` or `user@host` (which wins over --SSH_USER), with
    --SSH_USER, --SSH_PORT, --SSH_KEY and more `-o` options in --SSH_OPTION. ssh runs with BatchMode=yes (no
    prompts), ConnectTimeout, ServerAliveInterval/CountMax and StrictHostKeyChecking=accept-new. Worker i (in that
    order) gets JAX_COORDINATOR_ADDRESS=<worker 0's host, or --COORDINATOR_HOST>:COORDINATOR_PORT,
    JAX_PROCESS_COUNT and JAX_PROCESS_ID=i, which MaxText/distributed.py reads.

In order:
  1. the flags, SCRIPT_DIR and the shell syntax of COMMAND are checked: a mistake is one line and exit code 2;
  2. SCRIPT_DIR is packed into one archive (without .git and __pycache__) in LOG_DIR and sent to every worker,
     which unpacks it into a fresh folder and renames that to REMOTE_DIR/RUN_NAME (default ~/RUN_NAME, as in
     MaxText), replacing an older copy; workers that share a file system end up with one complete copy.
     --USE_EXISTING_FOLDER=true skips the copy and checks that the folder is there. A worker ssh cannot reach
     (--SSH_CONNECT_TIMEOUT bounds the wait): one line and exit code 2;
  3. every worker runs `cd REMOTE_DIR/RUN_NAME && COMMAND` (COMMAND in its login shell, which reads its startup
     files once; stdin /dev/null), all at once. Each line they print appears here as `[worker i] line`, and in
     full in LOG_DIR/worker_i.log (default LOG_DIR: the temporary folder / RUN_NAME);
  4. all exit 0: exit code 0. One exits non-zero, or its ssh connection fails (ssh's keep-alives give up on a
     silent machine after 3 x --SSH_ALIVE_INTERVAL seconds): the others are stopped and stderr names the worker,
     its exit code and its log, followed by the log's last lines; exit code 1. Ctrl-C, SIGTERM or SIGHUP stop
     them all (exit code 128 + the signal's number).

Stopping: on the worker, COMMAND runs in its own session (so its own process group) beside a watchdog that reads
the ssh connection's stdin. This script stops a worker by closing that stdin; a lost connection (this script or
its ssh killed) ends the read too. The watchdog then sends SIGTERM to the group, and SIGKILL after --STOP_GRACE
seconds; once COMMAND's first process ends, whatever is left in its group is killed. Nothing outlives the job.

Every value that reaches a remote shell (paths, RUN_NAME, variables) is quoted; COMMAND alone is shell code, by
design. This file never imports jax. Tests: MaxText/tests/multihost_runner_test.py (a real sshd on loopback).
"""

import argparse
import concurrent.futures
import dataclasses
import datetime
import ipaddress
import os
import posixpath
import queue
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

from multihost_flags import FlagParser, UsageError, boolean, check_command, gcloud_default

JAX_COORDINATOR_PORT = 8476  # JAX's default coordinator port.
MEGASCALE_PORT = 8080
EXCLUDED_NAMES = (".git", "__pycache__")  # Never copied to the workers.
COPY_MARK = ".multihost_runner_copy"  # In a copied folder: the id of the runner invocation that put it there.
SWAP_TRIES = 50  # Attempts to rename a fresh copy into place while workers sharing a file system race.
TAIL_LINES = 20
TPU_VM = ("gcloud", "compute", "tpus", "tpu-vm")
SSH_ERROR = 255  # ssh's exit code for its own failures (cannot connect, connection lost).
NO_FOLDER = 3  # The check of --USE_EXISTING_FOLDER=true found no folder.
# A TPU is one process's at a time: end the processes a previous job left on it (MaxText's kill script).
TPU_CLEANUP = (
  "pids=$(sudo -n lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | sort -u); "
  'if [ -n "$pids" ]; then echo "ending processes left on the TPU: $pids"; sudo -n kill -9 $pids; fi; '
  "sudo -n rm -f /tmp/libtpu_lockfile 2>/dev/null; true"
)


class JobFailed(Exception):
  """The job failed (exit code 1); the message says where and how."""


@dataclasses.dataclass(frozen=True)
class Worker:
  """One process of the job, in JAX process order."""

  index: int
  name: str  # In messages: "10.0.0.3", "my-tpu-1 worker 2".
  host: str  # ssh destination (host or user@host), or the TPU's name.
  tpu_worker: int | None = None  # gcloud's --worker=.
  env: tuple[tuple[str, str], ...] = ()  # Exported before COMMAND.


# ---------------------------------------------------------------------------------------------- flags
def _port(text: str) -> int:
  if not re.fullmatch(r"\d{1,5}", text.strip()) or not 0 < int(text) < 65536:
    raise argparse.ArgumentTypeError(f"{text!r} is not a port; pass a number from 1 to 65535")
  return int(text)


def _seconds(text: str) -> int:
  if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; pass a whole number >= 1")
  return int(text)


def parse_flags(argv: list[str]) -> argparse.Namespace:
  p = FlagParser(
    prog="multihost_runner.py",
    description="Copies SCRIPT_DIR to every worker and runs COMMAND on all of them as one JAX job.",
    allow_abbrev=False,
  )
  tpu = p.add_argument_group("Cloud TPU VMs (gcloud)")
  tpu.add_argument("--TPU_PREFIX", help="the TPU's name, or the prefix of slices named PREFIX-0, PREFIX-1, ...")
  tpu.add_argument("--PROJECT", help="Google Cloud project (default: `gcloud config get project`)")
  tpu.add_argument("--ZONE", help="zone of the TPUs (default: `gcloud config get compute/zone`)")
  tpu.add_argument(
    "--INTERNAL_IP",
    type=boolean,
    nargs="?",
    const=True,
    default=False,
    help="reach the TPUs by their internal IPs (true when this machine is in the same VPC, e.g. a GCE VM)",
  )
  tpu.add_argument(
    "--MEGASCALE_PORT",
    type=_port,
    default=MEGASCALE_PORT,
    help=f"port of the multi-slice coordinator (default {MEGASCALE_PORT})",
  )
  ssh = p.add_argument_group("any machines (ssh)")
  ssh.add_argument("--HOSTS", help="comma-separated hosts, worker 0 first, e.g. 10.0.0.2,10.0.0.3 or user@gpu1,user@gpu2")
  ssh.add_argument("--HOSTFILE", help="file with one host a line, worker 0 first")
  ssh.add_argument("--SSH_USER", help="user to log in as (default: ssh's: your ssh config, else your name)")
  ssh.add_argument("--SSH_PORT", type=_port, help="sshd's port on the workers (default: ssh's, usually 22)")
  ssh.add_argument("--SSH_KEY", help="private key file to log in with (default: ssh's keys and agent)")
  ssh.add_argument(
    "--SSH_OPTION",
    action="append",
    default=[],
    help="more ssh options as KEY=VALUE, e.g. --SSH_OPTION=ProxyJump=bastion; may be repeated",
  )
  ssh.add_argument("--COORDINATOR_HOST", help="address the workers reach worker 0 at (default: its host in --HOSTS)")
  ssh.add_argument(
    "--COORDINATOR_PORT",
    type=_port,
    default=JAX_COORDINATOR_PORT,
    help=f"port of JAX's coordinator on worker 0 (default {JAX_COORDINATOR_PORT})",
  )
  both = p.add_argument_group("both")
  both.add_argument("--COMMAND", help="shell command every worker runs in its copy of SCRIPT_DIR")
  both.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="folder copied to every worker (default: this one)")
  both.add_argument(
    "--RUN_NAME", help="name of the workers' copy of SCRIPT_DIR and of the log folder (default: the date and time)"
  )
  both.add_argument(
    "--USE_EXISTING_FOLDER",
    type=boolean,
    nargs="?",
    const=True,
    default=False,
    help="run in the copy an earlier run with this RUN_NAME left, without copying",
  )
  both.add_argument("--REMOTE_DIR", default="~", help="folder on the workers that holds RUN_NAME (default: ~)")
  both.add_argument(
    "--LOG_DIR", help="local folder for the workers' logs and the archive (default: the temporary folder / RUN_NAME)"
  )
  both.add_argument("--SSH_CONNECT_TIMEOUT", type=_seconds, default=10, help="seconds to wait for a connection")
  both.add_argument(
    "--SSH_ALIVE_INTERVAL", type=_seconds, default=5, help="seconds between keep-alives; 3 unanswered ones end a connection"
  )
  both.add_argument(
    "--STOP_GRACE", type=_seconds, default=10, help="seconds between SIGTERM and SIGKILL when workers are stopped"
  )
  return p.parse_args(argv)


def check_run_name(run_name: str) -> str:
  """A relative path: no '..', no control characters. Spaces, quotes or ';' are fine (they are always quoted)."""
  parts = [part for part in run_name.split("/") if part not in ("", ".")]
  if not parts or run_name.startswith("/") or ".." in parts or re.search(r"[\x00-\x1f\x7f]", run_name):
    raise UsageError(
      f"--RUN_NAME={run_name!r} is not a relative folder name; give a name without '..', control characters or a "
      "leading '/', e.g. --RUN_NAME=my-run"
    )
  return "/".join(parts)


def _check_host(entry: str, where: str) -> str:
  user, _, host = entry.rpartition("@")
  if not host or re.search(r"[\s/]", entry) or host.startswith("-") or user.startswith("-") or "@" in user:
    raise UsageError(f"{where}: {entry!r} is not a host; give a host name or address, or user@host, e.g. 10.0.0.2")
  return entry


def ssh_hosts(flags: argparse.Namespace) -> list[str]:
  """The hosts of --HOSTS or --HOSTFILE, worker 0 first."""
  if flags.HOSTS is not None and flags.HOSTFILE is not None:
    raise UsageError("--HOSTS and --HOSTFILE are both given; name the machines with one of them")
  if flags.HOSTFILE is not None:
    try:
      with open(os.path.expanduser(flags.HOSTFILE), encoding="utf-8") as f:
        lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
      raise UsageError(
        f"--HOSTFILE={flags.HOSTFILE!r} cannot be read ({e.strerror or e}); pass a text file with one host a line"
      ) from None
    words = [line.split("#", 1)[0].split() for line in lines]
    hosts = [_check_host(w[0], f"--HOSTFILE={flags.HOSTFILE!r}") for w in words if w]
    if not hosts:
      raise UsageError(f"--HOSTFILE={flags.HOSTFILE!r} names no host; put one host a line in it, worker 0 first")
    return hosts
  hosts = [_check_host(h.strip(), "--HOSTS") for h in flags.HOSTS.split(",") if h.strip()]
  if not hosts:
    raise UsageError("--HOSTS names no host; pass the machines as --HOSTS=h1,h2,..., worker 0 first")
  return hosts


def remote_path(path: str) -> str:
  """A shell word for a worker-side path: ~ and relative paths are in $HOME; the rest is quoted."""
  if path in ("", "~"):
    return '"$HOME"'
  if path.startswith("~/"):
    return '"$HOME"/' + shlex.quote(path[2:])
  if path.startswith("~"):
    raise UsageError(f"--REMOTE_DIR={path!r}: only ~ (the login user's home) is understood; give ~/..., or a full path")
  return shlex.quote(path) if path.startswith("/") else '"$HOME"/' + shlex.quote(path)


def _address(host: str, port: int) -> str:
  host = host.rpartition("@")[2].strip("[]")
  try:
    bracket = ipaddress.ip_address(host).version == 6
  except ValueError:
    bracket = False
  return f"[{host}]:{port}" if bracket else f"{host}:{port}"


# ---------------------------------------------------------------------------------------------- transports
class Ssh:
  """Plain ssh to any machine; each worker's position in --HOSTS is its JAX process id."""

  label = "ssh"
  setup = ""  # Worker-side shell code run before copying.
  fix = "check the host name, --SSH_PORT, --SSH_USER and --SSH_KEY, and that sshd runs there"

  def __init__(self, flags: argparse.Namespace):
    if shutil.which("ssh") is None:
      raise UsageError("ssh is not on PATH; install OpenSSH's client (e.g. apt-get install openssh-client)")
    options = []
    for option in flags.SSH_OPTION:  # First: ssh keeps the first value it is given for an option.
      if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*[= ]\S.*", option):
        raise UsageError(f"--SSH_OPTION={option!r} is not KEY=VALUE; pass an ssh option, e.g. --SSH_OPTION=ProxyJump=gw")
      options += ["-o", option]
    if flags.SSH_KEY is not None:
      key = os.path.expanduser(flags.SSH_KEY)
      if not os.path.isfile(key):
        raise UsageError(f"--SSH_KEY={flags.SSH_KEY!r} is not a file; pass the private key, e.g. ~/.ssh/id_ed25519")
      options += ["-i", key, "-o", "IdentitiesOnly=yes"]
    if flags.SSH_PORT is not None:
      options += ["-p", str(flags.SSH_PORT)]
    self.user = ["-l", flags.SSH_USER] if flags.SSH_USER else []  # Not for user@host entries: -l would win.
    always = (
      "BatchMode=yes",  # Never wait for a password, or for an answer to a question nobody sees.
      f"ConnectTimeout={flags.SSH_CONNECT_TIMEOUT}",
      f"ServerAliveInterval={flags.SSH_ALIVE_INTERVAL}",
      "ServerAliveCountMax=3",
      "StrictHostKeyChecking=accept-new",
    )
    self.options = options + [arg for option in always for arg in ("-o", option)]
    hosts = ssh_hosts(flags)
    coordinator = _address(flags.COORDINATOR_HOST or hosts[0], flags.COORDINATOR_PORT)
    self.workers = [
      Worker(
        i,
        host,
        re.sub(r"\[(.*)\]", r"\1", host),
        env=(("JAX_COORDINATOR_ADDRESS", coordinator), ("JAX_PROCESS_COUNT", str(len(hosts))), ("JAX_PROCESS_ID", str(i))),
      )
      for i, host in enumerate(hosts)
    ]

  def command(self, worker: Worker, script: str) -> list[str]:
    user = [] if "@" in worker.host else self.user
    return ["ssh", *self.options, *user, "--", worker.host, "sh -c " + shlex.quote(script)]

  def upload(self, worker: Worker, archive: str, token: str) -> tuple[list[list[str]], str]:
    """(commands to run first, the archive's worker-side path or '-' for stdin)."""
    return [], "-"


class Gcloud:
  """Cloud TPU VMs through `gcloud compute tpus tpu-vm`."""

  label = "gcloud"
  setup = TPU_CLEANUP + "\n"
  fix = "check --PROJECT, --ZONE and --INTERNAL_IP, and that `gcloud compute tpus tpu-vm ssh` works"

  def __init__(self, flags: argparse.Namespace):
    if shutil.which("gcloud") is None:
      raise UsageError("gcloud is not on PATH; install the Google Cloud CLI, or name the machines with --HOSTS")
    self.project = flags.PROJECT or gcloud_default("project", "--PROJECT")
    self.zone = flags.ZONE or gcloud_default("compute/zone", "--ZONE")
    self.where = [f"--project={self.project}", f"--zone={self.zone}"]
    self.internal_ip = ["--internal-ip"] if flags.INTERNAL_IP else []
    timeouts = [f"ConnectTimeout={flags.SSH_CONNECT_TIMEOUT}", f"ServerAliveInterval={flags.SSH_ALIVE_INTERVAL}"]
    self.ssh_options = [f"-o{option}" for option in ("BatchMode=yes", *timeouts, "ServerAliveCountMax=3")]
    slices = self.find_slices(flags.TPU_PREFIX)
    coordinator = slices[0][1][0]
    self.workers = []
    for slice_id, (name, addresses) in enumerate(slices):
      env = ()
      if len(slices) > 1:
        env = (
          ("MEGASCALE_COORDINATOR_ADDRESS", f"{coordinator}:{flags.MEGASCALE_PORT}"),
          ("MEGASCALE_NUM_SLICES", str(len(slices))),
          ("MEGASCALE_SLICE_ID", str(slice_id)),
          ("MEGASCALE_PORT", str(flags.MEGASCALE_PORT)),
        )
      for w in range(len(addresses)):
        self.workers.append(Worker(len(self.workers), f"{name} worker {w}", name, w, env))

  def gcloud(self, *args: str) -> list[str]:
    """A gcloud lookup's output lines; a failure is a UsageError with gcloud's last line."""
    result = subprocess.run(["gcloud", *args, *self.where], capture_output=True, text=True, check=False)
    if result.returncode != 0:
      reason = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
      raise UsageError(f"`gcloud {' '.join(args[:4])}` failed: {reason}; check --PROJECT, --ZONE and `gcloud auth login`")
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]

  def find_slices(self, prefix: str) -> list[tuple[str, list[str]]]:
    """[(slice name, its workers' internal IPs)], slice 0 first: the TPU named PREFIX, else PREFIX-0, PREFIX-1, ..."""
    listed = self.gcloud(*TPU_VM[1:], "list", f"--filter=name~{prefix}", "--format=csv[no-heading](name)")
    names = [line.rsplit("/", 1)[-1] for line in listed]  # Full resource names end in /nodes/NAME.
    if prefix in names:
      names = [prefix]
    else:
      numbered = {int(n[len(prefix) + 1 :]): n for n in names if re.fullmatch(re.escape(prefix) + r"-\d+", n)}
      if not numbered:
        raise UsageError(
          f"no TPU named {prefix} or {prefix}-<number> in {self.project} {self.zone}; check --TPU_PREFIX, "
          "--PROJECT and --ZONE (`gcloud compute tpus tpu-vm list`)"
        )
      if sorted(numbered) != list(range(len(numbered))):
        raise UsageError(
          f"the slices found, {sorted(numbered.values())}, are not {prefix}-0 to {prefix}-"
          f"{len(numbered) - 1}; name the slices of one job {prefix}-0, {prefix}-1, ..."
        )
      names = [numbered[i] for i in range(len(numbered))]
    slices = []
    for name in names:
      endpoints = ["--flatten=networkEndpoints[]", "--format=csv[no-heading](networkEndpoints.ipAddress)"]
      ips = self.gcloud(*TPU_VM[1:], "describe", name, *endpoints)
      if not ips:
        raise UsageError(f"TPU {name} has no workers (no network endpoints); check that it is READY")
      slices.append((name, ips))
    return slices

  def command(self, worker: Worker, script: str) -> list[str]:
    flags = [f"--worker={worker.tpu_worker}", "--strict-host-key-checking=no", *self.where, *self.internal_ip]
    ssh_flags = [f"--ssh-flag={option}" for option in self.ssh_options]
    return [*TPU_VM, "ssh", worker.host, *flags, *ssh_flags, "--command", "sh -c " + shlex.quote(script)]

  def upload(self, worker: Worker, archive: str, token: str) -> tuple[list[list[str]], str]:
    # One archive per worker and invocation: workers sharing a home must not unpack each other's half-copied file.
    name = f".multihost_runner_{token}_{worker.index}.tar.gz"
    flags = [f"--worker={worker.tpu_worker}", "--strict-host-key-checking=no", *self.where, *self.internal_ip]
    scp_flags = [f"--scp-flag={option}" for option in self.ssh_options]
    return [[*TPU_VM, "scp", archive, f"{worker.host}:{name}", *flags, *scp_flags]], name


# ---------------------------------------------------------------------------------------------- worker-side scripts
def unpack_script(remote_dir: str, run_name: str, source: str, token: str) -> str:
  """Unpacks the archive (`-`: stdin, else a file in $HOME, then deleted) into REMOTE_DIR/RUN_NAME.

  Into a fresh folder next to the target, then renamed into place, so a reader never sees half a copy. Workers
  sharing a file system race here: each loop either finds this invocation's copy (COPY_MARK) in place, renames its
  own there, or moves whatever else is there (an older copy, or a sibling's) aside and tries again.
  """
  parent, base = posixpath.split(run_name)
  folder = remote_path(remote_dir) + ("/" + shlex.quote(parent) if parent else "")
  target, mark, token = "./" + shlex.quote(base), shlex.quote(COPY_MARK), shlex.quote(token)
  archive = "-" if source == "-" else '"$HOME"/' + shlex.quote(source)
  return f"""set -e
mkdir -p {folder}
cd {folder}
archive={archive}
new=$(mktemp -d ./.multihost_runner.XXXXXX)
old=$(mktemp -d ./.multihost_runner.XXXXXX)
trap 'rm -rf "$new" "$old"; [ "$archive" = - ] || rm -f "$archive"' EXIT
tar -xzf "$archive" -C "$new"
printf '%s\\n' {token} > "$new"/{mark}
tries=0
while [ "$(cat {target}/{mark} 2>/dev/null)" != {token} ]; do
  if mv -T "$new" {target} 2>/dev/null; then break; fi
  mv -T {target} "$old/$tries" 2>/dev/null || true
  tries=$((tries + 1))
  if [ "$tries" -ge {SWAP_TRIES} ]; then printf 'cannot rename a copy to %s\n' "$PWD"/{target} >&2; exit 1; fi
done
"""


def check_folder_script(remote_dir: str, run_name: str) -> str:
  target = remote_path(remote_dir) + "/" + shlex.quote(run_name)
  return f"""set -e
if [ ! -d {target} ]; then printf 'no folder %s\n' {target} >&2; exit {NO_FOLDER}; fi
"""


def run_script(remote_dir: str, run_name: str, command: str, env: tuple[tuple[str, str], ...], grace: int) -> str:
  """`cd REMOTE_DIR/RUN_NAME && COMMAND` with the worker's variables, ended when the connection's stdin closes.

  COMMAND runs in the login shell ($SHELL -c) in its own session (setsid), so `kill -SIG -PGID` reaches everything
  it starts; the watchdog holds the connection's stdin on fd 3 (a background list's own stdin is /dev/null). Bash
  gets --norc: the session's bash has read ~/.bashrc already and exported what it sets, and reading it again would
  put its work (e.g. `pyenv init`'s rehash, which holds a lock) in the group a stop kills. The exit code is COMMAND's.
  """
  exports = "".join(f"export {name}={shlex.quote(value)}\n" for name, value in env)
  return f"""cd {remote_path(remote_dir)}/{shlex.quote(run_name)} || exit 1
{exports}exec 3<&0 0</dev/null
shell=${{SHELL:-/bin/sh}}
case "$shell" in */bash) set -- --norc -c ;; *) set -- -c ;; esac
setsid "$shell" "$@" {shlex.quote(command)} 3<&- &
job=$!
{{ cat <&3; kill -TERM -$job; sleep {grace}; kill -KILL -$job; }} >/dev/null 2>&1 &
watchdog=$!
exec 3<&-
wait $job
code=$?
kill $watchdog 2>/dev/null
kill -KILL -$job 2>/dev/null
exit $code
"""


# ---------------------------------------------------------------------------------------------- packing, copying
def pack(script_dir: str, archive: str) -> int:
  """SCRIPT_DIR as ARCHIVE (tar.gz), without EXCLUDED_NAMES or the archive itself; returns the number of files."""
  skip = {os.path.realpath(archive)}
  log_dir, root = os.path.realpath(os.path.dirname(archive)), os.path.realpath(script_dir)
  if log_dir.startswith(root + os.sep):  # The logs of this run (and of earlier ones) stay here.
    skip.add(log_dir)
  count = 0

  def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    nonlocal count
    path = os.path.realpath(os.path.join(script_dir, info.name))
    if os.path.basename(info.name) in EXCLUDED_NAMES or path in skip:
      return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    count += info.isfile()
    return info

  with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
    tar.add(script_dir, arcname=".", filter=keep)
  return count


class Children:
  """Local child processes, so that an interruption can end the ones still running."""

  def __init__(self):
    self.lock = threading.Lock()
    self.procs: set[subprocess.Popen] = set()

  def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
    with self.lock:  # start_new_session: Ctrl-C reaches this script only; it stops the workers itself.
      proc = subprocess.Popen(argv, start_new_session=True, **kwargs)
      self.procs.add(proc)
      return proc

  def end_all(self, wait: float = 5.0) -> None:
    with self.lock:
      procs = [p for p in self.procs if p.poll() is None]
    for proc in procs:
      proc.terminate()
    deadline = time.monotonic() + wait
    for proc in procs:
      try:
        proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_captured(children: Children, argv: list[str], stdin_path: str | None = None) -> tuple[int, str]:
  with open(stdin_path or os.devnull, "rb") as stdin:
    proc = children.popen(argv, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.communicate()[0]
  return proc.returncode, output.decode(errors="replace")


def prepare(transport, workers, flags, archive: str | None, token: str, console, children: Children) -> None:
  """Copies the archive to every worker (or checks the existing folder); raises UsageError or JobFailed.

  Their output (ssh's warnings, the TPU clean-up) is shown once all are done, or is the error's reason.
  """

  def one(worker: Worker) -> tuple[int, str]:
    if archive is None:
      script = transport.setup + check_folder_script(flags.REMOTE_DIR, flags.RUN_NAME)
      return run_captured(children, transport.command(worker, script))
    uploads, source = transport.upload(worker, archive, token)
    for argv in uploads:
      code, output = run_captured(children, argv)
      if code != 0:
        return code, output
    script = transport.setup + unpack_script(flags.REMOTE_DIR, flags.RUN_NAME, source, token)
    return run_captured(children, transport.command(worker, script), archive if source == "-" else None)

  with concurrent.futures.ThreadPoolExecutor(min(32, len(workers))) as pool:
    try:
      results = list(pool.map(one, workers))
    except BaseException:  # Ctrl-C: end the copies, so that the pool's threads end too.
      children.end_all()
      raise
  for worker, (code, output) in zip(workers, results, strict=True):
    last = (output.strip().splitlines() or [f"exit code {code}"])[-1].strip()
    if code == SSH_ERROR:
      raise UsageError(f"cannot reach worker {worker.index} ({worker.name}) with {transport.label}: {last}; {transport.fix}")
    if code == NO_FOLDER and archive is None:
      raise UsageError(
        f"worker {worker.index} ({worker.name}) has no folder {flags.RUN_NAME!r} in "
        f"{flags.REMOTE_DIR!r}; run once without --USE_EXISTING_FOLDER to copy SCRIPT_DIR there"
      )
    if code == 0:
      for line in output.splitlines():
        console.line(f"[worker {worker.index}] ".encode(), line.encode())
    else:
      raise JobFailed(f"copying SCRIPT_DIR to worker {worker.index} ({worker.name}) failed with exit code {code}: {last}")


# ---------------------------------------------------------------------------------------------- running
class Console:
  """Prints the workers' lines, whole and prefixed, from several threads."""

  def __init__(self, stream=None):
    self.stream = stream or sys.stdout.buffer
    self.lock = threading.Lock()

  def line(self, prefix: bytes, data: bytes) -> None:
    with self.lock:
      try:
        self.stream.write(prefix + data + (b"" if data.endswith(b"\n") else b"\n"))
        self.stream.flush()
      except (OSError, ValueError):  # Our stdout is gone (e.g. piped to `head`): the logs still get everything.
        pass

  def say(self, text: str) -> None:
    self.line(b"", f"multihost_runner: {text}".encode())


class Running:
  """One worker's COMMAND: its ssh process, the thread copying its output, and its log."""

  def __init__(self, worker: Worker, argv: list[str], log_path: str, console: Console, children: Children, done):
    self.worker, self.log_path = worker, log_path
    self.log = open(log_path, "wb")  # Closed by the pump thread, once the worker's output ends.
    self.proc = children.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    prefix = f"[worker {worker.index}] ".encode()

    def pump():
      try:
        for data in iter(self.proc.stdout.readline, b""):
          self.log.write(data)
          self.log.flush()
          console.line(prefix, data)
      finally:
        self.log.close()
        done.put((worker.index, self.proc.wait()))

    self.thread = threading.Thread(target=pump, name=f"worker-{worker.index}", daemon=True)
    self.thread.start()

  def hang_up(self) -> None:
    """Closes the connection's stdin: the worker's watchdog ends COMMAND."""
    try:
      self.proc.stdin.close()
    except OSError:
      pass


def stop(runs: list[Running], grace: int) -> None:
  """Hangs up on each worker and waits for its ssh to end; ends the local ssh of any that does not."""
  for run in runs:
    run.hang_up()
  deadline = time.monotonic() + grace + 15
  for run in runs:
    try:
      run.proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      run.proc.kill()  # The worker then sees the connection drop, which also ends its COMMAND.
      run.proc.wait()
  for run in runs:
    run.thread.join(5)


def tail(path: str, lines: int = TAIL_LINES) -> str:
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - 64 * 1024))
    return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")


def run_all(transport, workers, flags, log_dir: str, console: Console, children: Children) -> None:
  """Runs COMMAND everywhere until all succeed (returns) or one fails (stops the rest, raises JobFailed)."""
  done: queue.Queue = queue.Queue()
  runs = {}
  try:
    for w in workers:
      script = run_script(flags.REMOTE_DIR, flags.RUN_NAME, flags.COMMAND, w.env, flags.STOP_GRACE)
      runs[w.index] = Running(
        w, transport.command(w, script), os.path.join(log_dir, f"worker_{w.index}.log"), console, children, done
      )
    remaining = set(runs)
    while remaining:
      index, code = done.get()
      remaining.discard(index)
      if code != 0:
        break
  except BaseException:
    console.say(f"interrupted: stopping {len(runs)} workers")
    stop(list(runs.values()), flags.STOP_GRACE)
    raise
  if not remaining:
    for run in runs.values():
      run.thread.join(5)
    return
  others = ", ".join(map(str, sorted(remaining)))
  console.say(f"worker {index} failed; stopping the others ({others})" if others else f"worker {index} failed")
  stop([runs[i] for i in sorted(remaining)], flags.STOP_GRACE)
  failed = runs[index]
  if code == SSH_ERROR:
    what = f"lost its {transport.label} connection or exited with code {SSH_ERROR}"
  else:
    what = f"exited with code {code}"
  raise JobFailed(
    f"worker {index} ({failed.worker.name}) {what}; last lines of its log ({failed.log_path}):\n{tail(failed.log_path)}"
  )


# ---------------------------------------------------------------------------------------------- main
class Interrupted(KeyboardInterrupt):
  """SIGTERM or SIGHUP, handled like Ctrl-C: the workers are stopped."""

  def __init__(self, signum: int = signal.SIGINT):
    super().__init__(signum)
    self.signum = signum


def _interrupt(signum, frame):
  raise Interrupted(signum)


def main(argv: list[str]) -> int:
  children = Children()
  console = Console()
  try:
    flags = parse_flags(argv)
    flags.COMMAND = check_command(flags.COMMAND)
    flags.RUN_NAME = check_run_name(flags.RUN_NAME or f"{datetime.datetime.now():%Y-%m-%d-%H-%M-%S}")
    remote_path(flags.REMOTE_DIR)  # Checks it.
    script_dir = os.path.abspath(os.path.expanduser(flags.SCRIPT_DIR))
    if not flags.USE_EXISTING_FOLDER and not os.path.isdir(script_dir):
      raise UsageError(f"--SCRIPT_DIR={flags.SCRIPT_DIR!r} is not a folder; pass the folder to copy (default: this one)")
    ssh_given = [
      f
      for f in ("HOSTS", "HOSTFILE", "SSH_USER", "SSH_PORT", "SSH_KEY", "COORDINATOR_HOST")
      if getattr(flags, f) is not None
    ] + (["SSH_OPTION"] if flags.SSH_OPTION else [])
    if flags.TPU_PREFIX is not None:
      if ssh_given:
        raise UsageError(
          f"--TPU_PREFIX and --{ssh_given[0]} are both given; use --TPU_PREFIX for Cloud TPU VMs, or "
          "--HOSTS/--HOSTFILE (with the --SSH_* flags) for other machines"
        )
      if not flags.TPU_PREFIX.strip():
        raise UsageError("--TPU_PREFIX is empty; pass the TPU's name, or the prefix of slices PREFIX-0, PREFIX-1, ...")
      transport = Gcloud(flags)
    elif flags.HOSTS is not None or flags.HOSTFILE is not None:
      transport = Ssh(flags)
    else:
      raise UsageError(
        "no workers named; pass --HOSTS=h1,h2,... (or --HOSTFILE=FILE) for machines reached by ssh, "
        "or --TPU_PREFIX=NAME for Cloud TPU VMs"
      )
    workers = transport.workers
    log_dir = os.path.abspath(os.path.expanduser(flags.LOG_DIR or os.path.join(tempfile.gettempdir(), flags.RUN_NAME)))
    try:
      os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
      raise UsageError(f"cannot make the log folder {log_dir!r} ({e.strerror}); pass a writable --LOG_DIR") from None

    for signum in (signal.SIGTERM, signal.SIGHUP):
      signal.signal(signum, _interrupt)
    where = f"{flags.REMOTE_DIR.rstrip('/')}/{flags.RUN_NAME}"
    names = ", ".join(f"{w.index}: {w.name}" for w in workers)
    console.say(f"{len(workers)} workers ({names}); logs in {log_dir}")
    start = time.monotonic()
    token = secrets.token_hex(8)
    if flags.USE_EXISTING_FOLDER:
      console.say(f"using the existing {where} on every worker")
      prepare(transport, workers, flags, None, token, console, children)
    else:
      archive = os.path.join(log_dir, "script_dir.tar.gz")
      files = pack(script_dir, archive)
      console.say(f"copying {script_dir} ({files} files, {os.path.getsize(archive) / 1e6:.1f} MB) to {where}")
      prepare(transport, workers, flags, archive, token, console, children)
    console.say(f"running on {len(workers)} workers: cd {where} && {flags.COMMAND}")
    run_all(transport, workers, flags, log_dir, console, children)
    console.say(f"all {len(workers)} workers finished in {time.monotonic() - start:.1f} s; logs in {log_dir}")
    return 0
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  except JobFailed as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 1
  except KeyboardInterrupt as e:
    children.end_all()
    signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
    print(f"error: interrupted by {signal.Signals(signum).name}; the workers were stopped", file=sys.stderr, flush=True)
    return 128 + signum


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
