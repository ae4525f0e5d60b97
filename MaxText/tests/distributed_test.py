"""Multi-process jobs: where a process learns its place (distributed.detect), and real two-process runs on CPU
checked against one process with the same 8 devices."""

import os
import signal
import subprocess
import sys
import time

import pytest

from MaxText import distributed, pyconfig, train_tokenizer
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, free_port, metrics_losses

# A float32 tiny model; learning_rate_schedule_steps fixed so that runs of different lengths share a schedule.
TRAIN = (
  "model_name=tiny",
  "dtype=float32",
  "matmul_precision=highest",
  "dataset_type=synthetic",
  "enable_tensorboard=false",
  "log_config=false",
  "jax_cache_dir=",
  "learning_rate_schedule_steps=6",
  "override_model_config=true",
  "vocab_size=512",  # Room for the SentencePiece tokenizer decode.py samples with.
)


def values(*overrides, env=None):
  return pyconfig.parse([BASE_YML, "run_name=t", *overrides], env=env or {})


# ---------------------------------------------------------------------------------------------- detect
def test_a_lone_process_joins_nothing():
  assert distributed.detect(values(), env={}) is None
  assert distributed.detect(values(), env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}) is None


def test_config_keys_win_over_the_launcher_variables():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1", "JAX_PROCESS_COUNT": "4", "JAX_PROCESS_ID": "3"}
  job = distributed.detect(values(), env=env)
  assert (job.coordinator_address, job.process_count, job.process_id) == ("10.0.0.1:1", 4, 3)
  explicit = values("jax_coordinator_address=h0:8476", "jax_process_count=2", "jax_process_id=1")
  job = distributed.detect(explicit, env=env)
  assert (job.coordinator_address, job.process_count, job.process_id, job.source) == ("h0:8476", 2, 1, "the config")
  assert distributed.detect(values("jax_process_count=1", "jax_process_id=0", "jax_coordinator_address=h:1")) is None


SRUN_MINIMAL = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "n1"}


@pytest.mark.parametrize(
  "overrides, env, message",
  [
    (("jax_process_count=2",), {}, "jax_coordinator_address, jax_process_id not set"),
    ((), {"JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "0"}, "jax_coordinator_address not set"),
    (("jax_coordinator_address=h0", "jax_process_count=2", "jax_process_id=0"), {}, "is not host:port"),
    (("jax_coordinator_address=h0:99999", "jax_process_count=2", "jax_process_id=0"), {}, "is not host:port"),
    ((), {"TPU_WORKER_ID": "one", "TPU_WORKER_HOSTNAMES": "h0,h1"}, "TPU_WORKER_ID='one' is not an integer"),
    ((), {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": ""}, "TPU_WORKER_HOSTNAMES is empty"),
    ((), {**SRUN_MINIMAL, "SLURM_PROCID": "x"}, "SLURM_PROCID='x'"),
    (("jax_coordinator_address=h0:1", "jax_process_count=2", "jax_process_id=2"), {}, "process id 2"),
    ((), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "two", "JAX_PROCESS_ID": "0"}, "not an integer"),
  ],
)
def test_an_incomplete_or_impossible_job_is_a_config_error(overrides, env, message):
  with pytest.raises(ConfigError, match=message):
    distributed.detect(values(*overrides), env=env)


SRUN = {
  "SLURM_JOB_ID": "4242",
  "SLURM_STEP_ID": "0",
  "SLURM_PROCID": "5",
  "SLURM_LOCALID": "1",
  "SLURM_NODEID": "1",
  "SLURM_STEP_NUM_TASKS": "8",
  "SLURM_NTASKS": "8",
  "SLURM_STEP_NODELIST": "gpu[007-010],login1",
  "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
}


def test_an_srun_task_finds_its_job_in_slurms_variables():
  job = distributed.detect(values(), env=SRUN)
  # The coordinator is the step's first node, on a port derived from the job id as JAX's SlurmCluster does.
  assert job.coordinator_address == f"gpu007:{4242 % 4096 + 61440}"
  assert (job.process_count, job.process_id, job.source, job.local_device_ids) == (8, 5, "SLURM", None)
  assert distributed.detect(values(), env={**SRUN, "JAX_COORDINATOR_PORT": "9999"}).coordinator_address == "gpu007:9999"
  # The batch script's own shell (no job step) and a one-task step are single processes.
  assert distributed.detect(values(), env={k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}) is None
  assert distributed.detect(values(), env={**SRUN, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize(
  "env, expected",
  [
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, (1,)),  # 4 tasks share the node's 4 GPUs: SLURM_LOCALID picks one.
    ({"CUDA_VISIBLE_DEVICES": "3"}, (0,)),  # --gpus-per-task=1: the one GPU this task sees.
    ({"CUDA_VISIBLE_DEVICES": "4,5", "SLURM_GPUS_PER_TASK": "2"}, (0, 1)),  # --gpus-per-task=2: both of its own.
    ({"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_NODEID": "1"}, (0, 1, 2, 3)),
  ],
)
def test_each_slurm_task_takes_its_own_gpus(env, expected):
  assert distributed.detect(values("hardware=gpu"), env={**SRUN, **env}).local_device_ids == expected


def test_tpu_style_variables_give_the_multislice_layout():
  env = {
    "TPU_WORKER_ID": "1",
    "TPU_WORKER_HOSTNAMES": "10.0.0.5,10.0.0.6",
    "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8080",
    "MEGASCALE_NUM_SLICES": "3",
    "MEGASCALE_SLICE_ID": "2",
  }
  job = distributed.detect(values(), env=env)
  assert (job.coordinator_address, job.process_count, job.process_id) == ("10.0.0.1:8482", 6, 5)
  one_slice = {"TPU_WORKER_ID": "0", "TPU_WORKER_HOSTNAMES": "h0,h1", "JAX_COORDINATOR_PORT": "7"}
  assert distributed.detect(values(), env=one_slice).coordinator_address == "h0:7"
  tpu = distributed.detect(values("hardware=tpu"), env={})  # On TPUs JAX reads the VM's metadata itself.
  assert tpu.coordinator_address is None and tpu.source == "the Cloud TPU environment"
  assert distributed.detect(values("hardware=tpu", "skip_jax_distributed_system=true"), env={}) is None


def test_a_second_initialize_keeps_the_job_already_joined(monkeypatch):
  """Scripts that load their config twice (convert_hf_checkpoint.py) must not join twice."""
  monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **_: pytest.fail("joined twice"))
  env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_PROCESS_COUNT": "2", "JAX_PROCESS_ID": "1"}
  assert distributed.initialize(values(), env=env).process_id == 1


def test_first_host_of_a_slurm_node_list():
  assert distributed.first_host("node001") == "node001"
  assert distributed.first_host("a1,b2") == "a1"
  assert distributed.first_host("node[003-005,009],gpu1") == "node003"
  assert distributed.first_host("node[012,001]") == "node012"


# ---------------------------------------------------------------------------------------------- real jobs
DECODE_LOGS = ("decode_0", "decode_1", "decode")


def start_train(out_dir, name, devices, *overrides, job=None, script="train.py"):
  """Starts MaxText/`script` on `devices` simulated CPU devices; job=(port, count, id) joins a multi-process job."""
  env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
  if job is not None:
    port, count, process_id = job
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_PROCESS_COUNT=str(count), JAX_PROCESS_ID=str(process_id))
  argv = [sys.executable, f"MaxText/{script}", BASE_YML, f"base_output_directory={out_dir}", *TRAIN, *overrides]
  with open(os.path.join(out_dir, f"{name}.log"), "w") as log:  # The child keeps its own descriptor.
    return subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(processes, timeout=240) -> list[int]:
  """Exit codes of `processes`; past `timeout` seconds all of them are killed and the test fails."""
  deadline = time.time() + timeout
  try:
    return [p.wait(timeout=max(deadline - time.time(), 1)) for p in processes]
  finally:
    for p in processes:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def log_tail(out_dir, name) -> str:
  with open(os.path.join(out_dir, f"{name}.log"), encoding="utf-8") as f:
    return "".join(line for line in f.readlines()[-15:] if not line.startswith("[Gloo]"))


@pytest.mark.slow
def test_two_processes_train_like_one_and_their_checkpoint_resumes_in_one(tmp_path):
  """2 processes x 4 devices (fsdp across processes) = 1 process x 8 devices, step for step; the job's
  checkpoint (written through Orbax by both processes) then resumes in a single process."""
  out = str(tmp_path)
  port = free_port()
  two = ("run_name=two", "dcn_fsdp_parallelism=2", "dcn_data_parallelism=1", "steps=4", "checkpoint_period=2")
  job = [start_train(out, f"two_{i}", 4, *two, f"metrics_file={out}/two.jsonl", job=(port, 2, i)) for i in range(2)]
  codes = finish(job)
  assert codes == [0, 0], log_tail(out, "two_0") + log_tail(out, "two_1")
  with open(f"{out}/two.jsonl", encoding="utf-8") as f:
    lines = f.readlines()
  assert len(lines) == 5 and '"goodput"' in lines[-1]  # A line per step and the goodput: only process 0 writes.
  assert sorted(os.listdir(f"{out}/two/checkpoints")) == ["2", "4"]

  one = start_train(out, "one", 8, "run_name=one", "ici_fsdp_parallelism=8", "steps=6", f"metrics_file={out}/one.jsonl")
  resumed = ("run_name=two", "steps=6", "checkpoint_period=2", f"metrics_file={out}/resumed.jsonl")
  assert finish([one]) == [0], log_tail(out, "one")
  assert finish([start_train(out, "resumed", 8, *resumed)]) == [0], log_tail(out, "resumed")

  reference, split = (
    metrics_losses(f"{out}/one.jsonl"),
    {**metrics_losses(f"{out}/two.jsonl"), **metrics_losses(f"{out}/resumed.jsonl")},
  )
  assert sorted(split) == sorted(reference) == list(range(6))
  for step, loss in reference.items():
    assert split[step] == pytest.approx(loss, rel=1e-5), step
  assert "resumed from" in log_tail(out, "resumed")

  # decode.py in a two-process job samples what a single process samples, and only process 0 prints.
  texts = [f"The sun of the sea is {n} and the sea of the sun is {n + 1}." for n in range(60)]
  train_tokenizer.train(texts * 5, vocab_size=300, output=f"{out}/tok.model")
  sample = ("run_name=two", f"tokenizer_path={out}/tok.model", "prompt=The sun", "per_device_batch_size=1")
  sample += ("max_prefill_predict_length=8", "max_target_length=16")
  port = free_port()
  job = [start_train(out, f"decode_{i}", 4, *sample, job=(port, 2, i), script="decode.py") for i in range(2)]
  assert finish(job) == [0, 0], log_tail(out, "decode_0") + log_tail(out, "decode_1")
  assert finish([start_train(out, "decode", 8, *sample, script="decode.py")]) == [0], log_tail(out, "decode")
  printed = [[line for line in log_tail(out, name).splitlines() if line.startswith("Input")] for name in DECODE_LOGS]
  assert printed[0] == printed[2] and len(printed[0]) == 1 and printed[1] == []


@pytest.mark.slow
def test_a_killed_process_takes_the_job_down(tmp_path):
  """kill -9 of one process: the other fails too (non-zero) within a bounded time instead of hanging."""
  out = str(tmp_path)
  port = free_port()
  flags = ("run_name=kill", "steps=10000", "enable_checkpointing=false", "dcn_data_parallelism=2")
  flags += ("jax_distributed_heartbeat_timeout_seconds=10", f"metrics_file={out}/kill.jsonl")
  job = [start_train(out, f"kill_{i}", 4, *flags, job=(port, 2, i)) for i in range(2)]
  try:
    deadline = time.time() + 180
    while not (os.path.exists(f"{out}/kill.jsonl") and metrics_losses(f"{out}/kill.jsonl")) and time.time() < deadline:
      assert job[0].poll() is None, log_tail(out, "kill_0")
      time.sleep(0.5)
    assert metrics_losses(f"{out}/kill.jsonl"), "the job never completed a step: " + log_tail(out, "kill_0")
    os.killpg(job[1].pid, signal.SIGKILL)
    killed = time.time()
    code = job[0].wait(timeout=60)
  finally:
    for p in job:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
  assert code != 0
  assert time.time() - killed < 60


@pytest.mark.slow
def test_sigterm_to_one_process_checkpoints_the_whole_job_at_one_step(tmp_path):
  """A preemption notice (SIGTERM) to any process: all stop after the same step, save it, and exit non-zero."""
  out = str(tmp_path)
  port = free_port()
  flags = ("run_name=term", "steps=10000", "checkpoint_period=10000", "dcn_data_parallelism=2")
  job = [start_train(out, f"term_{i}", 4, *flags, f"metrics_file={out}/term.jsonl", job=(port, 2, i)) for i in range(2)]
  try:
    deadline = time.time() + 180
    while not (os.path.exists(f"{out}/term.jsonl") and metrics_losses(f"{out}/term.jsonl")) and time.time() < deadline:
      assert job[0].poll() is None, log_tail(out, "term_0")
      time.sleep(0.5)
    job[1].send_signal(signal.SIGTERM)
    codes = finish(job, timeout=90)
  finally:
    finish(job, timeout=1)
  assert codes == [1, 1]
  saved = os.listdir(f"{out}/term/checkpoints")
  assert len(saved) == 1 and int(saved[0]) == max(metrics_losses(f"{out}/term.jsonl")) + 1
  for i in range(2):
    assert f"checkpoint {saved[0]} is saved: run the same command again to resume" in log_tail(out, f"term_{i}")


@pytest.mark.slow
def test_processes_that_do_not_share_the_output_folder_stop_before_training(tmp_path):
  """Each process would write its checkpoint shards where the others never look: a config error on all."""
  port = free_port()
  job = []
  for i in range(2):
    os.makedirs(tmp_path / f"host{i}")
    job.append(start_train(str(tmp_path / f"host{i}"), "log", 4, "run_name=apart", "steps=2", job=(port, 2, i)))
  assert finish(job, timeout=180) == [2, 2]
  message = log_tail(str(tmp_path / "host1"), "log").strip().splitlines()[-1]
  assert message.startswith("error: base_output_directory=") and "process(es) [1] of 2" in message
  assert not os.path.exists(tmp_path / "host0" / "apart" / "checkpoints")
