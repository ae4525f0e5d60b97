"""The train state: its abstract layout against the state actually created, and initialisation against a plain
single-device init."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import linen as nn

from MaxText import optimizers, sharding
from MaxText import state as state_lib
from MaxText.layers import models
from MaxText.tests.helpers import assert_trees_equal, config

MESH = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")


@dataclasses.dataclass(frozen=True)
class Setup:
  cfg: object
  mesh: object
  model: object
  tx: object
  layout: state_lib.StateLayout
  state: state_lib.TrainState  # init_state's, seed 0


@pytest.fixture(scope="module")
def seed0() -> Setup:
  cfg = config(*MESH, "init_weights_seed=0", num_devices=4)
  mesh = sharding.create_mesh(cfg, jax.devices()[:4])
  model = models.Transformer(cfg, mesh)
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))
  layout = state_lib.state_layout(model, cfg, tx, mesh)
  return Setup(cfg, mesh, model, tx, layout, state_lib.init_state(model, cfg, tx, layout))


def _plain_params(cfg, seeds):
  """The params of a jitted init on one device with no mesh and no out_shardings (another code path), per seed."""
  model = models.Transformer(cfg)
  init = jax.jit(lambda k: model.init({"params": k, "dropout": k}, *models.init_inputs(1, cfg.max_target_length)))
  with jax.default_device(jax.devices()[0]):
    return [jax.device_get(nn.meta.unbox(init(jax.random.key(seed)))["params"]) for seed in seeds]


@pytest.mark.mesh
def test_state_layout_is_the_created_state(seed0):
  """Every leaf of init_state's state (fsdp=2 x tensor=2) has the shape, dtype and sharding state_layout computed
  abstractly, and the mesh really splits the big arrays (an MLP kernel is held in quarters)."""
  mesh, layout, state = seed0.mesh, seed0.layout, seed0.state
  assert jax.tree_util.tree_structure(layout.abstract) == jax.tree_util.tree_structure(state)
  assert jax.tree_util.tree_structure(layout.shardings) == jax.tree_util.tree_structure(state)
  leaves = zip(
    jax.tree_util.tree_leaves_with_path(state),
    jax.tree_util.tree_leaves(layout.abstract),
    jax.tree_util.tree_leaves(layout.shardings),
    strict=True,
  )
  for (path, array), abstract, want_sharding in leaves:
    name = jax.tree_util.keystr(path)
    assert (array.shape, array.dtype) == (abstract.shape, abstract.dtype), name
    assert array.sharding == abstract.sharding == want_sharding, name
    assert array.sharding.mesh == mesh, name
  kernel = state.params["layers"]["mlp"]["wi_0"]["kernel"]  # [layers, embed, mlp]
  assert {s.data.shape for s in kernel.addressable_shards} == {(kernel.shape[0], kernel.shape[1] // 2, kernel.shape[2] // 2)}


@pytest.mark.mesh
def test_params_layout_agrees_with_state_layout(seed0):
  layout = seed0.layout
  abstract, shardings = state_lib.params_layout(seed0.model, seed0.cfg, seed0.mesh)
  assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure(layout.abstract.params)
  for (path, a), b, s, t in zip(
    jax.tree_util.tree_leaves_with_path(abstract),
    jax.tree_util.tree_leaves(layout.abstract.params),
    jax.tree_util.tree_leaves(shardings),
    jax.tree_util.tree_leaves(layout.shardings.params),
    strict=True,
  ):
    name = jax.tree_util.keystr(path)
    assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding), name
    assert s == t == a.sharding, name


@pytest.mark.mesh
def test_init_state_is_a_function_of_the_seed(seed0):
  """The sharded init (4 devices, out_shardings, LLVM level 1 on CPU) gives bit for bit the params of a plain
  one-device init with the same seed, for seeds 0 and 1, and a fresh optimizer state; the two seeds differ in
  every random weight (norm scales start at 1 for both)."""
  cfg, tx, state0 = seed0.cfg, seed0.tx, seed0.state
  plain0, plain1 = _plain_params(cfg, (0, 1))
  assert_trees_equal(state0.params, plain0)
  assert int(state0.step) == 0
  assert_trees_equal(state0.opt_state, tx.init(plain0))

  state1 = state_lib.init_state(seed0.model, cfg.replace(init_weights_seed=1), tx, seed0.layout)
  assert_trees_equal(state1.params, plain1)
  leaves0, leaves1 = jax.tree_util.tree_leaves_with_path(state0.params), jax.tree_util.tree_leaves(state1.params)
  for (path, leaf0), leaf1 in zip(leaves0, leaves1, strict=True):
    name = jax.tree_util.keystr(path)
    a, b = np.asarray(leaf0), np.asarray(leaf1)
    if "scale" in name:
      np.testing.assert_array_equal(a, np.ones_like(a), err_msg=name)
      np.testing.assert_array_equal(b, a, err_msg=name)
    else:
      assert np.mean(a != b) > 0.99, name


@pytest.mark.mesh
def test_state_from_params_keeps_them_bit_for_bit(seed0):
  """Arbitrary host params (not an init's): kept exactly, step 0, optimizer state equal to tx.init on the host
  arrays, and every leaf placed with the layout's sharding."""
  tx, layout = seed0.tx, seed0.layout
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), layout.abstract.params)
  state = state_lib.state_from_params(params, tx, layout, seed0.cfg)
  assert int(state.step) == 0 and state.step.dtype == np.int32
  assert_trees_equal(state.params, params)
  assert_trees_equal(state.opt_state, tx.init(params))
  for array, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(layout.shardings), strict=True):
    assert array.sharding == want


@pytest.mark.mesh
def test_the_layer_order_adapter_round_trips_on_the_devices_as_its_traced_view_does():
  """A circular pipeline's state (2 stages x 4 repeats of 8 scanned layers): LayerOrder.stored then .natural give the
  arrays back bit for bit, each keeping its sharding; .stored on the devices equals the traced .store; a plain config's
  adapter hands the same arrays back."""
  from MaxText import step as step_lib

  circular = ("override_model_config=true", "base_num_decoder_layers=8", "ici_pipeline_parallelism=2")
  cfg = config(*circular, "ici_fsdp_parallelism=4", "per_device_batch_size=1", num_devices=8)
  layout = step_lib.build(cfg).layout
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), layout.abstract.params)
  params = jax.device_put(params, layout.shardings.params)
  order = state_lib.LayerOrder(cfg)
  assert order.permuted
  want = jax.device_get(params)
  traced = jax.device_get(jax.jit(order.store)(params))
  stored = order.stored(jax.tree_util.tree_map(lambda x: x.copy(), params))
  assert_trees_equal(jax.device_get(stored), traced)
  leaves = zip(jax.tree_util.tree_leaves(traced), jax.tree_util.tree_leaves(want), strict=True)
  assert not all(np.array_equal(a, b) for a, b in leaves)  # the pipelined layers moved
  back = order.natural(stored)
  assert_trees_equal(jax.device_get(back), want)
  for array, want_sharding in zip(
    jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(layout.shardings.params), strict=True
  ):
    assert array.sharding == want_sharding
  plain = state_lib.LayerOrder(config())
  assert not plain.permuted and plain.natural(params) is params and plain.stored(params) is params


def test_the_stored_layer_order_is_known_to_the_state_alone():
  """A circular pipeline's stage-major order is handled behind state.LayerOrder: no other module (the step,
  checkpointing, RL's rollouts) calls layers/pipeline.py's reorderings."""
  from MaxText.tests.helpers import source_lines_matching

  calls = source_lines_matching(
    r"\bpipeline\.(to_stored|to_natural|stores_stage_major)\b", ("MaxText/state.py", "MaxText/layers/pipeline.py")
  )
  assert not calls, calls
