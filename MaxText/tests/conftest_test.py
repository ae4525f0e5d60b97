"""conftest.py's rule for CI: a parity test skipped for a missing torch, transformers or peft fails there (in a
test or a whole module, with or without pytest-xdist); other skips stay skips, and outside CI nothing changes."""

import os
import subprocess
import sys

import pytest

from MaxText.tests.helpers import REPO_ROOT

pytestmark = pytest.mark.slow  # Each test starts pytest in a process of its own.

# A parity test, a module skipped whole for its reference, and a skip of another kind. Setting sys.modules[name] to
# None makes the import fail as it does where the package is not installed.
TESTS = {
  "parity_test.py": """
import sys
import pytest

def test_against_torch():
  sys.modules["torch"] = None
  pytest.importorskip("torch")

def test_needs_root():
  pytest.skip("mounting a small tmpfs needs root")
""",
  "peft_module_test.py": """
import sys
import pytest

sys.modules["peft"] = None
pytest.importorskip("peft")

def test_adapter():
  pass
""",
}


def _pytest(tmp_path, ci: str | None, *args) -> subprocess.CompletedProcess:
  for name, text in TESTS.items():
    (tmp_path / name).write_text(text)
  env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
  if ci is not None:
    env["CI"] = ci
  command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "MaxText.tests.conftest"]
  command += [*args, str(tmp_path)]
  return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


def test_under_ci_a_skipped_parity_test_fails_on_two_workers(tmp_path):
  proc = _pytest(tmp_path, "true", "-n", "2")
  out = proc.stdout
  assert proc.returncode == 1, out + proc.stderr
  # The torch test fails; the root-only one stays a skip; the peft module counts as a skip and fails the run.
  assert "1 failed, 2 skipped" in out, out
  assert "could not import 'torch'" in out and "CI is set: a parity test must run here" in out, out
  assert "parity test modules skipped under CI" in out and "peft_module_test.py: " in out, out
  assert "could not import 'peft'" in out, out


def test_outside_ci_the_same_skips_stay_skips(tmp_path):
  for ci in (None, "0", "false"):
    proc = _pytest(tmp_path, ci)
    assert proc.returncode == 0 and "3 skipped" in proc.stdout, proc.stdout + proc.stderr
    assert "parity test modules skipped under CI" not in proc.stdout
