"""Every test runs on the CPU with 8 simulated devices, so each parallelism axis is exercised for real.

The tests compile the same small programs in many places and on every run, so this process keeps them in a
persistent compilation cache of the tests' own (not the user's ~/jax_cache): every run after the first on a
machine is about twice as fast. It holds about 15 MB after a whole run and only grows as programs change; delete
~/.cache/maxtext_tests to start afresh. The configs of the tests say jax_cache_dir= (helpers.TINY), so neither the
command-line path in this process nor the processes the tests start use any other cache.

Under CI (the environment variable CI set, as .ci/run and CI services do), a test skipped because torch,
transformers or peft cannot be imported fails instead: those are the independent references of the Hugging Face
parity tests, and `bash setup.sh --dev` installs them on every Python README supports, so such a skip means a
parity check silently did not run. Other skips (root-only tmpfs tests, no sshd, no GPU) stay skips.
"""

import os
import re

import pytest

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read when jax starts)

jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "maxtext_tests", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# A size limit turns on JAX's file lock around every read and write of the cache (lru_cache.LRUCache): the two xdist
# workers share it, and JAX writes an entry in place, so without the lock a worker could read another's half-written
# entry, which aborts the process (a CI run did abort so, reading the cache in pipeline_test).
jax.config.update("jax_compilation_cache_max_size", 16 * 2**30)

# The parity tests' references (pytest.importorskip in hf_checkpoint_test, logit_checker_test, lora_test, moe_test).
PARITY_REFERENCES = ("torch", "transformers", "peft")
_SKIPPED_AT_COLLECTION: list[str] = []  # "node id: reason" of the modules skipped whole


def _under_ci() -> bool:
  return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing_reference(report) -> str | None:
  """The reason of `report` when it is a skip for a parity reference that cannot be imported, under CI."""
  if not report.skipped or not _under_ci():
    return None
  longrepr = report.longrepr
  reason = str(longrepr[2]) if isinstance(longrepr, (tuple, list)) and len(longrepr) == 3 else str(longrepr)
  found = re.search(r"could not import '([\w.]+)'", reason)
  if found is None or found.group(1).split(".")[0] not in PARITY_REFERENCES:
    return None
  return f"{reason} (CI is set: a parity test must run here; bash setup.sh --dev installs torch, transformers and peft)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  """A test that skipped itself for a missing parity reference fails under CI, with the skip's reason."""
  report = yield
  reason = _missing_reference(report)
  if reason is not None:
    report.outcome, report.longrepr = "failed", reason
  return report


def pytest_collectreport(report):
  """A test module skipped whole for a missing parity reference (importorskip at its top) fails the session under CI
  (turned into a collection error it would stop every other test): recorded here, reported at the end."""
  reason = _missing_reference(report)
  if reason is not None:
    _SKIPPED_AT_COLLECTION.append(f"{report.nodeid}: {reason}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  if _SKIPPED_AT_COLLECTION:
    terminalreporter.section("parity test modules skipped under CI (each fails the run)", red=True)
    for line in _SKIPPED_AT_COLLECTION:
      terminalreporter.line(line, red=True)


def pytest_sessionfinish(session, exitstatus):
  """The session fails when a parity module was skipped under CI (in a pytest-xdist run, the controller's verdict:
  the workers' collection skips reach it through pytest_collectreport)."""
  if _SKIPPED_AT_COLLECTION and exitstatus == pytest.ExitCode.OK and not hasattr(session.config, "workerinput"):
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
