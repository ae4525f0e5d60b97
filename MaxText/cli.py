"""What every entry point shares: loading the config, setting JAX up, logging, turning errors into exit codes, and
taking SIGTERM and SIGINT in the training loop (StopRequest).

    def main(argv) -> int:
      return cli.run_cli(body, argv)          # body(config) does the script's work

A user mistake (`ConfigError`) is one line on stderr and exit code 2; a run that cannot go on (`TrainingError`,
e.g. a NaN loss) is one line and exit code 1; anything else is a bug and keeps its traceback. No entry point
imports another: what two of them need lives here or in the library modules.
"""

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import stat
import sys
import threading
import traceback
import warnings

import jax
import yaml

from MaxText import checkpointing, distributed, pyconfig, sharding, storage
from MaxText.common_types import Config, ConfigError, TrainingError, cut

# XLA's CPU fusions restricted to dots and reductions; see compiler_options().
CPU_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"


# hardware=gpu: NVIDIA's recommended XLA flags for LLM training (JAX-Toolbox's GPU performance guide and its
# MaxText recipes): the latency-hiding scheduler, collectives pipelined across loop iterations and combined
# into large ones, double-buffered layer loops, cuBLAS over Triton GEMMs, no command buffers, and XLA's own
# rematerialisation off (remat_policy decides). Collectives are combined up to 128 MiB. A flag the user's XLA_FLAGS
# already sets is left as it is. All parse in jaxlib 0.10.2 and 0.12.0.1 (an XLA that dropped one would refuse to start with
# "Unknown flag in XLA_FLAGS": then set that flag yourself in XLA_FLAGS).
GPU_XLA_FLAGS = {
  "xla_gpu_enable_latency_hiding_scheduler": "true",
  "xla_gpu_enable_highest_priority_async_stream": "true",
  "xla_gpu_enable_triton_gemm": "false",
  "xla_gpu_enable_command_buffer": "",
  "xla_gpu_all_reduce_combine_threshold_bytes": "134217728",
  "xla_gpu_all_gather_combine_threshold_bytes": "134217728",
  "xla_gpu_reduce_scatter_combine_threshold_bytes": "134217728",
  "xla_gpu_enable_pipelined_all_gather": "true",
  "xla_gpu_enable_pipelined_reduce_scatter": "true",
  "xla_gpu_enable_pipelined_all_reduce": "true",
  "xla_gpu_enable_while_loop_double_buffering": "true",
  "xla_gpu_enable_all_gather_combine_by_dim": "false",
  "xla_gpu_enable_reduce_scatter_combine_by_dim": "false",
  "xla_disable_hlo_passes": "rematerialization",
}


def with_gpu_flags(xla_flags: str) -> str:
  """`xla_flags` (an XLA_FLAGS value) plus each of GPU_XLA_FLAGS that it does not set."""
  given = {flag.lstrip("-").split("=", 1)[0] for flag in xla_flags.split()}
  added = [f"--{name}={value}" for name, value in GPU_XLA_FLAGS.items() if name not in given]
  return " ".join([xla_flags.strip(), *added]).strip()


def configure_jax(values) -> None:
  """Platform and persistent compilation cache; must run before the first device query."""
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", pyconfig.HARDWARE_PLATFORMS[values["hardware"]])
  if values["jax_cache_dir"]:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(values["jax_cache_dir"]))
    # Cache every executable: on small models compilation, not execution, dominates start-up.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_config(argv, writes_run_dir: bool = False) -> Config:
  """argv `[config.yml, key=value, ...]` -> Config, after JAX is set up and a multi-process job joined.

  writes_run_dir: the script writes under {base_output_directory}/{run_name}, so run_name must be given.
  """
  values = pyconfig.parse(argv)
  if values["jax_cache_dir"]:  # A file there would turn the cache off without a word from JAX.
    check_kind("jax_cache_dir", values["jax_cache_dir"], folder=True)
  if values["compiled_trainstep_file"]:  # train.py reads it, train_compile.py writes it: a file either way.
    check_kind("compiled_trainstep_file", values["compiled_trainstep_file"], folder=False)
  if values["hardware"] == "gpu":  # Read when the GPU backend starts, so before the first device query.
    os.environ["XLA_FLAGS"] = with_gpu_flags(os.environ.get("XLA_FLAGS", ""))
  configure_jax(values)
  distributed.initialize(values)  # A multi-process job is joined before the first device query.
  try:
    devices = jax.devices()
  except (RuntimeError, AssertionError) as e:  # jax 0.10 asserts when the only platform asked for is missing.
    reason = (str(e).splitlines() or ["no backend initialised"])[0][:120]
    raise ConfigError(
      f"hardware={values['hardware']}: no such JAX backend here ({reason}); "
      f"install its jaxlib (DEVICE={values['hardware']} bash setup.sh) or set hardware=cpu"
    ) from None
  if devices[0].platform != values["hardware"]:
    raise ConfigError(
      f"hardware={values['hardware']} but JAX runs on {devices[0].platform} (JAX_PLATFORMS="
      f"{os.environ.get('JAX_PLATFORMS', '')!r}); set hardware={devices[0].platform} or unset JAX_PLATFORMS"
    )
  config = pyconfig.finalize(values, num_devices=len(devices), num_slices=sharding.count_slices(devices))
  for key in ("load_parameters_path", "load_full_state_path"):  # A bucket we cannot read fails here, not at restore.
    if storage.is_remote(getattr(config, key)):
      storage.check_access(key, getattr(config, key), write=False)
  if writes_run_dir:
    checkpointing.run_dir(config)  # Raises ConfigError for an empty run_name, before anything is written.
    check_output_paths(config)
  return config


def check_output_paths(config: Config) -> None:
  """Refuses, before anything is written, a base_output_directory or metrics_file that cannot be written: locally
  (pyconfig.parse made the paths absolute) by what is there, on a bucket by storage.check_access."""
  if not config.base_output_directory:
    raise ConfigError("base_output_directory is empty; pass the folder that holds run folders, e.g. /tmp/maxtext_runs")
  check_writable("base_output_directory", config.base_output_directory, folder=True)
  if config.metrics_file:
    check_writable("metrics_file", config.metrics_file, folder=False)
    check_metrics_file(config.metrics_file)
  for key in ("base_output_directory", "metrics_file"):
    if storage.is_remote(getattr(config, key)):
      storage.check_access(key, getattr(config, key), write=True)


def check_kind(key: str, path: str, folder: bool) -> str:
  """ConfigError unless the local absolute `path` is a folder (or a regular file, folder=False), or does not exist
  and no file stands where a folder above it would be made; returns `path` or, when it does not exist, its nearest
  existing folder. Only os.stat looks at it: nothing is opened, so a FIFO or /dev/zero cannot hang the check."""
  if storage.is_remote(path):
    return path
  wanted = "a folder" if folder else "a regular file"
  if os.path.exists(path):
    mode = os.stat(path).st_mode
    if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
      raise ConfigError(f"{key}={cut(path)} is {storage.file_kind(mode)}; pass the path of {wanted}")
    return path
  existing = os.path.dirname(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise ConfigError(f"{key}={cut(path)}: {cut(existing)} is a file, so no folder can be made there; pass another path")
  return existing


# The least free space a local output needs to start: a run writes config.yml, TensorBoard's events and metrics
# lines (kilobytes) before its first checkpoint, whose room train.py checks itself.
MIN_FREE_BYTES = 1 << 20


def check_writable(key: str, path: str, folder: bool) -> None:
  """ConfigError unless the local absolute `path` (a folder, or a file) exists as that kind and is writable, or
  can be created: its nearest existing ancestor is a writable folder."""
  if storage.is_remote(path):
    return
  existing = check_kind(key, path, folder)
  if not os.access(existing, os.W_OK):
    raise ConfigError(f"{key}={cut(path)}: {cut(existing)} is not writable by this user; pass a writable path")
  usage = shutil.disk_usage(existing)
  if usage.total == 0:  # procfs, sysfs and the like: no blocks at all, not a full disk
    raise ConfigError(
      f"{key}={cut(path)}: {cut(existing)} is on a virtual file system (as /proc and /sys are), which holds no files; "
      "pass a path on a disk"
    )
  free = usage.free
  if free < MIN_FREE_BYTES:
    raise ConfigError(
      f"{key}={cut(path)}: no space left on the device of {cut(existing)} ({free // 1024} KiB free); free space or "
      "pass a path on another disk"
    )


# Longest line of a metrics file (metrics.MetricWriter writes a few hundred bytes a line); a longer one means the
# file holds something else.
_METRICS_LINE_BYTES = 1 << 20


def check_metrics_file(path: str) -> None:
  """ConfigError unless the local `path` is new, empty, or a metrics file: JSON lines of one object each, as
  metrics.MetricWriter appends them (a resumed run appends to its own). A record cut short by a kill is allowed,
  at the end or (once a resumed run has ended its line) anywhere; anything else, e.g. a copy of /etc/passwd, would
  get JSON lines appended to it."""
  if storage.is_remote(path) or not os.path.isfile(path):
    return
  with open(path, "rb") as f:
    number = 0
    while line := f.readline(_METRICS_LINE_BYTES):
      number += 1
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError:  # A record cut short starts as one does, within the longest line.
        record = {} if line.startswith(b"{") and len(line) < _METRICS_LINE_BYTES else None
      if not isinstance(record, dict):
        raise ConfigError(
          f"metrics_file={cut(path)} exists and is not a metrics file (its line {number} is not a JSON object); "
          "pass a new path, or the metrics_file of the run you resume"
        )


def compiler_options(mesh: jax.sharding.Mesh) -> dict[str, str]:
  """XLA options for compiling the train step: a measured CPU tuning, nothing on GPU or TPU.

  On CPU with jax >= 0.11, when each device of this process has two or more cores, restricting XLA's
  YNNPACK fusions to dots and reductions ran the core benchmark step 1.6x faster on one device of a 2-core
  machine (docs/changelog.md); with one core per device, and on jax 0.10, XLA's default was fastest.
  A ynn setting in XLA_FLAGS wins over this one.
  """
  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  cores_per_device = (os.cpu_count() or 1) // max(len(devices), 1)
  if (
    devices[0].platform != "cpu"
    or jax.__version_info__ < (0, 11)
    or cores_per_device < 2
    or "xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", "")
  ):
    return {}
  return {"xla_cpu_experimental_ynn_fusion_type": CPU_YNN_FUSIONS}


# The line of a run's config.yml after which its derived values follow, each as a comment "#   key: value".
DERIVED_MARKER = "# Derived from these keys on this run's devices (recomputed when the file is loaded; not keys):"


def write_resolved_config(config: Config, directory: str) -> None:
  """{directory}/config.yml (process 0 only): base.yml's keys as the run set them, a config file that loads back
  (`train.py RUN/config.yml`, decode.py, serve.py), then its derived values as comments, for reading. A preset's
  keys are written out and model_name is "default": a preset's keys would otherwise override the file's (the
  precedence is MaxText's: file < preset < command line), and an overridden preset key would load wrong."""
  if jax.process_index() != 0:
    return
  given = pyconfig.given(config)
  header = [
    f"# The configuration of run {given['run_name'] or '(unnamed)'}, written by train.py at each start. Load it back:",
    "#   python3 MaxText/train.py THIS_FILE [key=value ...]   (or decode.py, serve.py)",
  ]
  if given["model_name"] != "default":
    preset = given["model_name"]
    header.append(f"# model_name={preset}: its keys are written out below, so model_name is 'default' here.")
    given["model_name"] = "default"
  if given["server_api_key"]:  # a secret (serve.py's), never written to disk
    header.append("# server_api_key is set but not written here: give it as M_SERVER_API_KEY.")
    given["server_api_key"] = ""
  derived = {k: v for k, v in config.as_dict().items() if k not in given}
  lines = yaml.safe_dump(derived, sort_keys=True, width=1 << 20).splitlines()
  text = "\n".join([*header, yaml.safe_dump(given, sort_keys=True).rstrip("\n"), DERIVED_MARKER])
  text += "\n" + "".join(f"#   {line}\n" for line in lines)
  storage.makedirs(directory)
  storage.write_text(storage.join(directory, "config.yml"), text)


def read_derived(text: str) -> dict:
  """The derived values a config.yml written by write_resolved_config lists after DERIVED_MARKER."""
  _, _, tail = text.partition(DERIVED_MARKER)
  return yaml.safe_load("".join(line[4:] + "\n" for line in tail.splitlines() if line.startswith("#   "))) or {}


def log(message: str) -> None:
  """Prints on process 0 only, so a multi-process job logs once."""
  if jax.process_index() == 0:
    print(message, flush=True)


# Set once a command's failure is reported (_report), reset when the next command starts (run_cli).
_failure_reported = False


def _library_echo_dropped(record: logging.LogRecord) -> bool:
  """Drops Orbax's log records of a full disk (one traceback per writer thread; train.py reports it in one line),
  and every record of Orbax's and asyncio's threads once a failure is reported: a writer still running as the
  process exits fails again on the executors Python has shut down ("cannot schedule new futures after shutdown")."""
  if _failure_reported:
    return False
  error = record.exc_info[1] if record.exc_info else None
  return not checkpointing.out_of_space(error) and "No space left on device" not in record.getMessage()


# Longest error line run_cli prints: messages cut the values they quote (common_types.shown), and this caps the rest.
ERROR_LINE_CHARS = 2000


def error_line(error: Exception) -> str:
  """An error's message as one line of at most ERROR_LINE_CHARS characters."""
  return cut(" ".join(str(error).splitlines()), ERROR_LINE_CHARS)


def _quiet_exit() -> None:
  """Run at exit after a failure's one line: the libraries' exit hooks, threads and garbage (a TensorBoard writer
  whose flush failed, Orbax's abandoned coroutines) would repeat the failure as tracebacks and warnings. (At exit,
  so that a process that goes on, a test calling main() say, keeps Python's reporting.)"""
  sys.unraisablehook = lambda unraisable: None
  threading.excepthook = lambda args: None
  warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)


def _report(error: Exception) -> None:
  """A failure's one line on stderr; the process then exits quietly (_quiet_exit, which atexit runs before the
  libraries' own exit hooks, registered earlier)."""
  global _failure_reported
  _failure_reported = True
  print(f"error: {error_line(error)}", file=sys.stderr, flush=True)
  atexit.unregister(_quiet_exit)
  atexit.register(_quiet_exit)
  # Python joins the threads still running (Orbax's writers) before it runs atexit's hooks: quiet them from there
  # (once per process: those hooks cannot be unregistered).
  register_at_thread_shutdown = getattr(threading, "_register_atexit", None)
  if register_at_thread_shutdown is not None and not getattr(_quiet_exit, "at_thread_shutdown", False):
    register_at_thread_shutdown(_quiet_exit)
    _quiet_exit.at_thread_shutdown = True


def run_cli(body, argv, writes_run_dir: bool = False, load=None) -> int:
  """A script's exit code: runs body(config) for the command line `argv` (an int it returns is the exit code,
  anything else means 0); a user mistake (ConfigError, exit 2) or a failed run (TrainingError, exit 1) is one
  line on stderr instead of a traceback. writes_run_dir: see load_config. load: argv[1:] -> Config, for a script
  whose config is not for this host's devices (train_compile.py's topology); default load_config.

  In a multi-process job a failing process leaves at once, without JAX's shutdown barrier (which would wait
  for the other processes while they wait for it in a collective): they see it gone and fail too.
  """
  logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's per-save chatter would bury our log.
  for logger in ("absl", "asyncio"):  # Orbax's log, and its failed writes' "Task exception was never retrieved".
    logging.getLogger(logger).addFilter(_library_echo_dropped)
  global _failure_reported
  _failure_reported = False
  checkpointing.drop_abandoned_io()
  try:
    config = load(argv[1:]) if load is not None else load_config(argv[1:], writes_run_dir)
    code = body(config)
    code = code if isinstance(code, int) else 0
  except ConfigError as e:
    _report(e)
    code = 2
  except TrainingError as e:
    _report(e)
    code = 1
  except KeyboardInterrupt:  # Ctrl-C outside the training loop (which saves first, see StopRequest).
    print("error: interrupted (SIGINT)", file=sys.stderr, flush=True)
    code = 130
  except Exception:
    if not jax.distributed.is_initialized():
      raise
    traceback.print_exc()
    code = 1
  if code and jax.distributed.is_initialized():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


class StopRequest:
  """SIGTERM (a preemption or maintenance notice) or SIGINT (Ctrl-C) to a single-process run: the step in
  progress finishes, a checkpoint is saved, the save in flight completes, and the run exits with a line on how
  to resume. Within `interrupting()` (a wait for data) the signal raises Interrupted at once instead. A second
  SIGINT interrupts at once. In a multi-process job nothing is taken here: JAX's preemption
  service turns a SIGTERM to any process into a save by all of them (checkpointing.reached_preemption), and a
  save by one process alone would wait forever for the others, so SIGINT stops that process (run_cli)."""

  class Interrupted(Exception):
    """A signal arrived within interrupting()."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}
    self._interrupting = False
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
      return  # Python delivers signals to the main thread only.
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    self.signal_name = signal.Signals(signum).name
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if self._interrupting:
      raise StopRequest.Interrupted(self.signal_name)

  @contextlib.contextmanager
  def interrupting(self):
    """Within: a signal (or one that came just before) raises Interrupted, ending a blocking wait."""
    if self.signal_name is not None:
      raise StopRequest.Interrupted(self.signal_name)
    self._interrupting = True
    try:
      yield
    finally:
      self._interrupting = False

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
