"""The step: `train_step` and `eval_step`, top to bottom, and how they are jitted and compiled.

The loss is the training objective's (MaxText/objectives/: language modelling, SFT, DPO, RL); the step adds up its
gradients over micro-batches, applies the optimizer and reports the metrics. train.py runs this step in its loop;
train_compile.py compiles the same step (the same function, shardings and compiler options) for a TPU slice that is
not here, and train.py can load what it wrote (compiled_step.py).
"""

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from MaxText import cli, compiled_step, lora, objectives, optimizers, sharding
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.layers import models, quantizations


# ---------------------------------------------------------------------------------------------- MoE routing
def update_routing_bias(params: dict, counts: dict[tuple[str, ...], jax.Array], rate: float) -> dict:
  """DeepSeek-V3's auxiliary-loss-free balancing (arXiv:2412.19437, sec. 2.1.2), after the optimizer's update:
  each MoE block's routing bias moves by `rate` towards balance, + for an expert with fewer assignments than the
  mean over its experts this step, - for one with more (rate * sign(mean - count), as MaxText and Megatron-LM)."""
  flat = dict(traverse_util.flatten_dict(params))
  for path, count in counts.items():
    load = count.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
    bias = flat[(*path, "gate_bias")]
    flat[(*path, "gate_bias")] = (bias + step).astype(bias.dtype)
  return traverse_util.unflatten_dict(flat)


# ---------------------------------------------------------------------------------------------- the step
def train_step(model, config: Config, tx, schedule, state: state_lib.TrainState, batch, num_tokens=None):  # noqa: PLR0913
  """One optimizer step over the global batch, split into gradient_accumulation_steps micro-batches.

  Gradients of the objective's summed loss are added over micro-batches and divided once by its total weight (target
  tokens; DPO: pairs; RL: loss_agg_mode's denominator), so k micro-batches of b rows give the same update as one batch
  of k*b rows. num_tokens: the vocabulary the objective's loss reads (objectives.base.Objective.vocabulary).
  """
  objective = objectives.get(config)
  dropout_rng = jax.random.fold_in(jax.random.key(config.init_weights_seed), state.step)
  # The state holds a circular pipeline's layers stage-major; the model takes them in the natural order, through
  # the state's one adapter (state.LayerOrder): a view XLA folds into the pipeline's own (pipeline_test compiles the
  # step to check that no data moves).
  order = state_lib.LayerOrder(config)
  loss = functools.partial(
    objective.loss, model, reference_params=order.view(state.reference_params), step=state.step, num_tokens=num_tokens
  )
  # Gradients of the trainable parameters only: under LoRA the adapters, the frozen base a constant.
  trainable = state_lib.trainable(config, state.params)
  _, frozen = lora.partition(state.params) if config.lora_rank > 0 else (None, None)

  def full(p):
    return p if frozen is None else lora.combine(p, frozen)

  grad_fn = jax.value_and_grad(lambda p, b, r: loss(params=order.view(full(p)), batch=b, dropout_rng=r), has_aux=True)
  k = config.gradient_accumulation_steps
  if k == 1:
    (loss_sum, aux), grads = grad_fn(trainable, batch, dropout_rng)
  else:
    # Row r of the global batch goes to micro-batch r % k: each device keeps its own rows.
    micro = jax.tree_util.tree_map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), batch)

    def accumulate(carry, i_and_batch):
      i, micro_batch = i_and_batch
      (loss_i, aux_i), grads_i = grad_fn(trainable, micro_batch, jax.random.fold_in(dropout_rng, i))
      loss_sum, aux, grads = carry
      grads = jax.tree_util.tree_map(lambda g, gi: g + gi.astype(jnp.float32), grads, grads_i)
      return (loss_sum + loss_i, jax.tree_util.tree_map(jnp.add, aux, aux_i), grads), None

    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    aux_shapes = jax.eval_shape(
      lambda p, b: loss(params=order.view(p), batch=b, dropout_rng=dropout_rng)[1], state.params, first
    )
    aux_zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)
    init = (jnp.zeros((), jnp.float32), aux_zeros, zeros)
    (loss_sum, aux, grads), _ = jax.lax.scan(accumulate, init, (jnp.arange(k), micro))

  weight = aux["tokens"]
  denominator = jnp.maximum(weight, 1).astype(jnp.float32)
  grads = jax.tree_util.tree_map(lambda g, p: (g / denominator).astype(p.dtype), grads, trainable)
  updates, opt_state = tx.update(grads, state.opt_state, trainable)
  params = full(optax.apply_updates(trainable, updates))
  if "moe_expert_counts" in aux:  # summed over the micro-batches: the step's whole batch
    bias = update_routing_bias(order.view(params), aux["moe_expert_counts"], config.routed_bias_update_rate)
    params = order.store(bias)  # (the counts are per layer in the natural order)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  step_metrics = {
    "learning/loss": loss_sum / denominator,
    "learning/grad_norm": optax.tree.norm(grads),
    "learning/param_norm": optax.tree.norm(new_state.params),
    "learning/current_learning_rate": schedule(state.step),
    "learning/total_weights": weight,
  }
  if "moe_lb_loss" in aux:
    step_metrics["learning/moe_lb_loss"] = aux["moe_lb_loss"] / denominator
  if "moe_dropped" in aux:
    step_metrics["learning/moe_dropped_tokens"] = aux["moe_dropped"]
  return new_state, step_metrics | objective.step_metrics(aux, denominator)


def eval_step(model, params, reference_params, batch):
  """(summed float32 loss, its weight, {metric: sum}) of one eval batch, no dropout: the objective's eval_loss (the
  cross-entropy and its tokens; DPO: its loss, pairs and metrics)."""
  return objectives.get(model.config).eval_loss(model, params, reference_params, batch)


# ---------------------------------------------------------------------------------------------- compiling it
class Parts(NamedTuple):
  """What a run's step is built from; train.py and train_compile.py build the same step from the same parts. A named
  tuple: callers unpack it (`mesh, model, schedule, tx, layout = build(...)`) or name the field they need."""

  mesh: jax.sharding.Mesh
  model: models.Transformer
  schedule: optax.Schedule
  tx: optax.GradientTransformation
  layout: state_lib.StateLayout


def build(config: Config, devices=None) -> Parts:
  """The mesh, model, learning-rate schedule, optimizer and state layout of a run on `devices` (default: all)."""
  mesh = sharding.create_mesh(config, devices)
  missing = sharding.missing_rules(config)
  if missing:
    raise ConfigError(f"logical_axis_rules has no rule for {missing}; add [name, [mesh axes]] entries for them")
  if quantizations.is_weight_only(config):
    raise ConfigError(
      f"quantization={config.quantization} quantizes weights for inference (decode.py, serve.py); train with "
      "int8, fp8 or fp8_full, or without quantization"
    )
  objective = objectives.get(config)
  if config.quantize_kvcache and not objective.decodes:  # RL's rollouts decode through the engine, whose cache it is
    raise ConfigError(
      "quantize_kvcache=true quantizes the KV cache of decoding (decode.py, serve.py, RL rollouts); a training step "
      "keeps none, so it would do nothing here: drop it"
    )
  quantizations.check_devices(config, mesh.devices.flat[0])
  model = quantizations.quantize_model(models.Transformer(config, mesh), config)
  if config.lora_rank > 0 and not jax.tree_util.tree_leaves(lora.partition(state_lib.abstract_params(config))[0]):
    raise ConfigError(
      f"lora_target_modules={list(config.lora_target_modules)} names no projection of decoder_block="
      f"{config.decoder_block} (multi-head latent attention and the experts take no adapters); name others"
    )
  schedule = optimizers.learning_rate_schedule(config)
  tx = optimizers.create_optimizer(config, schedule)
  layout = state_lib.state_layout(model, config, tx, mesh, reference=objective.keeps_reference())
  return Parts(mesh, model, schedule, tx, layout)


@dataclasses.dataclass(frozen=True)
class JittedStep:
  """train_step jitted for a mesh, and the abstract arguments it is lowered for: what train.py runs and what
  train_compile.py compiles for a TPU topology."""

  fn: Callable  # jax.jit of (state, batch) -> (state, metrics), the state donated
  abstract_state: state_lib.TrainState  # ShapeDtypeStructs with shardings
  abstract_batch: dict[str, jax.ShapeDtypeStruct]  # the objective's batch keys -> [global_batch_size, max_target_length]

  def lower(self) -> jax.stages.Lowered:
    return self.fn.lower(self.abstract_state, self.abstract_batch)


def jit_train_step(  # noqa: PLR0913 (keyword-only, each named at the call)
  config: Config, mesh, *, model, schedule, tx, layout: state_lib.StateLayout, num_tokens: int | None = None
) -> JittedStep:
  """train_step with the state's and the batch's shardings on `mesh`, the state donated. num_tokens: the vocabulary
  the objective's loss reads; by default its own (RL: the tokenizer's), so train_compile.py compiles the step train.py
  runs."""
  objective = objectives.get(config)
  if num_tokens is None:
    num_tokens = objective.vocabulary()
  batch_sharding = sharding.batch_sharding(mesh, config)
  step_fn = jax.jit(
    lambda s, b: train_step(model, config, tx, schedule, s, b, num_tokens),
    in_shardings=(layout.shardings, batch_sharding),
    out_shardings=(layout.shardings, sharding.logical_sharding((), mesh, config)),
    donate_argnums=(0,),
  )
  shape = (config.global_batch_size, config.max_target_length)
  batch = {key: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for key, dtype in objective.batch_keys().items()}
  return JittedStep(step_fn, layout.abstract, batch)


def jit_eval_step(config: Config, mesh, model, layout: state_lib.StateLayout) -> Callable:
  """eval_step jitted for `mesh`: (params, reference params, batch) -> (loss sum, weight, {metric: sum}), of
  the train state's params (a circular pipeline's layers stage-major, viewed in the natural order as train_step
  does)."""
  order = state_lib.LayerOrder(config)
  return jax.jit(
    lambda p, r, b: eval_step(model, order.view(p), order.view(r), b),
    in_shardings=(layout.shardings.params, layout.shardings.reference_params, sharding.batch_sharding(mesh, config)),
    out_shardings=sharding.logical_sharding((), mesh, config),
  )


def compile_step(lowered: jax.stages.Lowered, mesh) -> jax.stages.Compiled:
  """Compiles a lowered step with the options of the mesh's platform (cli.compiler_options)."""
  return lowered.compile(cli.compiler_options(mesh))


Done = TypeVar("Done")


def compile_while(config: Config, mesh, jitted: JittedStep, work: Callable[[], Done]) -> tuple[jax.stages.Compiled, Done]:
  """(the compiled step, work()): the step compiled ahead of time on a thread of its own while `work` (restoring
  or initialising the state) runs here, or the one train_compile.py wrote to compiled_trainstep_file, loaded once
  it is checked to be this step; either way checked to fit in the devices' memory before it is returned."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    lowered = jitted.lower()  # Tracing holds the GIL: do it first, here.
    if config.compiled_trainstep_file:
      loaded = compiled_step.load(config.compiled_trainstep_file, config, mesh, lowered)  # Before any work.
      compiling = pool.submit(lambda: loaded)
    else:
      compiling = pool.submit(compile_step, lowered, mesh)
    done = work()
    return _fitting(compiling, config, mesh), done


def _fitting(compiling: concurrent.futures.Future, config: Config, mesh) -> jax.stages.Compiled:
  """The compiled step, once it is known to fit: XLA's out-of-memory verdict when compiling (TPU), or its memory
  analysis against the devices' memory (host RAM for CPU devices), is a ConfigError with the figures."""
  try:
    compiled = compiling.result()
  except jax.errors.JaxRuntimeError as e:
    needed = compiled_step.out_of_memory(e)
    if needed is None:
      raise
    raise ConfigError(compiled_step.does_not_fit_line(*needed, mesh.devices.flat[0].device_kind, config)) from None
  per_device = compiled_step.step_bytes_per_device(compiled, mesh.devices.flat[0].platform)
  if per_device is not None:
    compiled_step.check_fits("the train step (state, batch and activations)", per_device, config, mesh, step=True)
  return compiled
