"""Runs a command on every worker of new Cloud TPU slices, keeps the logs in Cloud Storage, then deletes the TPUs.

  python3 multihost_job.py --BUCKET_NAME=my-bucket --NUM_SLICES=2 --TPU_TYPE=v4-8 \
    --COMMAND="bash setup.sh && python3 MaxText/train.py MaxText/configs/base.yml run_name=my-run"

MaxText's flags (--NUM_SLICES, --TPU_TYPE, --VERSION, --BUCKET_NAME, --BUCKET_DIR, --RUN_NAME, --COMMAND,
--SCRIPT_DIR, --PROJECT, --ZONE, --CQR_EXTRA_ARGS, --ENABLE_AUTOCHECKPOINT) mean what they mean there. In order:
  1. the flags, SCRIPT_DIR and the shell syntax of COMMAND are checked: a mistake is one line and exit code 2;
  2. `gsutil ls -b gs://BUCKET_NAME`: the bucket must exist; `gsutil ls gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/`: the
     run's folder must not (old logs there would make worker 0 delete the TPUs before the job ends);
  3. SCRIPT_DIR is packed into one archive (without .git and __pycache__) and uploaded to
     gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/;
  4. `gcloud alpha compute tpus queued-resources create RUN_NAME` asks for NUM_SLICES slices of TPU_TYPE with a
     startup script that, on every worker VM, downloads and unpacks the archive, runs COMMAND there (as
     `bash -c COMMAND`, with SLICE_ID and WORKER_ID set) and uploads its log; worker 0 of slice 0 then deletes
     the queued resource, and with it every TPU VM (see startup_script);
  5. it prints where the logs will be and how to watch or stop the job, and returns: the job runs on its own.
--DRY_RUN prints the commands of steps 2-4 (a shell script) instead of running them.

The startup script leaves the multi-slice variables (MEGASCALE_*, TPU_WORKER_*) to the TPU runtime, which sets
them on every VM and from which JAX (and MaxText/distributed.py) finds the job's processes. This file never
imports jax. Tests: MaxText/tests/multihost_job_test.py, against the local stand-ins in MaxText/tests/fake_cloud.
"""

import argparse
import dataclasses
import datetime
import getpass
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from multihost_flags import FlagParser, UsageError, boolean, check_command, gcloud_default

QUEUED_RESOURCES = ["gcloud", "alpha", "compute", "tpus", "queued-resources"]
LOG_PREFIX = "main_command_log_slice_"  # Logs are main_command_log_slice_<S>_worker_<W>, as in MaxText.
# Compute Engine resource names: a lowercase letter, then lowercase letters, digits or '-', not ending in '-'.
RESOURCE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME_LENGTH = 63
BUCKET_NAME = re.compile(r"[a-z0-9][-a-z0-9._]{1,220}[a-z0-9]")
# Clean-up waits this long at most for every worker's log (5 s between looks), as MaxText's 10 minutes.
TEARDOWN_POLLS, TEARDOWN_POLL_SECONDS = 120, 5


class CloudError(Exception):
  """A gcloud or gsutil command failed (exit code 1)."""


@dataclasses.dataclass(frozen=True)
class Job:
  """The resolved flags of one job."""

  run_name: str
  tpu_type: str
  version: str
  num_slices: int
  script_dir: str
  bucket_name: str
  bucket_dir: str
  project: str
  zone: str
  command: str
  cqr_extra_args: tuple[str, ...]
  autocheckpoint: bool

  @property
  def bucket_path(self) -> str:
    """gs://BUCKET/BUCKET_DIR/RUN_NAME: the archive and the logs."""
    return "/".join(["gs:/", self.bucket_name, *([self.bucket_dir] if self.bucket_dir else []), self.run_name])

  @property
  def archive_name(self) -> str:
    return f"script_dir_zip_{self.run_name}.tar.gz"


# ---------------------------------------------------------------------------------------------- flags
def _num_slices(text: str) -> int:
  if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number of slices; pass a whole number >= 1, e.g. --NUM_SLICES=2")
  return int(text)


def parse_flags(argv: list[str]) -> argparse.Namespace:
  p = FlagParser(
    prog="multihost_job.py",
    description="Runs COMMAND on every worker of NUM_SLICES new TPU slices (a queued resource), keeps each worker's "
    "log in gs://BUCKET_NAME/BUCKET_DIR/RUN_NAME/ and deletes the TPUs at the end.",
    allow_abbrev=False,
  )
  p.add_argument("--TPU_TYPE", default="v4-8", help="accelerator type of each slice (default v4-8)")
  p.add_argument("--VERSION", default="tpu-ubuntu2204-base", help="TPU runtime version (default tpu-ubuntu2204-base)")
  p.add_argument("--NUM_SLICES", type=_num_slices, default=2, help="number of slices (default 2)")
  p.add_argument("--SCRIPT_DIR", default=os.getcwd(), help="folder uploaded to every worker; COMMAND runs there")
  p.add_argument("--COMMAND", help="shell command each worker runs, setup included, e.g. 'bash setup.sh && python3 ...'")
  p.add_argument("--BUCKET_NAME", help="Cloud Storage bucket for the code and the logs, e.g. my-bucket")
  p.add_argument("--BUCKET_DIR", default="", help="folder in the bucket (default: its top)")
  p.add_argument("--PROJECT", help="Google Cloud project (default: `gcloud config get project`)")
  p.add_argument("--ZONE", help="zone of the TPUs (default: `gcloud config get compute/zone`)")
  p.add_argument("--RUN_NAME", help="name of the queued resource and its TPUs (default: USER-date-time)")
  p.add_argument("--CQR_EXTRA_ARGS", default="", help="more flags for `queued-resources create`, e.g. '--reserved'")
  p.add_argument(
    "--ENABLE_AUTOCHECKPOINT",
    type=boolean,
    nargs="?",
    const=True,
    default=False,
    help="create the TPUs with Autocheckpoint",
  )
  p.add_argument("--DRY_RUN", action="store_true", help="print the gcloud/gsutil commands instead of running them")
  return p.parse_args(argv)


def default_run_name() -> str:
  user = re.sub(r"[^a-z0-9]+", "-", getpass.getuser().lower()).strip("-")
  user = user if user[:1].isalpha() else f"job-{user}".rstrip("-")
  return f"{user[:30]}-{datetime.datetime.now():%Y-%m-%d-%H-%M-%S}"


def check_run_name(name: str, num_slices: int) -> None:
  # With --node-prefix the slices are named RUN_NAME-0, RUN_NAME-1, ...: those must be valid names too.
  suffix = len(f"-{num_slices - 1}") if num_slices > 1 else 0
  if not RESOURCE_NAME.fullmatch(name) or len(name) + suffix > MAX_NAME_LENGTH:
    raise UsageError(
      f"--RUN_NAME={name!r} is not a valid TPU name; use lowercase letters, digits and '-', starting with a letter, "
      f"at most {MAX_NAME_LENGTH - suffix} characters, e.g. --RUN_NAME=my-run-1"
    )


def check_bucket_dir(bucket_dir: str) -> str:
  """BUCKET_DIR without leading or trailing '/'; gsutil would take * ? [ ] as wildcards, so they are refused."""
  cleaned = bucket_dir.strip("/")
  parts = cleaned.split("/") if cleaned else []
  if re.search(r"[*?\[\]\n\r]", cleaned) or any(part in ("", ".", "..") for part in parts):
    raise UsageError(
      f"--BUCKET_DIR={bucket_dir!r} is not a plain folder path; leave out * ? [ ], line breaks, '.', '..' and empty "
      "parts, e.g. --BUCKET_DIR=jobs/llama"
    )
  return cleaned


def resolve(flags: argparse.Namespace) -> Job:
  """The job the flags describe; raises UsageError on the first mistake. Looks up PROJECT and ZONE unless dry."""
  command = check_command(flags.COMMAND)
  script_dir = os.path.abspath(os.path.expanduser(flags.SCRIPT_DIR))
  if not os.path.isdir(script_dir):
    raise UsageError(f"--SCRIPT_DIR={flags.SCRIPT_DIR!r} is not a folder; pass the folder to upload (default: this one)")
  bucket = (flags.BUCKET_NAME or "").strip().removeprefix("gs://").rstrip("/")
  if not bucket:
    raise UsageError(
      "--BUCKET_NAME is missing; pass the Cloud Storage bucket for the code and the logs, e.g. --BUCKET_NAME=my-bucket"
    )
  if not BUCKET_NAME.fullmatch(bucket):
    raise UsageError(
      f"--BUCKET_NAME={flags.BUCKET_NAME!r} is not a bucket name; use 3-222 lowercase letters, digits, '-', '_' or '.', "
      "e.g. --BUCKET_NAME=my-bucket (its folder goes in --BUCKET_DIR)"
    )
  run_name = flags.RUN_NAME if flags.RUN_NAME is not None else default_run_name()
  check_run_name(run_name, flags.NUM_SLICES)
  try:
    extra = tuple(shlex.split(flags.CQR_EXTRA_ARGS))
  except ValueError as e:
    raise UsageError(
      f"--CQR_EXTRA_ARGS={flags.CQR_EXTRA_ARGS!r} cannot be split into arguments ({e}); balance its quotes"
    ) from None
  project, zone = flags.PROJECT, flags.ZONE
  if flags.DRY_RUN and not (project and zone):
    raise UsageError(
      "--DRY_RUN runs no gcloud command, so it cannot look up the default project and zone; pass --PROJECT and --ZONE"
    )
  return Job(
    run_name=run_name,
    tpu_type=flags.TPU_TYPE,
    version=flags.VERSION,
    num_slices=flags.NUM_SLICES,
    script_dir=script_dir,
    bucket_name=bucket,
    bucket_dir=check_bucket_dir(flags.BUCKET_DIR),
    project=project or gcloud_default("project", "--PROJECT"),
    zone=zone or gcloud_default("compute/zone", "--ZONE"),
    command=command,
    cqr_extra_args=extra,
    autocheckpoint=flags.ENABLE_AUTOCHECKPOINT,
  )


# ---------------------------------------------------------------------------------------------- commands
def bucket_check_command(job: Job) -> list[str]:
  return ["gsutil", "ls", "-b", f"gs://{job.bucket_name}"]


def run_folder_check_command(job: Job) -> list[str]:
  return ["gsutil", "ls", f"{job.bucket_path}/"]


def archive_command(job: Job, archive_path: str) -> list[str]:
  return ["tar", "-czf", archive_path, "--exclude=./.git", "--exclude=__pycache__", "-C", job.script_dir, "."]


def upload_command(job: Job, archive_path: str) -> list[str]:
  return ["gsutil", "cp", archive_path, f"{job.bucket_path}/{job.archive_name}"]


def create_command(job: Job, startup_script_path: str) -> list[str]:
  """The queued-resource request, flag for flag as MaxText's multihost_job.py makes it."""
  command = [
    *QUEUED_RESOURCES,
    "create",
    job.run_name,
    f"--accelerator-type={job.tpu_type}",
    f"--runtime-version={job.version}",
    f"--project={job.project}",
    f"--zone={job.zone}",
  ]
  # gcloud takes --node-count for two or more slices only; one slice is one named node.
  if job.num_slices > 1:
    command += [f"--node-prefix={job.run_name}", f"--node-count={job.num_slices}"]
  else:
    command += [f"--node-id={job.run_name}"]
  command += job.cqr_extra_args
  if job.autocheckpoint:
    command.append("--autocheckpoint-enabled")
  return [*command, f"--metadata-from-file=startup-script={startup_script_path}"]


def delete_command(job: Job) -> list[str]:
  return [*QUEUED_RESOURCES, "delete", job.run_name, "--force", "--quiet", f"--project={job.project}", f"--zone={job.zone}"]


def describe_command(job: Job) -> list[str]:
  return [*QUEUED_RESOURCES, "describe", job.run_name, f"--project={job.project}", f"--zone={job.zone}"]


def startup_script(job: Job) -> str:
  """The bash script every worker VM runs at boot. Every value in it is shell-quoted; COMMAND is run through
  `bash -c`, so a command that fails (or does not parse there) still leaves the log upload and clean-up to run.

  Clean-up: each worker uploads its log as soon as COMMAND ends; worker 0 of slice 0 then looks (every
  TEARDOWN_POLL_SECONDS s, at most TEARDOWN_POLLS times) until all slices x workers logs are in the bucket,
  adds a last line to its own log, uploads it again and deletes the queued resource, TPU VMs and all. A worker
  whose VM dies never uploads; the wait ends after 10 minutes then, so the TPUs are not kept forever.
  """
  delete = (
    'gcloud alpha compute tpus queued-resources delete "$RUN_NAME" --force --quiet --project="$PROJECT" --zone="$ZONE"'
  )
  q = shlex.quote
  if job.num_slices == 1:
    slice_id = "SLICE_ID=0  # One slice: the runtime sets no MEGASCALE_* variables."
  else:
    slice_id = "SLICE_ID=${MEGASCALE_SLICE_ID:-$(metadata tpu-env | grep '^MEGASCALE_SLICE_ID:' | cut -d \"'\" -f 2)}"
  return f"""#!/bin/bash
# Startup script of the TPU queued resource {job.run_name}, written by multihost_job.py; runs on every worker VM.
RUN_NAME={q(job.run_name)}
BUCKET_PATH={q(job.bucket_path)}
ARCHIVE={q(job.archive_name)}
COMMAND={q(job.command)}
NUM_SLICES={job.num_slices}
PROJECT={q(job.project)}
ZONE={q(job.zone)}

# Where this VM sits in the job: the TPU runtime's variables, else the metadata server (where JAX looks too).
# The server can lag the boot: up to 30 tries, 2 s apart.
metadata() {{
  for attempt in $(seq 30); do
    curl -sf --max-time 10 -H 'Metadata-Flavor: Google' \\
      "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" && return 0
    sleep 2
  done
  echo "multihost_job: the metadata server gave no $1" >&2
  return 1
}}
WORKER_ID=${{TPU_WORKER_ID:-$(metadata agent-worker-number)}}
{slice_id}
IFS=, read -ra HOSTS <<< "${{TPU_WORKER_HOSTNAMES:-$(metadata worker-network-endpoints)}}"
NUM_WORKERS=$((NUM_SLICES * ${{#HOSTS[@]}}))
# Without the worker list, clean-up cannot count the logs: it then waits its whole time before deleting.
((NUM_WORKERS > 0)) || NUM_WORKERS=$((1 << 30))

mkdir -p "$RUN_NAME" && cd "$RUN_NAME" || exit 1
LOG={LOG_PREFIX}${{SLICE_ID}}_worker_${{WORKER_ID}}
ulimit -n 100000 2>/dev/null  # Large jobs open many files.
{{
  echo "multihost_job: $RUN_NAME slice $SLICE_ID worker $WORKER_ID started $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
  # A VM can boot before its network or credentials are ready: retry the download, for 10 minutes at most.
  for attempt in $(seq 60); do
    gsutil cp "$BUCKET_PATH/$ARCHIVE" . && break
    echo "multihost_job: download attempt $attempt failed; retrying in 10 s"
    sleep 10
  done
  if tar -xzf "$ARCHIVE"; then
    SLICE_ID=$SLICE_ID WORKER_ID=$WORKER_ID bash -c "$COMMAND"
    STATUS=$?
  else
    STATUS=1
    echo "multihost_job: could not unpack $BUCKET_PATH/$ARCHIVE; COMMAND not run"
  fi
  echo "multihost_job: COMMAND exited with status $STATUS at $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
}} >> "$LOG" 2>&1
for attempt in 1 2 3; do gsutil cp "$LOG" "$BUCKET_PATH/$LOG" && break; sleep 10; done

# Clean-up (worker 0 of slice 0 only): wait for every worker's log, then delete the queued resource.
if [[ "$SLICE_ID" == 0 && "$WORKER_ID" == 0 ]]; then
  for attempt in $(seq {TEARDOWN_POLLS}); do
    UPLOADED=$(gsutil ls "$BUCKET_PATH/" 2>/dev/null | grep -c '/{LOG_PREFIX}[0-9]*_worker_[0-9]*$')
    ((UPLOADED >= NUM_WORKERS)) && break
    sleep {TEARDOWN_POLL_SECONDS}
  done
  echo "multihost_job: $UPLOADED of $NUM_WORKERS logs uploaded; deleting the queued resource $RUN_NAME" >> "$LOG"
  gsutil cp "$LOG" "$BUCKET_PATH/$LOG"
  {delete}
fi
"""


def run_cloud(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
  """Runs a gcloud/gsutil command (an argument list, never a shell line); raises CloudError if `check` and it fails."""
  try:
    result = subprocess.run(command, capture_output=True, text=True, check=False)
  except FileNotFoundError:
    raise UsageError(
      f"{command[0]} is not on PATH; install the Google Cloud SDK (https://cloud.google.com/sdk/docs/install)"
    ) from None
  if check and result.returncode != 0:
    last = (result.stderr.strip().splitlines() or ["no message"])[-1]
    raise CloudError(f"`{shlex.join(command)}` failed (exit code {result.returncode}): {last}")
  return result


# ---------------------------------------------------------------------------------------------- main
def describe(job: Job) -> list[str]:
  slices = f"{job.num_slices} slice{'s' if job.num_slices > 1 else ''}"
  return [
    f"Job {job.run_name}: {slices} of {job.tpu_type} ({job.version}) in project {job.project}, zone {job.zone}",
    f"Code: {job.script_dir} -> {job.bucket_path}/{job.archive_name}",
    f"Command on every worker: {job.command}",
  ]


def submit(job: Job, dry_run: bool, out=sys.stdout) -> None:
  """Steps 2-4; with dry_run the commands are printed (one shell command a line, the rest as # comments)."""

  def say(text: str) -> None:  # In a dry run every line but the commands is a shell comment.
    print("\n".join(f"# {line}" for line in text.split("\n")) if dry_run else text, file=out, flush=True)

  for line in describe(job):
    say(line)
  work = tempfile.mkdtemp(prefix=f"multihost_job_{job.run_name}_")
  archive, script = os.path.join(work, job.archive_name), os.path.join(work, "startup_script.sh")
  with open(script, "w", encoding="utf-8") as f:
    f.write(startup_script(job))
  steps = [bucket_check_command(job), run_folder_check_command(job), archive_command(job, archive)]
  steps += [upload_command(job, archive), create_command(job, script)]
  if dry_run:
    say(f"startup script written to {script}")
    for command in steps:
      print(shlex.join(command), file=out, flush=True)
    return
  try:
    check = run_cloud(steps[0], check=False)
    if check.returncode != 0:
      last = (check.stderr.strip().splitlines() or ["no message"])[-1]
      raise UsageError(
        f"bucket gs://{job.bucket_name} is not reachable (`{shlex.join(steps[0])}`: {last}); create it with "
        f"`gsutil mb -p {job.project} gs://{job.bucket_name}`, fix --BUCKET_NAME, or run `gcloud auth login`"
      )
    # Worker 0 counts the logs in this folder before deleting the TPUs: old ones would end the new job early.
    if run_cloud(steps[1], check=False).stdout.strip():
      raise UsageError(
        f"{job.bucket_path}/ already holds the files of a run named {job.run_name}; choose another --RUN_NAME or "
        "--BUCKET_DIR (or remove that folder)"
      )
    subprocess.run(steps[2], check=True, capture_output=True)
    say(f"Uploading the code to {job.bucket_path}/{job.archive_name}")
    run_cloud(steps[3])
    say(f"Creating the queued resource {job.run_name}")
    run_cloud(steps[4])
  finally:
    shutil.rmtree(work, ignore_errors=True)
  logs = f"{job.bucket_path}/{LOG_PREFIX}<S>_worker_<W>"
  for line in (
    "",
    f"Queued resource {job.run_name} requested; its TPUs start when capacity is granted, then run the command.",
    f"Each worker's log goes to {logs} when its command ends; worker 0 of slice 0 then deletes the TPUs.",
    f"Logs:   gsutil ls {shlex.quote(job.bucket_path + '/')}",
    f"        gsutil cat {shlex.quote(f'{job.bucket_path}/{LOG_PREFIX}0_worker_0')}",
    f"Watch:  {shlex.join(describe_command(job))}",
    f"Stop:   {shlex.join(delete_command(job))}",
  ):
    say(line)


def main(argv: list[str]) -> int:
  try:
    flags = parse_flags(argv)
    submit(resolve(flags), flags.DRY_RUN)
  except UsageError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  except (CloudError, subprocess.CalledProcessError) as e:
    detail = (
      str(e) if isinstance(e, CloudError) else f"`{shlex.join(e.cmd)}` failed: {e.stderr.decode(errors='replace').strip()}"
    )
    print(f"error: {detail}; check `gcloud auth login`, the project's TPU quota and the flags", file=sys.stderr, flush=True)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
