"""conftest.py's rules. Under CI a parity test skipped for a missing torch, transformers or peft fails (in a test or a
whole module, with or without pytest-xdist); other skips stay skips, and outside CI nothing changes. A process
gets 8 devices when it runs a test marked mesh or slow, else one. The compilation cache is pruned by age."""

import os
import subprocess
import sys
import time
import zlib

import pytest

from MaxText.tests import conftest
from MaxText.tests.helpers import REPO_ROOT

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


@pytest.mark.slow  # starts pytest in a process of its own
def test_under_ci_a_skipped_parity_test_fails_on_two_workers(tmp_path):
  proc = _pytest(tmp_path, "true", "-n", "2")
  out = proc.stdout
  assert proc.returncode == 1, out + proc.stderr
  # The torch test fails; the root-only one stays a skip; the peft module counts as a skip and fails the run.
  assert "1 failed, 2 skipped" in out, out
  assert "could not import 'torch'" in out and "CI is set: a parity test must run here" in out, out
  assert "parity test modules skipped under CI" in out and "peft_module_test.py: " in out, out
  assert "could not import 'peft'" in out, out


@pytest.mark.slow
def test_outside_ci_the_same_skips_stay_skips(tmp_path):
  for ci in (None, "0", "false"):
    proc = _pytest(tmp_path, ci)
    assert proc.returncode == 0 and "3 skipped" in proc.stdout, proc.stdout + proc.stderr
    assert "parity test modules skipped under CI" not in proc.stdout


TIERS = """
import os

import jax
import pytest

def seen(name):
  with open(os.path.join(os.environ["SEEN"], name), "w") as f:
    f.write(str(len(jax.devices())))

def test_unit():
  seen("unit")

@pytest.mark.mesh
def test_mesh():
  seen("mesh")

@pytest.mark.slow
def test_end_to_end():
  seen("slow")
"""


@pytest.mark.slow
@pytest.mark.parametrize("workers", [[], ["-n", "2"]])
def test_a_process_gets_8_devices_only_when_it_runs_a_mesh_or_slow_test(tmp_path, workers):
  (tmp_path / "tiers_test.py").write_text(TIERS)
  env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "XLA_FLAGS")}
  tiers = {"not mesh and not slow": {"unit": "1"}, "mesh": {"mesh": "8"}, "slow": {"slow": "8"}}
  tiers[""] = {"unit": "8", "mesh": "8", "slow": "8"}
  for select, want in tiers.items():
    env["SEEN"] = str(tmp_path / (select.replace(" ", "_") or "all"))
    os.makedirs(env["SEEN"])
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, "-m", select]
    command += ["-p", "MaxText.tests.conftest", "-o", "markers=mesh: devices\nslow: processes"]
    command += [str(tmp_path / "tiers_test.py")]
    proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = {}
    for name in os.listdir(env["SEEN"]):
      with open(os.path.join(env["SEEN"], name)) as f:
        got[name] = f.read()
    assert got == want, (select, proc.stdout)


def _stamp(path, seconds: float) -> None:
  path.write_bytes(int(seconds * 1e9).to_bytes(8, "little"))


def test_cache_entries_are_pruned_by_their_last_read(tmp_path):
  now = time.time()
  for key in ("fresh", "stale", "unstamped", "unstamped_stale"):
    (tmp_path / f"{key}-cache").write_bytes(zlib.compress(b"program"))
  _stamp(tmp_path / "fresh-atime", now - 6 * 86400)
  _stamp(tmp_path / "stale-atime", now - 8 * 86400)
  os.utime(tmp_path / "unstamped_stale-cache", (now - 9 * 86400, now - 9 * 86400))
  last_read = os.stat(tmp_path / "unstamped-cache").st_atime_ns
  conftest._prune_cache(str(tmp_path), keep_days=7)  # (it reads the new entries: their atime moves)
  kept = [".lockfile", ".pruned", "fresh-atime", "fresh-cache", "unstamped-atime", "unstamped-cache"]
  assert sorted(os.listdir(tmp_path)) == kept
  # The entry written without a stamp got one from its file's last read, in JAX's format.
  stamp = int.from_bytes((tmp_path / "unstamped-atime").read_bytes(), "little")
  assert stamp == last_read


def test_a_short_cache_entry_written_since_the_last_prune_is_deleted(tmp_path):
  """A process killed while JAX wrote an entry leaves it short; JAX would warn on each read and never rewrite it.
  Only entries written since the last prune are read (the rest were whole then)."""
  whole = zlib.compress(b"program" * 100)
  (tmp_path / "old_short-cache").write_bytes(whole[:10])  # short, but written before the last prune: not read
  _stamp(tmp_path / "old_short-atime", time.time())
  (tmp_path / ".pruned").touch()
  os.utime(tmp_path / ".pruned", ns=(0, os.stat(tmp_path / "old_short-cache").st_mtime_ns + 1))
  conftest._prune_cache(str(tmp_path), keep_days=7)
  assert (tmp_path / "old_short-cache").exists()
  for key, data in (("whole", whole), ("short", whole[: len(whole) // 2]), ("empty", b"")):
    (tmp_path / f"{key}-cache").write_bytes(data)
    _stamp(tmp_path / f"{key}-atime", time.time())
  conftest._prune_cache(str(tmp_path), keep_days=7)
  left = sorted(name for name in os.listdir(tmp_path) if name.endswith("-cache"))
  assert left == ["old_short-cache", "whole-cache"]
  assert not (tmp_path / "short-atime").exists() and not (tmp_path / "empty-atime").exists()


@pytest.mark.slow
def test_a_module_that_starts_jax_at_import_stops_the_run_in_one_line(tmp_path):
  (tmp_path / "early_test.py").write_text("import jax\n\nDEVICES = jax.devices()\n\ndef test_unit():\n  pass\n")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "XLA_FLAGS")}
  command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "MaxText.tests.conftest"]
  proc = subprocess.run(
    [*command, str(tmp_path / "early_test.py")],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
  assert "a test module uses a device when it is imported" in proc.stderr, proc.stdout + proc.stderr
  assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow  # it starts a process
def test_a_started_process_shares_the_tests_compilation_cache_under_its_lock():
  code = "import jax; c = jax.config; print(c.jax_compilation_cache_dir, c.jax_compilation_cache_max_size)"
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
  folder, limit = proc.stdout.split()
  assert folder == conftest.CACHE_DIR and int(limit) > 0, proc.stdout  # a limit: JAX's file lock is on
