"""What multihost_runner.py and multihost_job.py share: their error for a user's mistake, the flag parser that
turns argparse's errors into it, the boolean flag type, the check of COMMAND and gcloud's configured defaults.

Neither launcher imports the other; both import this module (it is no entry point) from the repository root,
where they are run. Like them it never imports jax.
"""

import argparse
import shutil
import subprocess


class UsageError(Exception):
  """A mistake in the flags or their inputs; the message says what and how to fix it (exit code 2)."""


class FlagParser(argparse.ArgumentParser):
  """argparse whose errors are UsageError, one line that points to `python3 PROG --help` when it names no fix."""

  def error(self, message):
    raise UsageError(message + ("" if "; " in message else f"; run `python3 {self.prog} --help` for the flags"))


def boolean(text: str) -> bool:
  """A boolean flag's value: true/false, 1/0 or yes/no, in any case."""
  value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())
  if value is None:
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; pass true or false")
  return value


def check_command(command: str | None) -> str:
  """COMMAND, if given and valid shell syntax (checked by `bash -n` where bash is installed)."""
  if not command or not command.strip():
    raise UsageError(
      "--COMMAND is missing; pass the shell command every worker runs in its copy of SCRIPT_DIR, e.g. "
      "--COMMAND='python3 MaxText/train.py MaxText/configs/base.yml run_name=my-run'"
    )
  if shutil.which("bash"):
    syntax = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True, check=False)
    if syntax.returncode != 0:
      reason = (syntax.stderr.strip().splitlines() or ["syntax error"])[-1]
      raise UsageError(f"--COMMAND is not valid shell ({reason}); check its quotes and brackets")
  return command


def gcloud_default(key: str, flag: str) -> str:
  """`gcloud config get KEY`, for a flag that was not given."""
  try:
    result = subprocess.run(["gcloud", "config", "get", key], capture_output=True, text=True, check=False)
  except FileNotFoundError:
    raise UsageError(
      "gcloud is not on PATH; install the Google Cloud SDK (https://cloud.google.com/sdk/docs/install)"
    ) from None
  value = (result.stdout.strip().splitlines() or [""])[-1].strip()
  if result.returncode != 0 or not value or value == "(unset)":
    raise UsageError(
      f"{flag} is not given and gcloud has no default {key}; pass {flag}=... or run `gcloud config set {key} ...`"
    )
  return value
