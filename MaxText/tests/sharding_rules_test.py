"""The logical-to-mesh rules of sharding.py and the mesh's set-up checks, against plain-Python references."""

import types

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText import common_types, sharding
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, config

FSDP = ("fsdp", "sequence", "context", "expert")  # base.yml's mesh axes for a weight's `embed` dimension
LENGTH = ("sequence", "context")  # and for an activation's length
BATCH = ("data", "fsdp", "expert")  # and for an activation's batch dimension


def test_axis_rules_convert_each_form():
  """[] -> None (replicated), "x" -> "x", ["a", "b"] -> ("a", "b"), ["a"] -> ("a",), order kept."""
  cfg = config().replace(logical_axis_rules=(("none", ()), ("one", "x"), ("two", ("a", "b")), ("single", ("a",))))
  assert sharding.axis_rules(cfg) == (("none", None), ("one", "x"), ("two", ("a", "b")), ("single", ("a",)))


def test_axis_rules_of_base_yml():
  """The rules pyconfig parsed, converted, equal base.yml's list read directly with yaml."""
  with open(BASE_YML, encoding="utf-8") as f:
    raw = yaml.safe_load(f)["logical_axis_rules"]
  expected = tuple((name, tuple(axes) if axes else None) for name, axes in raw)
  assert sharding.axis_rules(config()) == expected


def _reference_spec(logical_axes, rules) -> P:
  """base.yml's comment on logical_axis_rules, in plain Python: for a tensor, each rule is taken in order and
  skipped if its dimension already has mesh axes or any of its mesh axes is already used; dimensions no rule
  gives mesh axes to (None, unknown names) stay replicated."""
  result = [None] * len(logical_axes)
  assigned = [False] * len(logical_axes)
  used = set()
  for name, mesh_axes in rules:
    if name not in logical_axes:
      continue
    i = logical_axes.index(name)
    wanted = set() if mesh_axes is None else {mesh_axes} if isinstance(mesh_axes, str) else set(mesh_axes)
    if assigned[i] or wanted & used:
      continue
    assigned[i], result[i] = True, mesh_axes
    used |= wanted
  return P(*result)


def test_logical_to_mesh_spec_follows_rule_order():
  """Rules are taken in their order, not the dimensions': a rule is skipped when an earlier rule gave any of its
  mesh axes to another dimension, and a later rule for the same name is the fallback."""
  rules = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp", "tensor")),
    ("embed", ("tensor",)),  # fallback when fsdp is taken
    ("mlp", ("tensor",)),
    ("heads", ("tensor",)),
    ("vocab", ()),
  )
  cfg = config().replace(logical_axis_rules=rules)
  cases = {
    ("embed", "mlp"): P(("fsdp", "tensor"), None),  # embed's first rule took tensor; mlp has no other rule
    ("mlp", "embed"): P(None, ("fsdp", "tensor")),  # the same with the dimensions swapped: rule order decides
    ("batch", "embed"): P(("data", "fsdp"), "tensor"),  # fsdp taken by batch: embed falls back to tensor
    ("batch", "embed", "mlp"): P(("data", "fsdp"), "tensor", None),
    ("heads", "batch"): P("tensor", ("data", "fsdp")),
    ("vocab", None, "unknown"): P(None, None, None),
    (): P(),
  }
  rules_converted = sharding.axis_rules(cfg)
  for logical, want in cases.items():
    got = sharding.logical_to_mesh_spec(logical, cfg)
    assert got == want, (logical, got)
    assert got == _reference_spec(logical, rules_converted), logical


def test_logical_to_mesh_spec_of_base_rules():
  """base.yml's rules on the tensors the model and the input pipeline use, against _reference_spec."""
  cfg = config()
  rules = sharding.axis_rules(cfg)
  cases = {
    (common_types.LAYERS, common_types.EMBED, common_types.MLP): P("stage", FSDP, "tensor"),
    (common_types.VOCAB, common_types.EMBED): P("tensor", FSDP),
    (common_types.BATCH, common_types.LENGTH): P(BATCH, LENGTH),
    # embed's mesh axes share fsdp and expert with the batch rule, which comes first: embed stays whole.
    (common_types.BATCH, common_types.EMBED): P(BATCH, None),
    # heads and mlp both want tensor; mlp's rule comes first in base.yml.
    (common_types.HEADS, common_types.MLP): P(None, "tensor"),
    (common_types.NORM,): P(None),
  }
  for logical, want in cases.items():
    got = sharding.logical_to_mesh_spec(logical, cfg)
    assert got == want == _reference_spec(logical, rules), (logical, got)


@pytest.fixture(scope="module")
def mesh_and_config():
  cfg = config("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2", num_devices=8)
  return sharding.create_mesh(cfg), cfg


@pytest.mark.mesh
def test_logical_sharding_and_tree_shardings(mesh_and_config):
  mesh, cfg = mesh_and_config
  got = sharding.logical_sharding(("embed", "mlp"), mesh, cfg)
  assert got == NamedSharding(mesh, P(FSDP, "tensor"))
  tree = {"kernel": P("layers", "embed", "vocab"), "norm": {"scale": P("norm")}, "step": P()}
  shardings = sharding.tree_shardings(tree, mesh, cfg)
  assert shardings == {
    "kernel": NamedSharding(mesh, P("stage", FSDP, "tensor")),
    "norm": {"scale": NamedSharding(mesh, P(None))},
    "step": NamedSharding(mesh, P()),
  }
  # Each one is what logical_sharding gives for its leaf alone.
  assert shardings["kernel"] == sharding.logical_sharding(("layers", "embed", "vocab"), mesh, cfg)


@pytest.mark.mesh
def test_batch_sharding_splits_rows_and_length(mesh_and_config):
  """[batch, length] inputs: rows over data x fsdp x expert (2 here), length over sequence (2), tensor replicated."""
  mesh, cfg = mesh_and_config
  batch = sharding.batch_sharding(mesh, cfg)
  assert batch == NamedSharding(mesh, P(BATCH, LENGTH))
  assert batch.shard_shape((8, 64)) == (4, 32)


@pytest.mark.parametrize("mesh", [("ici_data_parallelism=8", "ici_fsdp_parallelism=1"), ("ici_fsdp_parallelism=8",)])
@pytest.mark.mesh
def test_local_rows_on_one_process_are_all_rows(mesh):
  """A batch of 16 rows sharded 8 ways over 8 devices of this one process: the process holds rows 0..16, and those
  rows make the global array, equal to the numpy batch."""
  cfg = config(*mesh, num_devices=8)
  mesh = sharding.create_mesh(cfg)
  batch = sharding.batch_sharding(mesh, cfg)
  assert batch.shard_shape((16, 64)) == (2, 64)  # really sharded 8 ways
  rows = sharding.local_rows(batch, (16, 64))
  assert (rows.start, rows.stop) == (0, 16)
  data = np.arange(16 * 64, dtype=np.int32).reshape(16, 64)
  array = sharding.make_global_array(data[rows], batch, (16, 64))
  np.testing.assert_array_equal(np.asarray(array), data)
  assert array.sharding == batch


def test_count_slices():
  assert sharding.count_slices(jax.devices()) == 1  # 8 CPU devices of one process
  fake = types.SimpleNamespace
  # TPUs: one slice per slice_index, whatever the processes.
  tpus = [fake(platform="tpu", slice_index=i // 4, process_index=i // 2) for i in range(8)]
  assert sharding.count_slices(tpus) == 2
  # CPUs and GPUs of a multi-process job: one granule per process.
  gpus = [fake(platform="gpu", process_index=i // 2) for i in range(8)]
  assert sharding.count_slices(gpus) == 4


@pytest.mark.mesh
def test_create_mesh_needs_the_configured_device_count():
  cfg = config("ici_fsdp_parallelism=4", num_devices=4)
  with pytest.raises(ConfigError) as e:
    sharding.create_mesh(cfg)  # all 8 devices
  assert "4 devices" in str(e.value) and "8 are present" in str(e.value)
  mesh = sharding.create_mesh(cfg, jax.devices()[:4])
  assert mesh.axis_names == tuple(cfg.mesh_axes)
  assert mesh.devices.shape == tuple(cfg.ici_mesh_shape)
  assert set(mesh.devices.flat) == set(jax.devices()[:4])
