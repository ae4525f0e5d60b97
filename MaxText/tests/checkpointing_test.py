"""Checkpoint rules: paths, save / restore round trips, what a run starts from, and the one-line errors."""

import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from MaxText import checkpointing, cli, integrity, optimizers, pyconfig, sharding
from MaxText import state as state_lib
from MaxText.common_types import ConfigError
from MaxText.layers import models
from MaxText.tests.helpers import (
  array_files,
  assert_trees_equal,
  checkpoint_manager,
  config,
  data_files,
  flip_a_stored_bit,
)

MESH = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
CHECKPOINTS = ("enable_checkpointing=true", "async_checkpointing=false")


def _cfg(base, *args, **kw):
  return config(*MESH, *CHECKPOINTS, f"base_output_directory={base}", *args, num_devices=4, **kw)


@dataclasses.dataclass
class Env:
  cfg: object
  mesh: object
  model: object
  tx: object
  layout: state_lib.StateLayout
  base: state_lib.TrainState  # random params and a non-zero optimizer state, step 0
  shift: object  # jitted (state, k) -> every leaf + k

  def variant(self, k: int) -> state_lib.TrainState:
    """The base state with every leaf shifted by k (so step k): a distinct state per k, with the layout's shardings."""
    return self.shift(self.base, jnp.int32(k))


@pytest.fixture(scope="module")
def env():
  """A 4-device fsdp=2 x tensor=2 mesh; the base state is random params after one AdamW step of random gradients."""
  cfg = _cfg("/tmp/unused", "steps=4", "learning_rate=1e-2")
  mesh = sharding.create_mesh(cfg, jax.devices()[:4])
  model = models.Transformer(cfg, mesh)
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))
  layout = state_lib.state_layout(model, cfg, tx, mesh)
  rng = np.random.default_rng(0)

  def random_tree():
    return jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), layout.abstract.params)

  state = state_lib.state_from_params(random_tree(), tx, layout, cfg)

  def adam_step(s, grads):
    updates, opt_state = tx.update(grads, s.opt_state, s.params)
    params = jax.tree_util.tree_map(lambda p, u: p + u, s.params, updates)
    return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state)

  base = jax.jit(adam_step, out_shardings=layout.shardings)(state, random_tree())
  shift = jax.jit(lambda s, k: jax.tree_util.tree_map(lambda x: x + k.astype(x.dtype), s), out_shardings=layout.shardings)
  return Env(cfg, mesh, model, tx, layout, base, shift)


def _save(cfg, state) -> bool:
  with checkpoint_manager(cfg) as manager:
    return checkpointing.save(manager, state)


def _start(cfg, env) -> checkpointing.StartingPoint:
  with checkpoint_manager(cfg) as manager:
    return checkpointing.restore_or_init(cfg, manager, env.model, env.tx, env.layout)


def _assert_layout_shardings(state, env):
  for array, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(env.layout.shardings), strict=True):
    assert array.sharding == want


def _one_line_error(fn, *args) -> str:
  with pytest.raises(ConfigError) as e:
    fn(*args)
  message = str(e.value)
  assert "\n" not in message, message
  return message


@pytest.fixture(scope="module")
def saved(env, tmp_path_factory):
  """A float32 checkpoint of env.variant(1) (scan_layers=true): its items folder."""
  base = tmp_path_factory.mktemp("saved")
  cfg = _cfg(base, "run_name=saved")
  assert _save(cfg, env.variant(1))
  return os.path.join(checkpointing.checkpoint_dir(cfg), "1", checkpointing.ITEM)


def test_run_dir_and_checkpoint_dir(tmp_path):
  cfg = _cfg(tmp_path, "run_name=r")
  assert checkpointing.run_dir(cfg) == f"{tmp_path}/r"
  assert checkpointing.checkpoint_dir(cfg) == f"{tmp_path}/r/checkpoints"
  home = _cfg("~/maxtext_runs", "run_name=r")
  assert checkpointing.run_dir(home) == os.path.join(os.path.expanduser("~"), "maxtext_runs", "r")
  unnamed = _cfg(tmp_path, run_name="")
  assert "run_name" in _one_line_error(checkpointing.run_dir, unnamed)
  assert "run_name" in _one_line_error(checkpointing.checkpoint_dir, unnamed)


def test_items_path_takes_a_step_or_items_folder_only(tmp_path):
  items = tmp_path / "checkpoints" / "3" / "items"
  items.mkdir(parents=True)
  not_yet = _one_line_error(checkpointing.items_path, "load_parameters_path", str(items))
  assert f"load_parameters_path={items} holds no Orbax checkpoint (no _METADATA or manifest.ocdbt)" in not_yet
  (items / "_METADATA").touch()
  assert checkpointing.items_path("load_parameters_path", str(items.parent)) == str(items)
  assert checkpointing.items_path("load_parameters_path", str(items)) == str(items)
  missing = _one_line_error(checkpointing.items_path, "load_full_state_path", str(tmp_path / "nope"))
  assert f"load_full_state_path={tmp_path}/nope does not exist" in missing
  # What a save cut short leaves behind: Orbax's temporary folder, never renamed to its step.
  partial = tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234567" / "items"
  partial.mkdir(parents=True)
  for path in (partial, partial.parent):
    assert "unfinished" in _one_line_error(checkpointing.items_path, "load_parameters_path", str(path))


def test_latest_step_reads_numeric_folders_only(tmp_path):
  cfg = _cfg(tmp_path, "run_name=r")
  assert checkpointing.latest_step(cfg) is None  # no checkpoint folder at all
  for name in ("2", "9", "10", "abc", "12.orbax-checkpoint-tmp-5", "11_old"):
    (tmp_path / "r" / "checkpoints" / name).mkdir(parents=True)
  assert checkpointing.latest_step(cfg) == 10  # numerically, not by name ("9" > "10")


@pytest.mark.mesh
def test_save_and_resume_round_trip_is_bit_exact(tmp_path, env):
  """Steps 2 and 5 saved; a new manager resumes step 5 with the same params, optimizer state and step, placed
  by the layout; a second save of step 5 (other params) is refused and leaves the stored one as it was."""
  cfg = _cfg(tmp_path, "run_name=r")
  assert checkpointing.create_manager(cfg.replace(enable_checkpointing=False)) is None
  s2, s5 = env.variant(2), env.variant(5)
  assert _save(cfg, s2) and _save(cfg, s5)
  assert not _save(cfg, s5.replace(params=jax.tree_util.tree_map(lambda p: p * 2, s5.params)))
  assert sorted(os.listdir(checkpointing.checkpoint_dir(cfg))) == ["2", "5"]

  start = _start(cfg, env)
  assert start.resumed and start.source == f"resumed from {tmp_path}/r/checkpoints/5 (39 arrays verified)"
  assert_trees_equal(start.state, s5)
  _assert_layout_shardings(start.state, env)


@pytest.mark.mesh
def test_start_rules_first_match_wins(tmp_path, env):
  """Own run's latest checkpoint > load_full_state_path > load_parameters_path > fresh init (module docstring)."""
  full, params, own = env.variant(3), env.variant(7), env.variant(11)
  assert _save(_cfg(tmp_path, "run_name=full"), full)
  assert _save(_cfg(tmp_path, "run_name=params"), params)
  assert _save(_cfg(tmp_path, "run_name=own"), own)
  full_path = f"{tmp_path}/full/checkpoints/3"  # a step folder: items_path finds its items
  params_path = f"{tmp_path}/params/checkpoints/7/items"

  def start(run_name, **paths):
    # pyconfig refuses both paths at once; Config.replace (no re-validation) still lets the order be checked.
    return _start(_cfg(tmp_path, f"run_name={run_name}").replace(**paths), env)

  for paths in (
    dict(load_full_state_path=full_path, load_parameters_path=params_path),
    dict(load_full_state_path=full_path),
    dict(load_parameters_path=params_path),
  ):
    resumed = start("own", **paths)
    assert resumed.resumed and resumed.source == f"resumed from {tmp_path}/own/checkpoints/11 (39 arrays verified)", paths
    assert_trees_equal(resumed.state, own)

  for paths in (
    dict(load_full_state_path=full_path, load_parameters_path=params_path),
    dict(load_full_state_path=full_path),
  ):
    from_full = start("new1", **paths)
    assert not from_full.resumed and from_full.source == f"full state from {full_path}/items"
    assert_trees_equal(from_full.state, full)
    _assert_layout_shardings(from_full.state, env)

  from_params = start("new2", load_parameters_path=params_path)
  assert not from_params.resumed and int(from_params.state.step) == 0
  assert_trees_equal(from_params.state.params, params.params)
  assert_trees_equal(from_params.state.opt_state, env.tx.init(jax.device_get(params.params)))  # fresh optimizer
  _assert_layout_shardings(from_params.state, env)

  fresh = _start(_cfg(tmp_path, "run_name=new3", "init_weights_seed=5"), env)
  assert not fresh.resumed and fresh.source == "fresh init (seed 5)" and int(fresh.state.step) == 0
  assert_trees_equal(fresh.state.opt_state, env.tx.init(jax.device_get(fresh.state.params)))
  for other in (full, params, own):
    assert not np.array_equal(fresh.state.params["logits_dense"]["kernel"], other.params["logits_dense"]["kernel"])


@pytest.mark.mesh
def test_check_compatible_names_the_leaf_in_one_line(env, saved):
  checkpointing.check_compatible(saved, env.layout.abstract)  # the state it was saved from fits
  f32 = jax.ShapeDtypeStruct
  extra = {"params": {**env.layout.abstract.params, "extra": f32((3,), jnp.float32)}}
  message = _one_line_error(checkpointing.check_compatible, saved, extra)
  assert f"checkpoint {saved} has no params.extra" in message
  resized = {"params": {**env.layout.abstract.params, "decoder_norm": {"scale": f32((48,), jnp.float32)}}}
  message = _one_line_error(checkpointing.check_compatible, saved, resized)
  assert "stores params.decoder_norm.scale with shape (32,) but this config needs (48,)" in message


@pytest.mark.mesh
def test_a_shape_mismatch_points_at_the_runs_config_yml_which_loads_back(tmp_path, env):
  """Loading a checkpoint with the wrong model keys names the file that holds the right ones: the run's config.yml
  (written by train.py at each start, a config file that loads back), with no "new run_name" advice for a checkpoint
  that is only read (decode.py, serve.py, load_parameters_path)."""
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(1))
  items = os.path.join(checkpointing.checkpoint_dir(cfg), "1", checkpointing.ITEM)
  f32 = jax.ShapeDtypeStruct
  resized = {"params": {**env.layout.abstract.params, "decoder_norm": {"scale": f32((48,), jnp.float32)}}}
  message = _one_line_error(checkpointing.check_compatible, items, resized)
  assert message.endswith("use the model config it was saved with"), message
  cli.write_resolved_config(cfg, checkpointing.run_dir(cfg))
  message = _one_line_error(checkpointing.check_compatible, items, resized)
  run_config = f"{tmp_path}/r/config.yml"
  assert message.endswith(f"its run's {run_config} (pass it as the config file)"), message
  resuming = functools.partial(checkpointing.check_compatible, resuming=True)  # the run's own checkpoint
  assert message.replace("(pass it as the config file)", "(pass it as the config file), or start a new run_name") == (
    _one_line_error(resuming, items, resized)
  )
  again = pyconfig.load([run_config], num_devices=4, env={})
  assert again.as_dict() == {**cfg.as_dict(), "model_name": "default"}


@pytest.mark.mesh
def test_check_compatible_reads_only_complete_checkpoints(tmp_path, env):
  message = _one_line_error(checkpointing.check_compatible, str(tmp_path), env.layout.abstract)
  assert f"checkpoint {tmp_path} is damaged: its metadata cannot be read" in message


@pytest.mark.mesh
def test_scan_layers_mismatch_says_how_to_convert(tmp_path, env, saved):
  """Stacked layers (scan_layers=true) checked against an unrolled target, and the reverse: one line naming
  scan_layers and the way out (force_unroll=true for the unscanned copy)."""
  unrolled_cfg = _cfg(tmp_path, "run_name=unrolled", "scan_layers=false")
  unrolled, _ = state_lib.params_layout(models.Transformer(unrolled_cfg, env.mesh), unrolled_cfg, env.mesh)
  assert "layers_0" in unrolled and "layers" not in unrolled

  message = _one_line_error(checkpointing.check_compatible, saved, {"params": unrolled})
  assert "stacked" in message and "scan_layers=false needs them one by one" in message
  assert "run with scan_layers=true" in message and "force_unroll=true" in message
  # The same check guards load_params (decoding) before anything is read.
  loading = unrolled_cfg.replace(load_parameters_path=saved)
  assert "force_unroll=true" in _one_line_error(checkpointing.load_params, loading, env.mesh, jnp.float32)

  zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), unrolled)
  assert _save(unrolled_cfg, state_lib.TrainState(step=jnp.int32(1), params=zeros, opt_state=env.tx.init(zeros)))
  path = os.path.join(checkpointing.checkpoint_dir(unrolled_cfg), "1", checkpointing.ITEM)
  message = _one_line_error(checkpointing.check_compatible, path, {"params": env.layout.abstract.params})
  assert "one by one" in message and "scan_layers=true needs them stacked" in message
  assert "run with scan_layers=false" in message


@pytest.mark.mesh
def test_restore_host_params_keeps_the_stored_dtype(tmp_path, env):
  """bfloat16 params restored for a float32 target: host numpy arrays, still bfloat16, the saved bits."""
  params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), env.variant(4).params)
  stored = state_lib.TrainState(step=jnp.int32(4), params=params, opt_state=env.tx.init(params))
  cfg = _cfg(tmp_path, "run_name=bf16")
  assert _save(cfg, stored)
  path = f"{tmp_path}/bf16/checkpoints/4/items"
  got, where = checkpointing.restore_host_params(cfg.replace(load_parameters_path=path), env.layout.abstract.params)
  assert where == path
  assert all(type(leaf) is np.ndarray for leaf in jax.tree_util.tree_leaves(got))
  assert_trees_equal(got, jax.device_get(params))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.mesh
def test_load_params_is_sharded_and_cast(tmp_path, env, saved, dtype):
  """load_params: params_layout's shardings, `dtype`, and the saved values cast by numpy (round to nearest
  even in both, so bit-exact)."""
  cfg = _cfg(tmp_path, "run_name=decode", f"load_parameters_path={saved}")
  got, where = checkpointing.load_params(cfg, env.mesh, dtype)
  assert where == saved
  _, shardings = state_lib.params_layout(env.model, cfg, env.mesh)
  for array, want in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(shardings), strict=True):
    assert array.sharding == want
  numpy_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
  assert_trees_equal(got, jax.tree_util.tree_map(lambda p: np.asarray(p).astype(numpy_dtype), env.variant(1).params))


def test_params_path_rules(tmp_path):
  items = tmp_path / "src" / "checkpoints" / "3" / "items"
  items.mkdir(parents=True)
  (items / "_METADATA").touch()
  other = tmp_path / "other" / "checkpoints" / "8" / "items"
  other.mkdir(parents=True)
  (other / "_METADATA").touch()
  given = f"load_parameters_path={items.parent}"
  assert checkpointing.params_path(_cfg(tmp_path, "run_name=x", given)) == str(items)
  full = f"load_full_state_path={other}"
  assert checkpointing.params_path(_cfg(tmp_path, "run_name=x", full)) == str(other)
  # pyconfig refuses both at once (checked with Config.replace, which does not re-validate): params first.
  both = _cfg(tmp_path, "run_name=x", given).replace(load_full_state_path=str(other))
  assert checkpointing.params_path(both) == str(items)
  missing = _cfg(tmp_path, "run_name=x", f"load_parameters_path={tmp_path}/none")
  assert "load_parameters_path=" in _one_line_error(checkpointing.params_path, missing)

  nothing = _one_line_error(checkpointing.params_path, _cfg(tmp_path, run_name=""))
  assert "no parameters to load" in nothing and "load_parameters_path" in nothing
  assert "run_name=x has no checkpoint" in _one_line_error(checkpointing.params_path, _cfg(tmp_path, "run_name=x"))
  for step in ("4", "12", "12.orbax-checkpoint-tmp-9", "9"):
    (tmp_path / "run" / "checkpoints" / step / "items").mkdir(parents=True)
  assert checkpointing.params_path(_cfg(tmp_path, "run_name=run")) == f"{tmp_path}/run/checkpoints/12/items"


class _ManagerThatWouldStop:
  """A stand-in manager whose preemption flag is set: only a multi-process job may consult it."""

  def __init__(self):
    self.asked = []

  def reached_preemption(self, step):
    self.asked.append(step)
    return True


def test_reached_preemption_only_in_a_multi_process_job():
  assert not jax.distributed.is_initialized()  # this test process is a single-process job
  assert checkpointing.reached_preemption(None, 3) is False
  manager = _ManagerThatWouldStop()
  assert checkpointing.reached_preemption(manager, 3) is False
  assert manager.asked == []


def test_out_of_space_is_found_however_the_storage_layer_wraps_it():
  import errno

  assert checkpointing.out_of_space(OSError(errno.ENOSPC, "No space left on device"))
  tensorstore_like = ValueError("RESOURCE_EXHAUSTED: Failed to write 35653 bytes: No space left on device [code=28]")
  assert checkpointing.out_of_space(tensorstore_like)
  try:
    try:
      raise OSError(errno.ENOSPC, "disk full")
    except OSError as inner:
      raise RuntimeError("async save failed") from inner
  except RuntimeError as outer:
    assert checkpointing.out_of_space(outer)
  assert not checkpointing.out_of_space(OSError(errno.EACCES, "Permission denied"))
  assert not checkpointing.out_of_space(None)


def _truncate(step_dir: str) -> None:
  """What a copy cut short leaves: its data files empty (which of their bytes Orbax reads depends on the save)."""
  for path in data_files(step_dir):
    os.truncate(path, 0)


def _remove_metadata(step_dir: str) -> None:
  os.remove(os.path.join(step_dir, checkpointing.ITEM, "_METADATA"))


def _garble_checksums(step_dir: str) -> None:
  with open(os.path.join(step_dir, checkpointing.CHECKSUM_ITEM, "metadata"), "w") as f:
    f.write("{not json")


DAMAGE = {
  "bit flipped in a value": (
    lambda d: flip_a_stored_bit(d, "params.token_embedder.embedding"),
    "params.token_embedder.embedding differs from what was saved",
  ),
  "truncated files": (_truncate, "cannot be read"),
  "no _METADATA": (_remove_metadata, "its metadata cannot be read"),
  "garbled checksums": (_garble_checksums, "its checksums cannot be read"),
}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.mesh
def test_resume_skips_a_damaged_checkpoint_for_the_newest_that_verifies(tmp_path, env, damage):
  damage_fn, reason = DAMAGE[damage]
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(2)) and _save(cfg, env.variant(5))
  newest = os.path.join(checkpointing.checkpoint_dir(cfg), "5")
  damage_fn(newest)

  start = _start(cfg, env)
  assert start.resumed and start.source.startswith(f"resumed from {tmp_path}/r/checkpoints/2 (")
  assert_trees_equal(start.state, env.variant(2))
  [skipped] = start.skipped
  assert skipped.startswith(f"checkpoint {newest}") and "is damaged: " in skipped and reason in skipped, skipped
  assert skipped.endswith(f"; set aside as {newest}.damaged") and "\n" not in skipped
  assert sorted(os.listdir(checkpointing.checkpoint_dir(cfg))) == ["2", "5.damaged"]  # 5 is saved again later

  # The same checkpoint given as load_full_state_path: an error, not a fallback.
  items = os.path.join(f"{newest}.damaged", checkpointing.ITEM)
  full = _cfg(tmp_path, "run_name=full", f"load_full_state_path={items}")
  start_or_check = checkpointing.check_start_paths if damage == "no _METADATA" else lambda c, _: _start(c, env)
  assert reason in _one_line_error(start_or_check, full, env.layout)
  if damage != "truncated files":  # (which may hit the optimizer state only)
    params_only = _cfg(tmp_path, "run_name=other", f"load_parameters_path={items}")
    assert reason in _one_line_error(checkpointing.load_params, params_only, env.mesh, jnp.float32)


@pytest.mark.mesh
def test_a_bfloat16_checkpoint_is_verified_then_cast_for_a_float32_run(tmp_path, env):
  """A bfloat16 import fine-tuned in float32: restored as stored, verified against its checksums, then cast."""
  params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), env.variant(3).params)
  items = checkpointing.save_params(str(tmp_path / "bf16"), params)
  cfg = _cfg(tmp_path, "run_name=other", f"load_parameters_path={items}")
  start = _start(cfg, env)
  assert start.source == f"params from {items}"
  want = jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), params)
  assert_trees_equal(start.state.params, want)
  _assert_layout_shardings(start.state, env)


@pytest.mark.mesh
def test_a_damaged_params_only_checkpoint_is_an_error(tmp_path, env):
  """load_parameters_path (decode.py, fine-tuning) of a params-only checkpoint with a flipped bit: exit 2."""
  items = checkpointing.save_params(str(tmp_path / "params"), env.variant(3).params)
  cfg = _cfg(tmp_path, "run_name=other", f"load_parameters_path={items}")
  params, _ = checkpointing.load_params(cfg, env.mesh, jnp.float32)
  assert_trees_equal(params, env.variant(3).params)
  flip_a_stored_bit(os.path.dirname(items), "params.decoder_norm.scale")
  message = _one_line_error(checkpointing.load_params, cfg, env.mesh, jnp.float32)
  assert message.startswith(f"checkpoint {os.path.dirname(items)} is damaged: params.decoder_norm.scale differs")
  assert "differs" in _one_line_error(checkpointing.restore_host_params, cfg, env.layout.abstract.params)


@pytest.mark.mesh
def test_resume_fails_when_no_checkpoint_verifies(tmp_path, env):
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(2)) and _save(cfg, env.variant(5))
  flip_a_stored_bit(os.path.join(checkpointing.checkpoint_dir(cfg), "5"), "params.decoder_norm.scale")
  _truncate(os.path.join(checkpointing.checkpoint_dir(cfg), "2"))
  message = _one_line_error(_start, cfg, env)
  assert message.startswith(f"no checkpoint in {tmp_path}/r/checkpoints can be resumed from (checkpoint ")
  assert "/5 is damaged" in message and "/2 is damaged" in message and "start the run over" in message
  assert sorted(os.listdir(checkpointing.checkpoint_dir(cfg))) == ["2", "5"]  # nothing moved: the run stops


@pytest.mark.mesh
def test_a_damaged_data_state_is_skipped_too(tmp_path, env):
  cfg = _cfg(tmp_path, "run_name=r").replace(dataset_type="grain")
  for step in (2, 5):
    with checkpoint_manager(cfg) as manager:
      assert checkpointing.save(manager, env.variant(step), {"next_index": step})
  data = os.path.join(checkpointing.checkpoint_dir(cfg), "5", checkpointing.DATA_ITEM, "process_0-of-1.json")
  with open(data) as f:
    text = f.read()
  assert 'next_index\\": 5' in text
  with open(data, "w") as f:
    f.write(text.replace('next_index\\": 5', 'next_index\\": 6'))
  start = _start(cfg, env)
  assert_trees_equal(start.state, env.variant(2))
  assert "the data iterator's state differs from what was saved" in start.skipped[0]


@pytest.mark.mesh
def test_a_config_mismatch_is_an_error_not_damage(tmp_path, env):
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(2))
  wider = _cfg(tmp_path, "run_name=r", "base_emb_dim=64", "override_model_config=true")
  mesh = sharding.create_mesh(wider, jax.devices()[:4])
  model = models.Transformer(wider, mesh)
  layout = state_lib.state_layout(model, wider, env.tx, mesh)
  with checkpoint_manager(wider) as manager:
    message = _one_line_error(checkpointing.restore_or_init, wider, manager, model, env.tx, layout)
  assert "damaged" not in message and "use the model config it was saved with" in message


def _drop_checksums(step_dir: str, from_orbax_metadata: bool = False) -> None:
  """Removes a checkpoint's checksums folder; from_orbax_metadata: their entry in Orbax's _CHECKPOINT_METADATA too,
  which leaves what a version older than checksums saved."""
  shutil.rmtree(os.path.join(step_dir, checkpointing.CHECKSUM_ITEM))
  if from_orbax_metadata:
    path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(path) as f:
      metadata = json.load(f)
    del metadata["item_handlers"][checkpointing.CHECKSUM_ITEM]
    with open(path, "w") as f:
      json.dump(metadata, f)


@pytest.mark.parametrize("evidence", ["own metadata", "earlier checkpoint"])
@pytest.mark.mesh
def test_a_checkpoint_that_lost_its_checksums_is_damaged(tmp_path, env, evidence):
  """An altered checkpoint whose checksums folder is gone is not restored unverified: resume skips it like a
  mismatch, and as load_parameters_path it is an error. The evidence that it had checksums: Orbax's metadata of
  the checkpoint itself, or else the earlier checkpoint of the run that has them."""
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(2)) and _save(cfg, env.variant(5))
  newest = os.path.join(checkpointing.checkpoint_dir(cfg), "5")
  flip_a_stored_bit(newest, "params.decoder_norm.scale")
  _drop_checksums(newest, from_orbax_metadata=evidence == "earlier checkpoint")
  why = {
    "own metadata": "its _CHECKPOINT_METADATA says it was saved with them",
    "earlier checkpoint": f"the earlier checkpoint {tmp_path}/r/checkpoints/2 has them",
  }[evidence]
  reason = f"checkpoint {newest} is damaged: its checksums (checksums/metadata) are missing, though {why}"

  params_only = _cfg(tmp_path, "run_name=other", f"load_parameters_path={newest}/items")
  assert _one_line_error(checkpointing.load_params, params_only, env.mesh, jnp.float32) == reason
  start = _start(cfg, env)
  assert start.source.startswith(f"resumed from {tmp_path}/r/checkpoints/2 (") and "arrays verified" in start.source
  assert_trees_equal(start.state, env.variant(2))
  assert start.skipped == (f"{reason}; set aside as {newest}.damaged",)
  set_aside = _cfg(tmp_path, "run_name=other", f"load_full_state_path={newest}.damaged/items")
  assert "its checksums (checksums/metadata) are missing" in _one_line_error(_start, set_aside, env)


@pytest.mark.mesh
def test_checkpoints_saved_before_checksums_still_load(tmp_path, env):
  """A run older than checksums resumes, unverified as the log says; in a run upgraded since, only its later
  checkpoints have checksums, and the older ones still load when a later one is damaged."""
  cfg = _cfg(tmp_path, "run_name=old")
  assert _save(cfg, env.variant(2)) and _save(cfg, env.variant(5))
  for step in ("2", "5"):
    _drop_checksums(os.path.join(checkpointing.checkpoint_dir(cfg), step), from_orbax_metadata=True)
  start = _start(cfg, env)
  assert start.source == f"resumed from {tmp_path}/old/checkpoints/5 (saved without checksums, not verified)"
  assert_trees_equal(start.state, env.variant(5))
  assert start.skipped == ()

  upgraded = _cfg(tmp_path, "run_name=upgraded")
  assert _save(upgraded, env.variant(2)) and _save(upgraded, env.variant(5))
  _drop_checksums(os.path.join(checkpointing.checkpoint_dir(upgraded), "2"), from_orbax_metadata=True)
  flip_a_stored_bit(os.path.join(checkpointing.checkpoint_dir(upgraded), "5"), "params.decoder_norm.scale")
  start = _start(upgraded, env)
  assert start.source == f"resumed from {tmp_path}/upgraded/checkpoints/2 (saved without checksums, not verified)"
  assert_trees_equal(start.state, env.variant(2))
  assert "params.decoder_norm.scale differs from what was saved" in start.skipped[0]


@pytest.mark.mesh
def test_truncated_array_files_name_an_array_they_hold(tmp_path, env):
  """Array data files cut to half their size (a copy cut short): the reason names an array of the state, the
  checkpoint's items folder and a file's new size, and has no Python object's repr in it; the reads Orbax
  abandoned print nothing (each was an `Exception ignored in: <coroutine ...>` of ~60 lines on stderr)."""
  unraisable, hook = [], sys.unraisablehook

  def passed_on(event):
    if sys.unraisablehook is not passed_on:  # (called by the hook the restore put on top: it let `event` through)
      unraisable.append(event)  # (while this is the hook, an event is an earlier test's, from Orbax's threads)

  sys.unraisablehook = passed_on
  try:
    _halve_the_array_files(tmp_path, env)
    assert getattr(sys.unraisablehook, "drops_abandoned_io", False)
    gc.collect()
  finally:
    sys.unraisablehook = hook
    checkpointing.drop_abandoned_io()  # (what Orbax's threads print later is dropped, as a command drops it)
  assert [(repr(u.object)[:80], str(u.exc_value)[:200], u.err_msg) for u in unraisable] == []


def _halve_the_array_files(tmp_path, env):
  cfg = _cfg(tmp_path, "run_name=r")
  assert _save(cfg, env.variant(2)) and _save(cfg, env.variant(5))
  newest = os.path.join(checkpointing.checkpoint_dir(cfg), "5")
  sizes = set()
  for path in array_files(newest):  # (each: which of a file's bytes Orbax reads depends on the save)
    os.truncate(path, os.path.getsize(path) // 2)
    sizes.add(os.path.getsize(path))

  start = _start(cfg, env)
  assert_trees_equal(start.state, env.variant(2))
  [skipped] = start.skipped
  pattern = (
    rf'checkpoint {re.escape(newest)} is damaged: its array (\S+) cannot be read from local file "{re.escape(newest)}/'
    rf'items/": a data file is truncated or damaged \(OUT_OF_RANGE: Requested byte range \[\d+, \d+\) is not valid '
    rf"for value of size (\d+)\); set aside as {re.escape(newest)}\.damaged"
  )
  named = re.fullmatch(pattern, skipped)
  assert named, skipped
  assert int(named[2]) in sizes
  assert named[1] in {integrity.leaf_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(env.layout.abstract)}
  full = _cfg(tmp_path, "run_name=full", f"load_full_state_path={newest}.damaged/items")
  message = _one_line_error(_start, full, env)
  assert "a data file is truncated or damaged" in message and "bound method" not in message, message
