"""Every family with a Hugging Face mapping, trained: training sharded over 8 devices (fsdp x tensor, x expert for a
mixture of experts) gives the losses and parameters of one device; and for the families whose training state differs
in kind (KILLED), a run killed with kill -9 resumes to the uninterrupted run's losses and parameters bit for bit.

The families come from the registry (families.FAMILIES), so a new family is tested here without an edit: each one's
tiny model is its first hf_example (the small transformers model its parity test builds), read into our keys by the
family's own importer. qwen2's sharded case runs in the quick loop (the mesh tier); every other family's is
slow-marked, with qwen2's as their fast sibling (each family adds its layer to the same loop, step and checkpoints).
The kill -9 cases start processes, so all of them are slow (end to end).
"""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml
from flax import linen as nn

from MaxText import checkpointing, families, train
from MaxText import state as state_lib
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, deadline, metrics_losses, overrides, run

transformers = pytest.importorskip("transformers")

# The quick loop's family: its example is as small as Llama's, and it is this (Qwen 2.5).
QUICK = "qwen2"
TRAINED = sorted(name for name, family in families.FAMILIES.items() if family.hf_examples)


# Saving and resuming are the same code for every family (the whole state tree, checkpointing/); what a family
# changes is what that tree holds. These cover each kind: dense layers with biases (qwen2), multi-head latent
# attention with dense and MoE stacks and the router's gate bias (deepseek), experts with biases and
# attention sinks (gpt_oss), periods of local and global layers (gemma3). Every family's kill -9 case took 4 min of
# CI (2026-11-26); these four about 1.5.
KILLED = (QUICK, "deepseek", "gemma3", "gpt_oss")


def _each_family(names=None):
  """One case per family with examples (or per one of `names`); all but QUICK slow-marked (their fast sibling:
  QUICK's case)."""
  return [pytest.param(name, marks=[] if name == QUICK else [pytest.mark.slow]) for name in names or TRAINED]


def test_the_quick_family_is_registered_with_examples():
  assert QUICK in TRAINED and set(KILLED) <= set(TRAINED)


def tiny_model(name: str, folder) -> tuple[str, ...]:
  """The `model_name=` and `scan_layers=` overrides of family `name`'s tiny model: its first hf_example's
  config.json (transformers' config class fills in the defaults) read by the family's importer into a model yml,
  as convert_hf_checkpoint.py writes one. A model whose query or KV head count is odd (kept odd in the example for
  the parity test's head groups) gets twice the heads, so that tensor parallelism of 2 splits them."""
  family = families.FAMILIES[name]
  example = next(iter(family.hf_examples.values()))
  hf_json = transformers.AutoConfig.for_model(family.hf.model_type, **example.config).to_dict()
  keys = families.model_keys_from_hf(hf_json)
  if keys["base_num_query_heads"] % 2 or keys["base_num_kv_heads"] % 2:
    keys |= {"base_num_query_heads": 2 * keys["base_num_query_heads"], "base_num_kv_heads": 2 * keys["base_num_kv_heads"]}
  path = os.path.join(folder, f"{name}.yml")
  with open(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(keys, f, sort_keys=False)
  return f"model_name={path}", f"scan_layers={str(example.scan_layers).lower()}"


# kill -9: 10 steps, a checkpoint every 2 (each save blocks ~0.1 s: the run is killed well before its end). The
# processes share the tests' compilation cache (conftest.py: under JAX's lock, and an entry left short by the kill
# is deleted by the next run's prune).
KILL_RUN = ("max_target_length=32", "per_device_batch_size=2", "steps=10", "checkpoint_period=2", "log_period=1")
KILL_RUN += ("enable_checkpointing=true", "learning_rate=1e-2", "warmup_steps_fraction=0")


def _train_command(model, tmp_path, run_name: str, metrics: str) -> list[str]:
  args = (*model, *KILL_RUN, f"run_name={run_name}", f"base_output_directory={tmp_path}", f"metrics_file={metrics}")
  return [sys.executable, "MaxText/train.py", BASE_YML, *overrides(*args)]


def _final_params(model, tmp_path, run_name: str) -> dict:
  """The parameters of the run's latest checkpoint, as stored."""
  cfg = config(*model, *KILL_RUN, f"run_name={run_name}", f"base_output_directory={tmp_path}")
  return checkpointing.restore_host_params(cfg, state_lib.abstract_params(cfg))[0]


@pytest.mark.slow  # every family's case: kill -9 of a training process is end to end
@pytest.mark.parametrize("name", _each_family(KILLED))
def test_a_run_killed_with_kill_9_resumes_exactly(name, tmp_path):
  """On 2 devices (fsdp 2), train.py is killed with SIGKILL once checkpoint 2 is committed; the same command
  resumes from a checkpoint and finishes. Every loss either part logged, and the final parameters, equal those of
  an uninterrupted run (run beside it, in its own process) bit for bit."""
  model = tiny_model(name, tmp_path)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  log = {part: open(tmp_path / f"{part}.log", "w", encoding="utf-8") for part in ("straight", "killed")}  # noqa: SIM115
  procs = {
    part: subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log[part], stderr=subprocess.STDOUT)
    for part, cmd in (
      ("straight", _train_command(model, tmp_path, "straight", f"{tmp_path}/straight.jsonl")),
      ("killed", _train_command(model, tmp_path, "killed", f"{tmp_path}/killed.jsonl")),
    )
  }
  try:
    with deadline(240):
      while procs["killed"].poll() is None and not (tmp_path / "killed" / "checkpoints" / "2").is_dir():
        time.sleep(0.01)
      procs["killed"].send_signal(signal.SIGKILL)
      assert procs["straight"].wait() == 0, (tmp_path / "straight.log").read_text()
  finally:
    for proc in procs.values():
      proc.kill()
      proc.wait()
    for f in log.values():
      f.close()
  assert procs["killed"].returncode == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
  saved = os.listdir(tmp_path / "killed" / "checkpoints")
  assert "2" in saved and "10" not in saved, f"the run was killed at the wrong time: {saved}"

  resumed = run(_train_command(model, tmp_path, "killed", f"{tmp_path}/resumed.jsonl"), env)
  assert resumed.returncode == 0, resumed.stderr
  assert f"resumed from {tmp_path}/killed/checkpoints/" in resumed.stdout
  straight = metrics_losses(tmp_path / "straight.jsonl")
  assert sorted(straight) == list(range(10))
  after = metrics_losses(tmp_path / "resumed.jsonl")
  assert after and min(after) >= 2 and sorted(after) == list(range(min(after), 10)), sorted(after)
  for step, loss in (metrics_losses(tmp_path / "killed.jsonl", killed=True) | after).items():
    assert loss == straight[step], f"step {step}: {loss} != {straight[step]}"
  want, got = _final_params(model, tmp_path, "straight"), _final_params(model, tmp_path, "killed")
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", _each_family())
@pytest.mark.mesh
def test_sharded_training_equals_one_device(name, tmp_path):
  """3 steps on 8 devices, fsdp 4 x tensor 2 (fsdp 2 x tensor 2 x expert 2 for a mixture of experts), against one
  device with the same global batch of 8 rows: the losses within 1e-5 (relative), and each final parameter within
  1e-4 of its tensor's largest update (|final - initial|) plus one float32 rounding of it per step (2^-23 relative
  each: the two runs add nearly equal updates, and each sum may round the other way). A gradient's rounding is
  relative to the terms it sums, not to their sum: where they cancel to nothing (GPT-3's key bias, which adds the
  same q.b to each of a query's logits, so the softmax never sees it), the update is rounding alone, and the
  tolerance is no less than 1e-6 of the model's largest update (8 float32 epsilons).

  The optimizer is SGD, whose update is linear in the gradient: a sharded matmul or reduction sums in another order,
  which moves each gradient by float32 rounding (a few 1e-6 of its scale), and the update by as much. Adam would
  divide a near-zero gradient by its own root mean square, so that rounding could move a parameter by the whole
  learning rate either way, and a parameter comparison would say nothing."""
  model = tiny_model(name, tmp_path)
  common = (*model, "max_target_length=32", "steps=3", "opt_type=sgd", "learning_rate=0.1", "warmup_steps_fraction=0")
  common += ("enable_checkpointing=true", "async_checkpointing=false", f"base_output_directory={tmp_path}")
  mesh = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  if families.FAMILIES[name].moe:
    mesh = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")
  one = config(*common, "run_name=one", "per_device_batch_size=8")
  eight = config(*common, "run_name=eight", "per_device_batch_size=1", *mesh, num_devices=8)
  assert one.global_batch_size == eight.global_batch_size == 8
  want = [loss for _, loss in train.train(one, jax.devices()[:1]).losses]
  got = [loss for _, loss in train.train(eight, jax.devices()[:8]).losses]
  np.testing.assert_allclose(got, want, rtol=1e-5)

  # The initial parameters: init_weights_seed's, as both runs drew them (their step-0 losses agree above).
  initial = state_lib.init_params(models.Transformer(one), one, jax.random.key(one.init_weights_seed))
  initial = [np.asarray(a, np.float64) for a in jax.tree_util.tree_leaves(nn.meta.unbox(initial))]
  abstract = state_lib.abstract_params(one)
  p1 = checkpointing.restore_host_params(one, abstract)[0]
  p8 = checkpointing.restore_host_params(eight, abstract)[0]
  finals = jax.tree_util.tree_leaves(p1)
  updates = [np.abs(np.asarray(a1, np.float64) - a0).max() for a1, a0 in zip(finals, initial, strict=True)]
  floor = 1e-6 * max(updates)
  for (path, a8), a1, update in zip(jax.tree_util.tree_leaves_with_path(p8), finals, updates, strict=True):
    tolerance = max(1e-4 * update, floor)
    np.testing.assert_allclose(a8, a1, rtol=3 * 2.0**-23, atol=tolerance, err_msg=jax.tree_util.keystr(path))
