"""The tests run on the CPU in tiers, chosen here from their markers: a pytest process whose selected tests include
one marked `mesh` (it needs several devices: sharding, parallelism, a multi-device engine) or `slow` (end to end)
gets 8 simulated devices,
so each parallelism axis is exercised for real; any other process gets one device, on which a unit test compiles
single-device programs only. `slow` marks the end-to-end tests (processes, scripts, kill -9); the processes that
tests start get 8 devices through XLA_FLAGS, whatever this process has. `bash unit_test_and_lint.sh` runs the tiers
in turn.

The tests compile the same small programs in many places and on every run, so they keep them in a persistent
compilation cache of their own (not the user's ~/jax_cache): this process, and the processes the tests start, which
get it through JAX's environment variables (JAX_COMPILATION_CACHE_DIR and the rest). Every run after the first on a
machine is about twice as fast, and a started train.py of a tiny model more so (2.3 s against 5.4 s). Entries
unread for a week are pruned when a run starts; delete ~/.cache/maxtext_tests to start afresh. The configs of the
tests say jax_cache_dir= (helpers.TINY), so the command line sets no other cache.

Under CI (the environment variable CI set, as .ci/run and CI services do), a test skipped because torch,
transformers or peft cannot be imported fails instead: those are the independent references of the Hugging Face
parity tests, and `bash setup.sh --dev` installs them on every Python the docs support, so such a skip means a
parity check silently did not run. Other skips (root-only tmpfs tests, no sshd, no GPU) stay skips.
"""

import gc
import os
import re
import time
import zlib

import pytest

MESH_DEVICES = 8  # what a `mesh` test gets, and what the processes the tests start get
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={MESH_DEVICES}"
os.environ["JAX_PLATFORMS"] = "cpu"

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "maxtext_tests", "jax")
CACHE_KEEP_DAYS = 7  # entries unread for longer are deleted when a run starts (programs of code that has changed)
RECYCLE_BYTES = 4 * 2**30  # past this resident size, a process drops its compiled programs between test files

# JAX reads these when it is imported, here and in every process the tests start (they inherit the environment).
# Every program is cached, however short its compilation. A size limit turns on JAX's file lock around every read
# and write of the cache: the xdist workers and the started processes share it, and JAX writes an entry in place,
# so without the lock a process could read another's half-written entry, which aborts it (a CI run did abort so,
# reading the cache in pipeline_test). A process killed while writing (the kill -9 tests) leaves a short entry,
# which JAX fails to decompress, warns about and compiles anew. Under the limit JAX also globs and stats the whole
# folder on every write, so stale entries (programs of code that has changed) are pruned by age.
CACHE_SETTINGS = {
  "jax_compilation_cache_dir": CACHE_DIR,
  "jax_persistent_cache_min_compile_time_secs": 0,
  "jax_persistent_cache_min_entry_size_bytes": 0,
  "jax_compilation_cache_max_size": 16 * 2**30,
}
os.environ |= {name.upper(): str(value) for name, value in CACHE_SETTINGS.items()}

import filelock  # noqa: E402  (JAX locks its cache folder with it; the prune takes the same lock)
import jax  # noqa: E402  (after XLA_FLAGS and the cache's variables, which the processes the tests start inherit)

for _name, _value in CACHE_SETTINGS.items():  # this process too, had a plugin imported JAX before this file
  jax.config.update(_name, _value)


def _decompresses(data: bytes) -> bool:
  """Whether a cache entry is whole: JAX compresses each with zstandard when it can be imported, else zlib, and a
  short one (its writer killed) fails to decompress."""
  try:
    zlib.decompress(data)
    return True
  except zlib.error:
    pass
  try:
    import zstandard  # noqa: PLC0415  (not a dependency: only where JAX would have used it)
  except ImportError:
    return False
  try:
    zstandard.ZstdDecompressor().decompress(data)
    return True
  except zstandard.ZstdError:
    return False


def _prune_cache(folder: str, keep_days: float) -> None:
  """Deletes the cache entries not read for `keep_days`, and those written since the last prune that are not whole
  (a process killed while writing one), under JAX's lock of the folder. JAX stamps an entry `<key>-cache` at each
  read and write in `<key>-atime` (nanoseconds, little-endian), and its eviction needs that file: an entry without
  one (written with no size limit) is stamped with the time its file was last read. JAX would warn about a short
  entry on every read (a line in the output of every process that compiles that program) and never rewrite it."""
  if not os.path.isdir(folder):
    return
  oldest_ns = int((time.time() - keep_days * 86400) * 1e9)
  pruned = os.path.join(folder, ".pruned")  # its modification time: when the last prune started
  checked_ns = os.stat(pruned).st_mtime_ns if os.path.exists(pruned) else 0
  with filelock.FileLock(os.path.join(folder, ".lockfile")):
    with open(pruned, "w", encoding="ascii"):
      pass
    for name in os.listdir(folder):
      if not name.endswith("-cache"):
        continue
      entry = os.path.join(folder, name)
      stamp = entry.removesuffix("-cache") + "-atime"
      status = os.stat(entry)  # its last read, before the read below
      if status.st_mtime_ns >= checked_ns:
        with open(entry, "rb") as f:
          whole = _decompresses(f.read())
        if not whole:
          os.unlink(entry)
          if os.path.exists(stamp):
            os.unlink(stamp)
          continue
      if not os.path.exists(stamp):
        with open(stamp, "wb") as f:
          f.write(status.st_atime_ns.to_bytes(8, "little"))
      with open(stamp, "rb") as f:
        if int.from_bytes(f.read(), "little") < oldest_ns:
          os.unlink(entry)
          os.unlink(stamp)


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


def pytest_configure(config):
  if not hasattr(config, "workerinput"):  # once per run: in the only process, or in pytest-xdist's controller
    _prune_cache(CACHE_DIR, CACHE_KEEP_DAYS)


def pytest_itemcollected(item):
  """Under pytest-xdist's `--dist loadgroup` (the slow tier) a test file runs on one worker, as under `loadfile`
  (its module-scoped fixtures set up once), unless its tests name an xdist_group of their own (the demos' checks,
  minutes each, which the two workers then split)."""
  if item.get_closest_marker("xdist_group") is None:
    item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """The tier: 8 devices when a selected test is marked `mesh` or `slow` (end to end, as a user runs it), else one
  (after -m and -k deselect: trylast)."""
  wants_mesh = any(item.get_closest_marker("mesh") or item.get_closest_marker("slow") for item in items)
  devices = MESH_DEVICES if wants_mesh else 1
  try:
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError:  # JAX has started: only its device count is left to check
    if len(jax.devices()) != devices:
      raise pytest.UsageError(
        f"jax started before the tests were collected (a test module uses a device when it is imported), so this "
        f"process cannot get the {devices} device(s) its tests need: move that work into a test or a fixture"
      ) from None


def _resident_bytes() -> int:
  try:
    with open("/proc/self/statm", encoding="ascii") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:  # not Linux
    return 0


def pytest_runtest_teardown(item, nextitem):
  """Between test files, a process past RECYCLE_BYTES drops its compiled programs and traced functions: one process
  running many files otherwise grows with every program it compiled until XLA aborts it."""
  if (nextitem is None or nextitem.path != item.path) and _resident_bytes() > RECYCLE_BYTES:
    jax.clear_caches()
    gc.collect()
