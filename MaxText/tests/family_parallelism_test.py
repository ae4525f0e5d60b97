"""Every family with a Hugging Face mapping under context parallelism and pipeline stages: the loss and every
gradient of its tiny model equal those of one device without a mesh, or the config is refused in one line.

The families come from the registry (families.FAMILIES), each one's tiny model being its first hf_example read by
its importer (family_training_test.tiny_model), so a new family is tested here without an edit. Sequences are 32
tokens, longer than every example's window (3-5) and chunk (5-8): split over 4 devices with load balance, each
device holds two pieces of 4 tokens far apart, so windows and chunks cross pieces and devices; row 0 packs two
documents then padding, so chunks and windows restart inside a piece. The pipelined stack holds every kind of layer
the family has (local and global, RoPE and NoPE), which test_the_pipelined_layers_hold_every_kind_of_layer checks
from the layers' own attention_pairs.

The reference runs the reference kernel (dot_product) on one device; the split runs use the blockwise kernel (ring,
or all_gather with attention=flash), so the comparison also holds the kernels to the reference.

Tolerances (float32 at HIGHEST matmul precision, as context_parallel_test and pipeline_test): the split runs compute
the same sums in another order (the ring merges pieces by their log-sum-exp, blocks add up partial softmaxes,
gradients of replicated weights are summed over devices), which moves each value by float32 rounding, a few 2^-23
relative per operation, compounded over a few layers and the backward pass: the loss within 1e-5 (relative), each
gradient within 1e-4 of its tensor's largest entry (a sum of cancelling terms has rounding relative to the terms,
not to the sum, so a relative bound per entry would flake on small entries). Where a tensor's terms cancel to
nothing (GPT-3's key bias, which adds the same q.b to each of a query's logits, so the softmax never sees it), its
gradient is rounding alone, some 1e-8 of the model's largest gradient: the tolerance is no less than 1e-6 of that
(8 float32 epsilons), as in family_training_test. A wrong mask (a window or chunk cut at a piece boundary, a layer
given another layer's index in the pipeline) moves the loss by 1e-3 or more.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import families, sharding
from MaxText.common_types import ConfigError
from MaxText.layers import models, pipeline
from MaxText.objectives import lm as lm_lib
from MaxText.tests.family_training_test import TRAINED, tiny_model
from MaxText.tests.helpers import config, train_batch

transformers = pytest.importorskip("transformers")

# The quick loop's family: the cheapest to compile and run (3 layers, one window on every layer, no experts), and
# one whose windows cross the devices' pieces. Every other family's cases are slow-marked, with QUICK's case of the
# same test as their fast sibling (each family's attention and layers go through the same split and schedule).
QUICK = "mistral"

LENGTH = 32
DEVICES = 4
MODEL = (f"max_target_length={LENGTH}", "override_model_config=true", "sa_block_q=8", "sa_block_kv=4")

# (family, feature): the start of the one-line refusal its config gets. Any other refusal fails the test.
REFUSED = {
  ("llama4", "pipeline"): "interleave_moe_layer_step=2 with pipeline parallelism is not supported",
}
# A variant of a refused family that must run instead: Llama 4 Scout's MoE on every layer.
INSTEAD = {("llama4", "pipeline"): ("interleave_moe_layer_step=1",)}

# How far layer kinds repeat (Gemma 3's global layer is every 6th, Llama 4's NoPE layers every few): the kinds of
# layers 0-11 are all the family has.
KIND_PERIOD = 12


def _each_family():
  """One case per family with examples; all but QUICK slow-marked (their fast sibling: QUICK's case)."""
  return [pytest.param(name, marks=[] if name == QUICK else [pytest.mark.slow]) for name in TRAINED]


def test_the_quick_family_is_registered_with_examples():
  assert QUICK in TRAINED


def _packed_batch(cfg, rows: int) -> dict:
  """train_batch with row 0 packing documents of 9 and 14 tokens, then 9 tokens of padding."""
  batch = train_batch(cfg, rows=rows)
  seg, pos = batch["inputs_segmentation"].copy(), batch["inputs_position"].copy()
  seg[0, :9], seg[0, 9:23], seg[0, 23:] = 1, 2, 0
  pos[0, 9:23] = np.arange(14)
  return {**batch, "inputs_segmentation": seg, "inputs_position": pos, "targets_segmentation": seg}


def _loss_and_grads(cfg, params, batch):
  """The summed loss_fn and its gradients, without a mesh for one device, else on the config's devices (params
  replicated there). As helpers.assert_mesh_loss_and_grads_equal, which always takes all 8 devices."""
  mesh = None if cfg.num_devices == 1 else sharding.create_mesh(cfg, jax.devices()[: cfg.num_devices])
  model = models.Transformer(cfg, mesh)
  if mesh is not None:
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  grad = jax.value_and_grad(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[0])
  return jax.jit(grad)(params, batch)


def _assert_equals_one_device(model, split, rows: int):
  """The loss and gradients of config keys `split` (on DEVICES devices) against the model on one device with the
  reference kernel and the same global batch of `rows` rows; returns the split config."""
  one = config(*model, "attention=dot_product", f"per_device_batch_size={rows}")
  cfg = config(*model, *split, f"per_device_batch_size={rows / DEVICES}", num_devices=DEVICES)
  assert cfg.global_batch_size == one.global_batch_size == rows
  batch = _packed_batch(one, rows)
  params = models.Transformer(one).init(jax.random.key(0), *models.init_inputs(1, LENGTH))["params"]
  loss1, grads1 = _loss_and_grads(one, params, batch)
  loss, grads = _loss_and_grads(cfg, params, batch)
  np.testing.assert_allclose(loss, loss1, rtol=1e-5)
  floor = 1e-6 * max(float(np.abs(np.asarray(g1)).max()) for g1 in jax.tree_util.tree_leaves(grads1))
  for (path, g), g1 in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads1), strict=True):
    tolerance = max(1e-4 * float(np.abs(np.asarray(g1)).max()), floor)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g1), atol=tolerance, rtol=0, err_msg=jax.tree_util.keystr(path))
  return cfg


def _refused(name: str, feature: str, model, split) -> bool:
  """Whether the family refuses the feature as REFUSED expects: one line naming the key and the fix. A refusal
  REFUSED does not expect fails the test with its message."""
  expected = REFUSED.get((name, feature))
  try:
    config(*model, *split, "per_device_batch_size=1", num_devices=DEVICES)
  except ConfigError as e:
    message = str(e)
    assert expected is not None, f"{name} refuses {feature}: {message}"
    assert message.startswith(expected) and "\n" not in message, message
    assert "set " in message or "choose " in message, f"the refusal names no fix: {message}"
    return True
  assert expected is None, f"{name} was expected to refuse {feature} ({expected}) but its config loads"
  return False


def _moe_keys(name: str) -> tuple[str, ...]:
  """A mixture of experts adds its load-balancing loss, a mean over the tokens (of each microbatch)."""
  return ("load_balance_loss_weight=0.01",) if families.FAMILIES[name].moe else ()


CONTEXT = {
  "ring": ("ici_context_parallelism=4", "context_parallel_strategy=ring", "context_parallel_load_balance=true"),
  "all_gather": (
    "ici_context_parallelism=4",
    "context_parallel_strategy=all_gather",
    "context_parallel_load_balance=true",
    "attention=flash",
  ),
}


@pytest.mark.parametrize("name", _each_family())
@pytest.mark.mesh
def test_context_parallelism_equals_one_device(name, tmp_path):
  """Sequences split over 4 devices (ring, load-balanced): the loss and gradients of one device."""
  model = (*tiny_model(name, tmp_path), *MODEL, *_moe_keys(name))
  if not _refused(name, "context", model, CONTEXT["ring"]):
    _assert_equals_one_device(model, CONTEXT["ring"], rows=2)


@pytest.mark.mesh
def test_context_parallelism_with_all_gather_equals_one_device(tmp_path):
  """QUICK's model with the keys and values gathered from every device (the blockwise kernel on each)."""
  _assert_equals_one_device((*tiny_model(QUICK, tmp_path), *MODEL), CONTEXT["all_gather"], rows=2)


def _pipeline_model(name: str, tmp_path) -> tuple[str, ...]:
  """The tiny model with layer stacks that split over 2 stages: first_num_dense_layers (DeepSeek's dense stack,
  which the pipeline leaves out) and the rest each rounded up to even, 4 layers at least, so that 2 stages run 2 or
  more repeats (circular) where there is no dense stack."""
  model = (*tiny_model(name, tmp_path), *MODEL, *_moe_keys(name))
  cfg = config(*model)
  dense = cfg.first_num_dense_layers + cfg.first_num_dense_layers % 2
  rest = cfg.num_decoder_layers - cfg.first_num_dense_layers
  layers = dense + max(rest + rest % 2, 4 - dense)
  return (*model, f"base_num_decoder_layers={layers}", f"first_num_dense_layers={dense}")


PIPELINE = ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2")


@pytest.mark.parametrize("name", _each_family())
@pytest.mark.mesh
def test_pipeline_stages_equal_the_model_without_pipeline(name, tmp_path):
  """2 stages x fsdp 2 (2 microbatches of 2 rows): the loss and gradients of one device without a pipeline."""
  model = _pipeline_model(name, tmp_path)
  if _refused(name, "pipeline", model, PIPELINE):
    model = (*model, *INSTEAD[(name, "pipeline")])
  cfg = _assert_equals_one_device(model, PIPELINE, rows=4)
  assert pipeline.num_stages(cfg) == 2


@pytest.mark.parametrize("name", TRAINED)
def test_the_pipelined_layers_hold_every_kind_of_layer(name, tmp_path):
  """The layers the pipeline takes attend to as many different sets of (query, key) pairs as the family's layers
  do at all (a local and a global layer, a chunked RoPE and a NoPE layer, each differ over LENGTH tokens)."""
  model = _pipeline_model(name, tmp_path)
  if (name, "pipeline") in INSTEAD:
    model = (*model, *INSTEAD[(name, "pipeline")])
  cfg = config(*model, *PIPELINE, "per_device_batch_size=1", num_devices=DEVICES)
  layer = families.FAMILIES[name].layer_class
  first = cfg.num_decoder_layers - cfg.pipeline_parallel_layers
  pipelined = {layer.attention_pairs(cfg, i, LENGTH) for i in range(first, cfg.num_decoder_layers)}
  assert pipelined == {layer.attention_pairs(cfg, i, LENGTH) for i in range(first, first + KIND_PERIOD)}
