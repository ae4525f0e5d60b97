"""Pipeline parallelism: the same losses and gradients as the model without it, and checkpoints across layouts.

The tiny float32 model at HIGHEST precision, with 8 layers where the schedule needs them; the reference is the
same parameters and batch on one device without a mesh (no pipeline).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import train
from MaxText.common_types import ConfigError
from MaxText.layers import models, pipeline
from MaxText.tests.helpers import assert_mesh_loss_and_grads_equal, config, train_batch

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
