"""Sharding: the same losses on every mesh, logical rules as the only place mesh axes are named."""

import glob
import os
import re

import jax
import numpy as np
import pytest

from MaxText import common_types, pyconfig, sharding, train
from MaxText.tests.helpers import config

MESHES = {
  "data=8": ("ici_data_parallelism=8", "ici_fsdp_parallelism=1"),
  "fsdp=8": ("ici_fsdp_parallelism=8",),
  "fsdp=4,tensor=2": ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
  "fsdp=2,sequence=2,tensor=2": ("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2"),
  "fsdp=2,context=2,tensor=2 ring": (
    "ici_fsdp_parallelism=2",
    "ici_context_parallelism=2",
    "ici_tensor_parallelism=2",
    "context_parallel_strategy=ring",
  ),
}
COMMON = ("steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "base_output_directory=/tmp/unused")


def _losses(cfg, devices):
  return np.array([loss for _, loss in train.train(cfg, devices).losses])


@pytest.fixture(scope="module")
def single_device_losses():
  cfg = config(*COMMON, "per_device_batch_size=8", num_devices=1)
  return _losses(cfg, jax.devices()[:1])


# The ring (context parallelism's collective-permute) is slow-marked: context_parallel_test's ring case is its sibling.
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=[pytest.mark.slow] if "ring" in m else []) for m in MESHES])
@pytest.mark.mesh
def test_losses_do_not_depend_on_the_mesh(mesh, single_device_losses):
  """Three steps of the tiny float32 model: the same global batch gives the same losses (rel 1e-5)."""
  cfg = config(*COMMON, *MESHES[mesh], "per_device_batch_size=1", num_devices=8)
  assert cfg.global_batch_size == 8
  losses = _losses(cfg, jax.devices())
  assert len(losses) == 3 and len(set(losses.tolist())) == 3
  np.testing.assert_allclose(losses, single_device_losses, rtol=1e-5)


@pytest.mark.mesh
def test_params_are_created_sharded():
  """Under fsdp=4 x tensor=2 each device holds 1/8 of a 2-D MLP kernel, never the whole array."""
  from MaxText import optimizers
  from MaxText import state as state_lib
  from MaxText.layers import models

  cfg = config(*MESHES["fsdp=4,tensor=2"], "per_device_batch_size=1", num_devices=8)
  mesh = sharding.create_mesh(cfg)
  model = models.Transformer(cfg, mesh)
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))
  layout = state_lib.state_layout(model, cfg, tx, mesh)
  state = state_lib.init_state(model, cfg, tx, layout)
  kernel = state.params["layers"]["mlp"]["wi_0"]["kernel"]  # [layers, embed, mlp]
  assert kernel.sharding.spec == jax.sharding.PartitionSpec("stage", ("fsdp", "sequence", "context", "expert"), "tensor")
  shard = kernel.addressable_shards[0].data
  assert shard.shape == (kernel.shape[0], kernel.shape[1] // 4, kernel.shape[2] // 2)
  mu = state.opt_state[1][0].mu["layers"]["mlp"]["wi_0"]["kernel"]
  assert mu.sharding == kernel.sharding


def test_every_logical_name_has_a_rule():
  cfg = config()
  assert sharding.missing_rules(cfg) == []
  broken = cfg.replace(logical_axis_rules=tuple(r for r in cfg.logical_axis_rules if r[0] != "mlp"))
  assert sharding.missing_rules(broken) == ["mlp"]


def test_layers_name_no_mesh_axes():
  """Mesh axes appear only in base.yml's logical_axis_rules: a raw mesh-axis string in layers/ fails. Remat names
  (checkpoint_name, and "context" in models.REMAT_POLICIES) are not mesh axes."""
  axes = set(pyconfig.PARALLELISM_AXES.values())
  layer_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "layers")
  for path in glob.glob(os.path.join(layer_dir, "*.py")):
    with open(path, encoding="utf-8") as f:
      text = re.sub(r"checkpoint_name\([^)]*\)|_save_only\(\"context\"\)", "", f.read())
      strings = set(re.findall(r"[\"']([a-z_]+)[\"']", text))
    assert not strings & axes, f"{path} names mesh axes {strings & axes}"


def test_model_uses_only_declared_logical_names():
  from flax import linen as nn

  from MaxText.layers import models

  cfg = config()
  model = models.Transformer(cfg)
  boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *models.init_inputs(1, 8)))
  names = {n for spec in jax.tree_util.tree_leaves(nn.get_partition_spec(boxed)) for n in spec if n}
  assert names <= set(common_types.PARAM_AXES), names - set(common_types.PARAM_AXES)
