"""Joins this process to a multi-process JAX job (`jax.distributed.initialize`), or leaves a lone process alone.

The job's shape (coordinator address, process count, this process's id) comes from the first of:
  1. explicit: the config keys `jax_coordinator_address`, `jax_process_count`, `jax_process_id`, else the
     environment variables JAX_COORDINATOR_ADDRESS, JAX_PROCESS_COUNT, JAX_PROCESS_ID (what
     multihost_runner.py sets on every worker);
  2. SLURM: the variables `srun` sets (SLURM_JOB_ID, SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST);
  3. Cloud TPU: on `hardware=tpu` JAX reads the TPU VM's metadata and multi-slice variables itself; on other
     hardware the same variables (TPU_WORKER_ID, TPU_WORKER_HOSTNAMES, MEGASCALE_*) are read here, so a job
     started the way a TPU queued resource starts one also runs on CPU or GPU hosts.
None of these (or a job of one process): nothing to join. This runs before the first device query.
"""

import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping

import jax

from MaxText.common_types import ConfigError

TPU_COORDINATOR_PORT = 8482  # The port JAX's Cloud TPU detection uses; JAX_COORDINATOR_PORT overrides it.
SLURM_PORT_BASE = 65535 - 2**12 + 1  # SLURM jobs: a port in [61440, 65535] from the job id, as JAX does.


@dataclasses.dataclass(frozen=True)
class Job:
  """Where this process sits in a multi-process job, and how that was found out."""

  coordinator_address: str | None  # "host:port" of process 0's coordination service; None: JAX detects it.
  process_count: int | None
  process_id: int | None
  source: str
  local_device_ids: tuple[int, ...] | None = None  # One accelerator per process (SLURM with a task per GPU).


def detect(values: Mapping, env: Mapping[str, str] = os.environ) -> Job | None:
  """The job this process belongs to, or None for a single process. `values`: the parsed config."""
  if values["skip_jax_distributed_system"]:
    return None
  job = _explicit(values, env) or _slurm(values, env) or _cloud_tpu(values, env)
  if job is None or job.process_count == 1:
    return None
  if job.process_count is not None and not 0 <= job.process_id < job.process_count:
    raise ConfigError(
      f"process id {job.process_id} (from {job.source}) is not in [0, {job.process_count}); give each of the "
      f"{job.process_count} processes a distinct id from 0 to {job.process_count - 1}"
    )
  return job


def initialize(values: Mapping, env: Mapping[str, str] = os.environ) -> Job | None:
  """Starts (process 0) or joins the job's coordination service; returns the job, or None if there is none.

  Once per process: a second call (a script that loads its config twice) keeps the job already joined.
  """
  job = detect(values, env)
  if job is None or jax.distributed.is_initialized():
    return job
  kwargs = {
    "initialization_timeout": values["jax_distributed_initialization_timeout"],
    "heartbeat_timeout_seconds": values["jax_distributed_heartbeat_timeout_seconds"],
  }
  if job.coordinator_address is not None:
    kwargs.update(
      coordinator_address=job.coordinator_address,
      num_processes=job.process_count,
      process_id=job.process_id,
      local_device_ids=job.local_device_ids,
      cluster_detection_method="deactivate",  # JAX would otherwise pick local devices from SLURM by itself.
    )
    # A coordinator on a loopback address serves this machine only: bind it there, not on every interface.
    host = job.coordinator_address.rsplit(":", 1)[0].strip("[]")
    if _is_loopback(host) and "JAX_COORDINATOR_BIND_ADDRESS" not in env:
      kwargs["coordinator_bind_address"] = job.coordinator_address
  try:
    jax.distributed.initialize(**kwargs)
  except ValueError:
    if job.coordinator_address is None:
      return None  # A TPU VM whose environment JAX finds no job in: a single host.
    raise
  except RuntimeError as e:
    message = " ".join(str(e).split())[:200]
    who = "this process" if job.process_id is None else f"process {job.process_id} of {job.process_count}"
    where = job.coordinator_address or "the coordinator JAX detected"
    raise ConfigError(
      f"{who} (from {job.source}) could not join the job at {where}: {message}; start every process with the "
      "same coordinator address and process count, and check that process 0 is running and reachable "
      f"(jax_distributed_initialization_timeout={values['jax_distributed_initialization_timeout']} s)"
    ) from None
  return job


def _explicit(values: Mapping, env: Mapping[str, str]) -> Job | None:
  """Config keys first, then the JAX_* variables; all three or none of them."""
  given = {
    "jax_coordinator_address": values["jax_coordinator_address"] or None,
    "jax_process_count": values["jax_process_count"] if values["jax_process_count"] > 0 else None,
    "jax_process_id": values["jax_process_id"] if values["jax_process_id"] >= 0 else None,
  }
  source = "the config"
  if all(v is None for v in given.values()):
    names = {"jax_coordinator_address": "JAX_COORDINATOR_ADDRESS", "jax_process_count": "JAX_PROCESS_COUNT"}
    names["jax_process_id"] = "JAX_PROCESS_ID"
    given = {key: env.get(name) or None for key, name in names.items()}
    if given["jax_process_count"] is None and given["jax_process_id"] is None:
      return None  # JAX_COORDINATOR_ADDRESS alone may serve JAX's own cluster detection (SLURM, TPU).
    source = "JAX_COORDINATOR_ADDRESS, JAX_PROCESS_COUNT and JAX_PROCESS_ID"
  missing = [key for key, v in given.items() if v is None]
  if missing:
    raise ConfigError(
      f"{', '.join(missing)} not set (from {source}); a multi-process job needs the coordinator address, the "
      "process count and this process's id together"
    )
  address = str(given["jax_coordinator_address"])
  match = re.fullmatch(r"(\[[0-9a-fA-F:]+\]|[^\s:\[\]]+):(\d{1,5})", address)
  if not match or not 0 < int(match.group(2)) < 65536:
    raise ConfigError(f"coordinator address {address!r} (from {source}) is not host:port; give e.g. 10.0.0.2:8476")
  try:
    count, process_id = int(given["jax_process_count"]), int(given["jax_process_id"])
  except ValueError:
    raise ConfigError(
      f"process count {given['jax_process_count']!r} or id {given['jax_process_id']!r} (from {source}) is not an "
      "integer; set whole numbers"
    ) from None
  return Job(address, count, process_id, source)


def _slurm(values: Mapping, env: Mapping[str, str]) -> Job | None:
  """A task started by `srun` (a batch script's own shell, without srun, is not one)."""
  if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env or "SLURM_STEP_ID" not in env:
    return None
  count = _int(env, "SLURM_STEP_NUM_TASKS", 0) or _int(env, "SLURM_NTASKS", 1)
  nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
  port = env.get("JAX_COORDINATOR_PORT") or str(_int(env, "SLURM_JOB_ID") % 2**12 + SLURM_PORT_BASE)
  address = env.get("JAX_COORDINATOR_ADDRESS") or f"{first_host(nodes)}:{port}"
  local_ids = _slurm_local_devices(env) if values["hardware"] == "gpu" else None
  return Job(address, count, _int(env, "SLURM_PROCID"), "SLURM", local_ids)


def _slurm_local_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
  """The GPUs this SLURM task drives: SLURM_LOCALID's one when the node's tasks share its GPUs (a task per GPU
  with --gpus-per-node), else every GPU the task sees (--gpus-per-task, or one task per node)."""
  visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
  tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
  tasks_here = _tasks_on_node(tasks_per_node, _int(env, "SLURM_NODEID", 0))
  shared = tasks_here > 1 and not env.get("SLURM_GPUS_PER_TASK") and len(visible) >= tasks_here
  if shared:
    return (_int(env, "SLURM_LOCALID", 0),)
  return tuple(range(len(visible))) if visible else None


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
  """Task count of node `node` from SLURM's compressed list, e.g. '8(x2),4' -> 8, 8, 4."""
  counts = []
  for part in tasks_per_node.split(","):
    match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
    if match:
      counts += [int(match.group(1))] * int(match.group(2) or 1)
  return counts[node] if node < len(counts) else 1


def _cloud_tpu(values: Mapping, env: Mapping[str, str]) -> Job | None:
  if values["hardware"] == "tpu":
    return Job(None, None, None, "the Cloud TPU environment")  # JAX reads the VM's metadata itself.
  if "TPU_WORKER_HOSTNAMES" not in env or "TPU_WORKER_ID" not in env:
    return None
  hosts = [h for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h]
  if not hosts:
    raise ConfigError("TPU_WORKER_HOSTNAMES is empty; it must list this slice's workers, worker 0 first")
  slices, slice_id = _int(env, "MEGASCALE_NUM_SLICES", 1), _int(env, "MEGASCALE_SLICE_ID", 0)
  address = env.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]  # Slice 0's worker 0, with or without a port.
  host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
  port = env.get("JAX_COORDINATOR_PORT") or TPU_COORDINATOR_PORT
  process_id = slice_id * len(hosts) + _int(env, "TPU_WORKER_ID")
  return Job(f"{host}:{port}", slices * len(hosts), process_id, "TPU_WORKER_* and MEGASCALE_* variables")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
  """An integer launcher variable; a malformed one is a config error naming it."""
  text = env.get(name) or ""
  if not text and default is not None:
    return default
  try:
    return int(text)
  except ValueError:
    raise ConfigError(f"{name}={text!r} is not an integer; the launcher that started this process set it wrong") from None


def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'node[003-005,009],gpu1' -> 'node003'."""
  match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
  if not match:
    raise ConfigError(f"SLURM node list {nodelist!r} has no host; run the job step with srun")
  prefix, ranges = match.groups()
  return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def _is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False
