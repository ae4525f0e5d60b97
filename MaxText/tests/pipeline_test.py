"""Pipeline parallelism: the same losses and gradients as the model without it, and checkpoints across layouts.

The tiny float32 model at HIGHEST precision, with 8 layers where the schedule needs them; the reference is the
same parameters and batch on one device without a mesh (no pipeline). A circular schedule's train state holds the
layers stage-major: against the plain layout permuted by the schedule's formula (written out here), at init and
through checkpoints both ways, and its compiled step moves no weights between devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import checkpointing, sharding, train
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.layers import models, pipeline
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import (
  assert_mesh_loss_and_grads_equal,
  assert_trees_equal,
  checkpoint_manager,
  config,
  train_batch,
)

EIGHT_LAYERS = ("override_model_config=true", "base_num_decoder_layers=8")
MOE = ("decoder_block=mixtral", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=48")

# name: keys. Microbatches equal to and more than the stages, circular (repeats > 1) and not, with fsdp, tensor and
# expert parallelism, scanned and unrolled layers, a remat policy, only part of the layers pipelined, mixtures of
# experts with their load-balancing loss (a mean over sequences, so the microbatches' mean is the batch's).
CASES = {
  "2 stages, fsdp 4": ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"),
  "2 stages x 4 repeats (circular), 4 microbatches, fsdp 2 x tensor 2": (
    *EIGHT_LAYERS,
    "ici_pipeline_parallelism=2",
    "ici_fsdp_parallelism=2",
    "ici_tensor_parallelism=2",
    "num_pipeline_microbatches=4",
  ),
  "4 stages x 2 layers, unrolled layers, fsdp 2": (
    *EIGHT_LAYERS,
    "ici_pipeline_parallelism=4",
    "ici_fsdp_parallelism=2",
    "num_layers_per_pipeline_stage=2",
    "num_pipeline_microbatches=4",
    "scan_layers=false",
  ),
  "4 of 8 layers in 4 stages, tensor 2, remat minimal": (
    *EIGHT_LAYERS,
    "ici_pipeline_parallelism=4",
    "ici_fsdp_parallelism=1",
    "ici_tensor_parallelism=2",
    "pipeline_parallel_layers=4",
    "remat_policy=minimal",
  ),
  "mixtral (MoE), 4 of 8 layers in 2 stages x 2 repeats, expert 2": (
    *EIGHT_LAYERS,
    *MOE,
    "load_balance_loss_weight=0.01",
    "ici_pipeline_parallelism=2",
    "ici_expert_parallelism=2",
    "ici_fsdp_parallelism=2",
    "pipeline_parallel_layers=4",
  ),
  "deepseek (dense stack, then MoE layers in 2 stages)": (
    "model_name=deepseek3-tiny",
    "override_model_config=true",
    "base_num_decoder_layers=4",
    "first_num_dense_layers=2",
    "ici_pipeline_parallelism=2",
    "ici_fsdp_parallelism=4",
  ),
}


def _model_keys(args):
  return [a for a in args if not a.startswith(("ici_", "num_pipeline", "num_layers_per", "pipeline_"))]


# Slow-marked (5-11 s each); the other layouts are their fast siblings: 2 stages (scanned, fsdp), circular
# repeats, and Mixtral's experts across stages.
SLOW_CASES = (
  "deepseek (dense stack, then MoE layers in 2 stages)",
  "4 stages x 2 layers, unrolled layers, fsdp 2",
  "4 of 8 layers in 4 stages, tensor 2, remat minimal",
)


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW_CASES else []) for n in CASES])
@pytest.mark.mesh
def test_loss_and_gradients_equal_the_model_without_pipeline(name):
  one = config(*_model_keys(CASES[name]), "per_device_batch_size=8")
  cfg = config(*CASES[name], "per_device_batch_size=1", num_devices=8)
  assert pipeline.num_stages(cfg) > 1
  batch = train_batch(one, rows=8)
  params = models.Transformer(one).init(jax.random.key(0), *models.init_inputs(1, one.max_target_length))["params"]
  assert_mesh_loss_and_grads_equal(one, cfg, params, batch, rtol=1e-6, grad_atol=1e-5)


@pytest.mark.slow  # Trains whole models four times; the loss and gradient equalities above are its fast siblings.
def test_training_resumes_across_pipeline_layouts(tmp_path, capsys):
  """4 steps saved with 4 stages (2 gradient-accumulation micro-batches), 2 more resumed without a pipeline, 2
  more with 2 stages x 2 repeats: the losses of 8 uninterrupted steps without one."""
  common = (
    *EIGHT_LAYERS,
    "per_device_batch_size=1",
    "gradient_accumulation_steps=2",
    "learning_rate=1e-2",
    "warmup_steps_fraction=0",
    "learning_rate_schedule_steps=8",
    f"base_output_directory={tmp_path}",
  )
  saving = (*common, "enable_checkpointing=true", "async_checkpointing=false", "checkpoint_period=2", "run_name=moves")
  four_stages = ("ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2")
  no_stages = ("ici_fsdp_parallelism=8",)
  two_stages = (
    "ici_pipeline_parallelism=2",
    "ici_fsdp_parallelism=2",
    "ici_tensor_parallelism=2",
    "num_pipeline_microbatches=4",
  )
  want = train.train(config(*common, *no_stages, "steps=8", "run_name=whole", num_devices=8)).losses
  got = []
  for layout, steps in ((four_stages, 4), (no_stages, 6), (two_stages, 8)):
    summary = train.train(config(*saving, *layout, f"steps={steps}", num_devices=8))
    got += summary.losses
  out = capsys.readouterr().out
  assert "Pipeline: 4 stages x 1 layers x 2 repeats (8 pipelined layers), 4 microbatches; bubble 27.3%" in out
  assert "Pipeline: 2 stages x 1 layers x 4 repeats (8 pipelined layers), 4 microbatches; bubble 5.9%" in out
  assert [step for step, _ in got] == [step for step, _ in want]
  np.testing.assert_allclose([loss for _, loss in got], [loss for _, loss in want], rtol=1e-5)


@pytest.mark.parametrize(
  "args,message",
  [
    (
      ("ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=3"),
      r"the 8 pipelined layers .* must be 4 stages .* x num_layers_per_pipeline_stage=3 x num_pipeline_repeats=-1",
    ),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"), "num_pipeline_microbatches=3 must be a multiple"),
    (("ici_pipeline_parallelism=2", "num_pipeline_microbatches=16"), "which num_pipeline_microbatches=16 does not"),
    (("ici_pipeline_parallelism=2", "pipeline_parallel_layers=9"), "pipeline_parallel_layers=9: the pipeline takes 1"),
    (("ici_pipeline_parallelism=8", "pipeline_parallel_layers=4"), r"the 4 pipelined layers .* must be 8 stages"),
  ],
)
def test_schedules_that_do_not_fit_are_refused_in_one_line(args, message):
  with pytest.raises(ConfigError, match=message):
    config(*EIGHT_LAYERS, "per_device_batch_size=1", *args, num_devices=8)


def test_bubble_fraction():
  cfg = config(*EIGHT_LAYERS, "ici_pipeline_parallelism=4", "num_layers_per_pipeline_stage=2", num_devices=8)
  assert (cfg.num_pipeline_repeats, cfg.num_pipeline_microbatches) == (1, 4)
  assert pipeline.bubble_fraction(cfg) == 3 / 7


@pytest.mark.parametrize("i", [0, 2, None])
def test_one_hot_pick_and_put_equal_indexing_with_their_gradients(i):
  """The buffer's and the repeats' selection (custom VJPs) against a[i] and a.at[i].set(row); None: no slot set."""
  a = jax.random.normal(jax.random.key(0), (3, 4, 5))
  row = jax.random.normal(jax.random.key(1), (4, 5))
  weights = jax.random.normal(jax.random.key(2), (3, 4, 5))
  one_hot = jnp.arange(3) == (-1 if i is None else i)

  def put(a, row):
    return jnp.sum(jnp.sin(pipeline._put(a, row, one_hot)) * weights)

  def put_reference(a, row):
    return jnp.sum(jnp.sin(a if i is None else a.at[i].set(row)) * weights)

  np.testing.assert_array_equal(put(a, row), put_reference(a, row))
  for got, want in zip(jax.grad(put, (0, 1))(a, row), jax.grad(put_reference, (0, 1))(a, row), strict=True):
    np.testing.assert_array_equal(got, want)
  if i is not None:
    np.testing.assert_array_equal(pipeline._pick(a, one_hot), a[i])
    got = jax.grad(lambda a: jnp.sum(jnp.sin(pipeline._pick(a, one_hot)) * weights[0]))(a)
    np.testing.assert_array_equal(got, jax.grad(lambda a: jnp.sum(jnp.sin(a[i]) * weights[0]))(a))


@pytest.mark.mesh
def test_iterations_checkpointed_in_chunks_give_the_same_loss_and_gradients(monkeypatch):
  """The 9 iterations (2 stages x 2 repeats x 4 microbatches, with Mixtral's sown load-balancing loss)
  rematerialised in 3 chunks of 3 against each iteration's stage its own checkpoint, as iterations_per_checkpoint
  chooses for this small schedule: the loss bit for bit; the gradients to the rounding of their sum over the
  iterations, which the chunks add up in another order (each chunk's sum, then the chunks'), a few units in the
  last place of the largest entry."""
  args = (*CASES["mixtral (MoE), 4 of 8 layers in 2 stages x 2 repeats, expert 2"], "num_pipeline_microbatches=4")
  cfg = config(*args, "per_device_batch_size=2", num_devices=8)
  assert pipeline.iterations_per_checkpoint(cfg, 9, 0.0) == 1
  one = config(*_model_keys(args), "per_device_batch_size=16")
  batch = train_batch(one, rows=16)
  params = models.Transformer(one).init(jax.random.key(0), *models.init_inputs(1, one.max_target_length))["params"]
  mesh = sharding.create_mesh(cfg, jax.devices())
  params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  model = models.Transformer(cfg, mesh)

  def loss_and_grads():
    grad = jax.value_and_grad(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[0])
    return jax.device_get(jax.jit(grad)(params, batch))

  want = loss_and_grads()
  asked = []
  monkeypatch.setattr(
    pipeline, "iterations_per_checkpoint", lambda config, iterations, weight_units: asked.append(iterations) or 3
  )
  loss, grads = loss_and_grads()
  assert asked == [9]
  np.testing.assert_array_equal(loss, want[0])
  for (path, got), expected in zip(
    jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(want[1]), strict=True
  ):
    ulp = np.finfo(np.float32).eps * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * ulp, err_msg=jax.tree_util.keystr(path))


# 2 stages x 4 repeats of one layer (circular), and the same model and devices without a pipeline.
CIRCULAR = (*EIGHT_LAYERS, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
PLAIN = (*EIGHT_LAYERS, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")


def _stage_major(natural: np.ndarray, stages: int, repeats: int, per_stage: int) -> np.ndarray:
  """The reference: stage s's layers in its order (repeat r, then layer j of the stage: the model's layer
  (r * stages + s) * per_stage + j) as the contiguous block s."""
  order = [(r * stages + s) * per_stage + j for s in range(stages) for r in range(repeats) for j in range(per_stage)]
  return natural[np.array(order)]


def _circular_tree(natural, cfg):
  """A train state (or params) of the plain layout as a circular run of `cfg` must hold it: every leaf of the
  `layers` stack (params and the optimizer's moments alike), [8, ...], stage-major; the others as they are."""
  s, r, lps = pipeline.num_stages(cfg), cfg.num_pipeline_repeats, cfg.num_layers_per_pipeline_stage

  def leaf(path, x):
    x = np.asarray(x)
    in_stack = "['layers']" in jax.tree_util.keystr(path) and x.ndim > 0 and x.shape[0] == 8
    return _stage_major(x, s, r, lps) if in_stack else x

  return jax.tree_util.tree_map_with_path(leaf, natural)


@pytest.mark.mesh
def test_circular_init_is_the_plain_init_stage_major():
  """Bit for bit: the pipelined run starts from the values a plain run does (so their losses agree)."""
  trees = []
  for args in (CIRCULAR, PLAIN):
    cfg = config(*args, "per_device_batch_size=1", num_devices=8)
    parts = step_lib.build(cfg)
    trees.append((cfg, state_lib.init_state(parts.model, cfg, parts.tx, parts.layout).params))
  (circular_cfg, circular), (_, plain) = trees
  assert (pipeline.num_stages(circular_cfg), circular_cfg.num_pipeline_repeats) == (2, 4)
  assert_trees_equal(jax.device_get(circular), _circular_tree(plain, circular_cfg))


@pytest.mark.parametrize(
  "args",
  [
    pytest.param(CIRCULAR, id="8 layers in 2 stages x 4 repeats"),
    pytest.param((*CIRCULAR, "pipeline_parallel_layers=4"), id="4 of 8 layers in 2 stages x 2 repeats"),
    pytest.param((*CIRCULAR, "num_layers_per_pipeline_stage=2"), id="2 stages x 2 layers x 2 repeats"),
  ],
)
def test_the_stored_order_of_every_leaf_of_the_stack(args):
  """to_stored on params and on optimizer-like states around them (Adam's moments in a tuple, Muon's under a
  label, Adafactor's [1] placeholders, a count): the stack's leaves stage-major by the reference (the pipelined
  layers only; the rest of the stack after them as it was), the others untouched; to_natural undoes it."""
  cfg = config(*args, "per_device_batch_size=1", num_devices=8)
  s, r, lps, n = (
    pipeline.num_stages(cfg),
    cfg.num_pipeline_repeats,
    cfg.num_layers_per_pipeline_stage,
    cfg.pipeline_parallel_layers,
  )
  rng = np.random.default_rng(0)
  params = {
    "layers": {"mlp": {"wo": rng.standard_normal((8, 3, 2), np.float32)}, "norm": rng.standard_normal((8, 3), np.float32)}
  }
  params["token_embedder"] = {"embedding": rng.standard_normal((8, 3), np.float32)}  # leading 8, but not of the stack
  tree = {"params": params, "opt": ((np.int32(2), params, params), {"muon": {"mu": params}}, {"layers": np.ones(1)})}

  def want_leaf(path, x):
    if not jax.tree_util.keystr(path).endswith(("['layers']['mlp']['wo']", "['layers']['norm']")):
      return x
    return np.concatenate([_stage_major(x[:n], s, r, lps), x[n:]])

  stored = pipeline.to_stored(cfg, tree)
  assert_trees_equal(jax.device_get(stored), jax.tree_util.tree_map_with_path(want_leaf, tree))
  assert_trees_equal(jax.device_get(pipeline.to_natural(cfg, stored)), tree)


@pytest.mark.mesh
def test_checkpoints_move_between_circular_and_plain_layouts(tmp_path):
  """A plain run's checkpoint (random params and optimizer state, distinct in every layer) restores into a
  circular run stage-major; the circular run's next checkpoint restores into the plain run as the same state."""
  common = (f"base_output_directory={tmp_path}", "run_name=moves", "enable_checkpointing=true", "per_device_batch_size=1")
  common += ("async_checkpointing=false",)
  plain_cfg, circular_cfg = (config(*args, *common, num_devices=8) for args in (PLAIN, CIRCULAR))
  plain, circular = step_lib.build(plain_cfg), step_lib.build(circular_cfg)
  rng = np.random.default_rng(0)

  def random(a):
    if np.issubdtype(a.dtype, np.floating):
      return rng.standard_normal(a.shape).astype(a.dtype)
    return rng.integers(0, 100, a.shape).astype(a.dtype)

  saved = jax.device_put(jax.tree_util.tree_map(random, plain.layout.abstract), plain.layout.shardings)
  step = lambda k: jax.device_put(jnp.int32(k), plain.layout.shardings.step)  # noqa: E731
  saved = saved.replace(step=step(3))
  with checkpoint_manager(plain_cfg) as manager:
    assert checkpointing.save(manager, saved, config=plain_cfg)
  with checkpoint_manager(circular_cfg) as manager:
    restored = checkpointing.restore_or_init(circular_cfg, manager, circular.model, circular.tx, circular.layout).state
  assert_trees_equal(jax.device_get(restored), _circular_tree(saved, circular_cfg))
  for array, want in zip(
    jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(circular.layout.shardings), strict=True
  ):
    assert array.sharding == want

  with checkpoint_manager(circular_cfg) as manager:
    assert checkpointing.save(manager, restored.replace(step=step(4)), config=circular_cfg)
  with checkpoint_manager(plain_cfg) as manager:
    back = checkpointing.restore_or_init(plain_cfg, manager, plain.model, plain.tx, plain.layout).state
  assert_trees_equal(jax.device_get(back), jax.device_get(saved.replace(step=step(4))))


def _all_to_alls(cfg) -> int:
  """All-to-all instructions in the compiled train step of `cfg`: the collective by which XLA re-lays a stacked
  weight out over the stage axis."""
  parts = step_lib.build(cfg)
  jitted = step_lib.jit_train_step(
    cfg, parts.mesh, model=parts.model, schedule=parts.schedule, tx=parts.tx, layout=parts.layout
  )
  return jitted.lower().compile().as_text().count(" all-to-all(")


@pytest.mark.mesh
def test_the_circular_step_moves_no_weights():
  """The circular step (2 stages x 4 repeats) has the all-to-alls of one repeat (2 stages x 4 layers, the same
  model and mesh): the embedding's, none re-laying out a weight."""
  circular, one_repeat = _circular_and_one_repeat()
  assert _all_to_alls(circular) == _all_to_alls(one_repeat)


@pytest.mark.slow  # Two more compiles; the check above is the fast sibling.
def test_the_weights_move_in_a_circular_step_over_the_natural_order(monkeypatch):
  """The check above can fail: with the state in the natural order, as before it was stored stage-major, the
  circular step re-lays the weights out (more all-to-alls than one repeat)."""
  circular, one_repeat = _circular_and_one_repeat()
  monkeypatch.setattr(pipeline, "stores_stage_major", lambda config: False)
  assert _all_to_alls(circular) > _all_to_alls(one_repeat)


def _circular_and_one_repeat():
  circular = config(*CIRCULAR, "per_device_batch_size=1", num_devices=8)
  one_repeat = config(*CIRCULAR, "per_device_batch_size=1", "num_layers_per_pipeline_stage=4", num_devices=8)
  assert (circular.num_pipeline_repeats, one_repeat.num_pipeline_repeats) == (4, 1)
  return circular, one_repeat
