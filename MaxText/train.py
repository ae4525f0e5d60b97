"""Training: `python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME [key=value ...]`.

The loss, the train step and the loop, top to bottom. Set-up lives in cli, pyconfig, sharding, state,
checkpointing, input_pipeline and metrics.
"""

import time

_PROCESS_START = time.time()

import concurrent.futures  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from typing import Any  # noqa: E402

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import tqdm  # noqa: E402
import yaml  # noqa: E402
from flax import traverse_util  # noqa: E402

from MaxText import checkpointing, cli, compiled_step, input_pipeline, lora, metrics, optimizers, pyconfig, sharding, storage  # noqa: E402
from MaxText import state as state_lib  # noqa: E402
from MaxText.cli import TrainingError  # noqa: E402
from MaxText.common_types import Config, ConfigError  # noqa: E402
from MaxText.layers import models, pipeline  # noqa: E402


# ---------------------------------------------------------------------------------------------- the math
def loss_fn(model, params, batch, dropout_rng, deterministic=False):
  """Summed float32 loss over non-padding targets, and aux: {"tokens": their number, "xent": the summed
  cross-entropy, and for mixture-of-experts models "moe_lb_loss": the summed load-balancing loss, with
  capacity_factor > 0 "moe_dropped": the assignments the experts' capacity dropped, and with
  routed_bias_update_rate > 0 "moe_expert_counts": each MoE block's assignments per expert (_expert_counts)}.

  batch: inputs, inputs_segmentation, inputs_position, targets, targets_segmentation [batch, length].
  Returning sums (not means) lets micro-batches add up to exactly the full batch's loss.
  """
  config = model.config
  outputs, sown = model.apply(
    {"params": params},
    batch["inputs"],
    batch["inputs_segmentation"],
    batch["inputs_position"],
    deterministic=deterministic,
    rngs={"dropout": dropout_rng},
    return_hidden=config.num_vocab_tiling > 1,
    mutable=["intermediates"],
  )
  mask_BL = batch["targets_segmentation"] != 0
  tokens = jnp.sum(mask_BL)
  if config.num_vocab_tiling > 1:
    xent = tiled_cross_entropy(config, params, outputs, batch["targets"], mask_BL)
  else:
    xent = jnp.sum(jnp.where(mask_BL, cross_entropy(outputs, batch["targets"]), 0.0))
  aux = {"tokens": tokens, "xent": xent}
  if config.num_experts > 1:
    aux.update(_moe_aux(config, sown, tokens))
    return xent + aux["moe_lb_loss"], aux
  return xent, aux


def dpo_loss_fn(model, params, reference_params, batch, dropout_rng, deterministic=False):
  """Direct preference optimization (Rafailov et al. 2023, arXiv:2305.18290), with label smoothing (cDPO):

    d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    loss = -(1 - dpo_label_smoothing) * log sigmoid(dpo_beta * d) - dpo_label_smoothing * log sigmoid(-dpo_beta * d)

  log p(response) sums the log-probabilities of a response's target tokens (targets_segmentation != 0). The
  reference model is `reference_params` (under LoRA, None: the base, adapters off) under stop_gradient, without dropout.

  batch: BATCH_KEYS prefixed chosen_ and rejected_, packed in lockstep: segment s of chosen row r and of rejected
  row r are one pair. Returns (summed loss over pairs, aux) with aux["tokens"] the number of pairs (the step's
  denominator) and the sums of the rewards beta * (log pi - log ref) of chosen and rejected responses, of the
  margins and of the pairs the policy ranks right (loss_fn's moe_* entries too, for mixtures of experts).
  """
  config = model.config
  both = {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in input_pipeline.BATCH_KEYS}
  args = (both["inputs"], both["inputs_segmentation"], both["inputs_position"])
  logits, sown = model.apply(
    {"params": params}, *args, deterministic=deterministic, rngs={"dropout": dropout_rng}, mutable=["intermediates"]
  )
  if reference_params is None:  # LoRA: the base model, the adapters off
    reference_params = lora.adapters_off(params)
  reference_logits, _ = model.apply(
    {"params": jax.lax.stop_gradient(reference_params)}, *args, deterministic=True, mutable=["intermediates"]
  )
  loss, aux = dpo_loss_from_logits(config, logits, jax.lax.stop_gradient(reference_logits), both)
  if config.num_experts > 1:
    aux.update(_moe_aux(config, sown, aux["tokens"]))
    loss += aux["moe_lb_loss"]
  return loss, aux


def dpo_loss_from_logits(config: Config, logits, reference_logits, both) -> tuple[jax.Array, dict]:
  """dpo_loss_fn's loss and aux from the policy's and the reference's logits over `both`: the BATCH_KEYS of the
  chosen rows followed by the rejected rows."""
  policy, scored = _sequence_logps(logits, both)
  reference, _ = _sequence_logps(reference_logits, both)
  half = policy.shape[0] // 2  # chosen pairs, then rejected ones, in the same order
  rewards = config.dpo_beta * (policy - reference)
  chosen, rejected, present = rewards[:half], rewards[half:], scored[:half] & scored[half:]
  margin = chosen - rejected
  smoothing = config.dpo_label_smoothing
  losses = -(1.0 - smoothing) * jax.nn.log_sigmoid(margin) - smoothing * jax.nn.log_sigmoid(-margin)

  def total(x):
    return jnp.sum(jnp.where(present, x, 0.0))

  aux = {
    "tokens": jnp.sum(present),
    "dpo_rewards_chosen": total(chosen),
    "dpo_rewards_rejected": total(rejected),
    "dpo_reward_margin": total(margin),
    "dpo_reward_accuracy": total((margin > 0).astype(jnp.float32)),
  }
  return total(losses), aux


def _sequence_logps(logits, batch) -> tuple[jax.Array, jax.Array]:
  """(summed log-probabilities of the masked targets, whether the sequence has any), per (row, segment id) of a
  packed batch: [rows * (length + 1)] each, row r's segment s at r * (length + 1) + s."""
  rows, length = batch["targets"].shape
  logps = -cross_entropy(logits, batch["targets"])
  ids = (jnp.arange(rows)[:, None] * (length + 1) + batch["inputs_segmentation"]).ravel()
  in_loss = batch["targets_segmentation"] != 0
  sums = jax.ops.segment_sum(jnp.where(in_loss, logps, 0.0).ravel(), ids, num_segments=rows * (length + 1))
  counts = jax.ops.segment_sum(in_loss.astype(jnp.int32).ravel(), ids, num_segments=rows * (length + 1))
  return sums, counts > 0


def _moe_aux(config: Config, sown: dict, weight: jax.Array) -> dict:
  """A mixture of experts' additions to loss_fn's aux (see there); the load-balancing loss scaled by `weight`."""
  # The router's load-balancing loss is a mean over layers of a per-token mean (layers/moe.py), added to the
  # mean loss as in MaxText; scaled by the loss's weight, it adds up over micro-batches as the sum does.
  lb_loss = jnp.mean(jnp.concatenate([jnp.ravel(v) for v in _sown(sown, "moe_lb_loss")]))
  aux = {"moe_lb_loss": config.load_balance_loss_weight * lb_loss * weight.astype(jnp.float32)}
  if config.capacity_factor > 0:
    aux["moe_dropped"] = sum(jnp.sum(v) for v in _sown(sown, "moe_dropped"))
  if config.routed_bias and config.routed_bias_update_rate > 0:
    aux["moe_expert_counts"] = _expert_counts(sown)
  return aux


def _expert_counts(sown: dict) -> dict[tuple[str, ...], jax.Array]:
  """{path of an MoE block in the params: its assignments per expert, [experts] or [layers, experts] when
  scanned}, from what the blocks sowed."""
  flat = traverse_util.flatten_dict(sown["intermediates"])
  return {path[:-1]: value[0] for path, value in flat.items() if path[-1] == "moe_expert_counts"}


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


def _sown(sown: dict, name: str) -> list[jax.Array]:
  """The values layers sowed under `name` (one per layer, or stacked over scanned layers)."""
  return [v for path, v in jax.tree_util.tree_leaves_with_path(sown) if name in jax.tree_util.keystr(path)]


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token cross-entropy in float32 of logits [..., vocab] (any float dtype) and integer targets [...].

  The value of optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), targets), with its
  gradient (softmax - one-hot) written by one fused pass in the logits' dtype instead of autodiff's chain of
  float32 temporaries over [tokens, vocab], the step's largest tensor (measured in docs/PERFORMANCE.md, "Two
  simulated CPU devices").
  """
  return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
  peak = jnp.max(logits, axis=-1).astype(jnp.float32)  # Exact in any dtype.
  lse = peak + jnp.log(jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak[..., None]), axis=-1))
  label_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
  return lse - label_logit, (logits, targets, lse)


def _cross_entropy_bwd(residuals, g):
  logits, targets, lse = residuals
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  dlogits = (softmax - (vocab == targets[..., None])) * g[..., None]
  return dlogits.astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def tiled_cross_entropy(config: Config, params, hidden_BLE, targets_BL, mask_BL):
  """The summed cross-entropy of loss_fn, with the output head applied to num_vocab_tiling chunks of tokens in
  turn, each rematerialised in the backward pass, so only one chunk's [tokens, vocab] logits exist at a time.

  Chunk j holds every row's tokens j, j + n, j + 2n, ... (n = num_vocab_tiling): strided, so each device keeps
  its share of every chunk whether the batch or the length is sharded.
  """
  n = config.num_vocab_tiling
  b, length = hidden_BLE.shape[:2]

  def chunks(x):  # [batch, length, ...] -> [n, batch, length / n, ...]
    return jnp.moveaxis(x.reshape(b, length // n, n, *x.shape[2:]), 2, 0)

  head, head_params = models.OutputHead(config), models.OutputHead.params(params)

  @jax.checkpoint
  def chunk_loss(hidden, targets, mask):
    xent = cross_entropy(head.apply({"params": head_params}, hidden), targets)
    return jnp.sum(jnp.where(mask, xent, 0.0))

  def body(total, chunk):
    return total + chunk_loss(*chunk), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (chunks(hidden_BLE), chunks(targets_BL), chunks(mask_BL)))
  return total


def train_step(model, config: Config, tx, schedule, state: state_lib.TrainState, batch):
  """One optimizer step over the global batch, split into gradient_accumulation_steps micro-batches.

  Gradients of the summed loss are added over micro-batches and divided once by the total number of
  target tokens, so k micro-batches of b rows give the same update as one batch of k*b rows.
  """
  dropout_rng = jax.random.fold_in(jax.random.key(config.init_weights_seed), state.step)
  if config.use_dpo:
    loss = functools.partial(dpo_loss_fn, model, reference_params=state.reference_params)
  else:
    loss = functools.partial(loss_fn, model)
  # Gradients of the trainable parameters only: under LoRA the adapters, the frozen base a constant.
  trainable = state_lib.trainable(config, state.params)
  _, frozen = lora.partition(state.params) if config.lora_rank > 0 else (None, None)

  def full(p):
    return p if frozen is None else lora.combine(p, frozen)

  grad_fn = jax.value_and_grad(lambda p, b, r: loss(params=full(p), batch=b, dropout_rng=r), has_aux=True)
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
    aux_shapes = jax.eval_shape(lambda p, b: loss(params=p, batch=b, dropout_rng=dropout_rng)[1], state.params, first)
    aux_zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shapes)
    init = (jnp.zeros((), jnp.float32), aux_zeros, zeros)
    (loss_sum, aux, grads), _ = jax.lax.scan(accumulate, init, (jnp.arange(k), micro))

  num_tokens = aux["tokens"]
  denominator = jnp.maximum(num_tokens, 1).astype(jnp.float32)
  grads = jax.tree_util.tree_map(lambda g, p: (g / denominator).astype(p.dtype), grads, trainable)
  updates, opt_state = tx.update(grads, state.opt_state, trainable)
  params = full(optax.apply_updates(trainable, updates))
  if "moe_expert_counts" in aux:  # summed over the micro-batches: the step's whole batch
    params = update_routing_bias(params, aux["moe_expert_counts"], config.routed_bias_update_rate)
  new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
  step_metrics = {
    "learning/loss": loss_sum / denominator,
    "learning/grad_norm": optax.tree.norm(grads),
    "learning/param_norm": optax.tree.norm(new_state.params),
    "learning/current_learning_rate": schedule(state.step),
    "learning/total_weights": num_tokens,
  }
  if "moe_lb_loss" in aux:
    step_metrics["learning/moe_lb_loss"] = aux["moe_lb_loss"] / denominator
  if "moe_dropped" in aux:
    step_metrics["learning/moe_dropped_tokens"] = aux["moe_dropped"]
  for name in DPO_METRICS:
    if name in aux:  # per pair
      step_metrics[f"learning/{name}"] = aux[name] / denominator
  return new_state, step_metrics


# DPO's sums in aux that train and eval metrics report per pair.
DPO_METRICS = ("dpo_rewards_chosen", "dpo_rewards_rejected", "dpo_reward_margin", "dpo_reward_accuracy")


def eval_step(model, params, reference_params, batch):
  """(summed float32 loss, its weight: non-padding targets, or DPO's pairs, {DPO metric: sum}) of one eval batch,
  no dropout. The loss is the cross-entropy (no MoE load-balancing term), or DPO's loss."""
  if model.config.use_dpo:
    loss, aux = dpo_loss_fn(model, params, reference_params, batch, jax.random.key(0), deterministic=True)
    return loss - aux.get("moe_lb_loss", 0.0), aux["tokens"], {k: aux[k] for k in DPO_METRICS}
  _, aux = loss_fn(model, params, batch, jax.random.key(0), deterministic=True)
  return aux["xent"], aux["tokens"], {}


def evaluate(config: Config, mesh, eval_fn, state: state_lib.TrainState, *, step: int) -> dict[str, float]:
  """Mean loss per non-padding target token (DPO: per pair, with its metrics) over eval_steps batches (-1: one
  pass over the split)."""
  loss_sum, weight, sums = 0.0, 0, {}
  batches = tqdm.tqdm(  # A progress bar for an evaluation that takes over 2 s (a whole split can take minutes).
    input_pipeline.create_eval_iterator(config, mesh),
    desc=f"eval after step {step}",
    total=config.eval_steps if config.eval_steps > 0 else None,
    unit="batch",
    delay=2,
    leave=False,
    disable=jax.process_index() != 0,
  )
  for i, batch in enumerate(batches):
    if i == config.eval_steps:
      break
    batch_loss, batch_weight, batch_sums = jax.device_get(eval_fn(state.params, state.reference_params, batch))
    loss_sum, weight = loss_sum + float(batch_loss), weight + int(batch_weight)
    sums = {k: sums.get(k, 0.0) + float(v) for k, v in batch_sums.items()}
  if weight == 0:
    raise TrainingError(
      "the evaluation split gave no full batch; lower eval_per_device_batch_size or give more eval documents"
    )
  avg = loss_sum / weight
  if config.use_dpo:  # a mean DPO loss per pair: no perplexity
    return {"eval/avg_loss": avg, "eval/total_weights": weight} | {f"eval/{k}": v / weight for k, v in sums.items()}
  return {"eval/avg_loss": avg, "eval/perplexity": math.exp(min(avg, 700.0)), "eval/total_weights": weight}


# ---------------------------------------------------------------------------------------------- the loop
@dataclasses.dataclass
class TrainSummary:
  """What train() did."""

  first_step: int  # the step it started from: 0, or that of the checkpoint it resumed
  steps_run: int = 0
  losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss) of each logged step
  last_eval: dict[str, float] | None = None  # the last evaluation's scalars
  time_to_first_step: float | None = None  # seconds from process start to the end of the first step
  median_step_time: float = math.nan  # seconds, over the steps after the first
  total_tokens: int = 0  # tokens of the steps run (global batch x max_target_length each)
  peak_memory_bytes: int = 0
  goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # metrics.Goodput.report()


@dataclasses.dataclass(frozen=True)
class Cadence:
  """After which completed steps the loop logs, evaluates and saves."""

  config: Config
  first_step: int
  checkpointing: bool

  def log(self, completed: int) -> bool:
    """Every log_period steps, the last step, and the first (which gives the time to first step)."""
    return completed % self.config.log_period == 0 or completed in (self.config.steps, self.first_step + 1)

  def evaluate(self, completed: int) -> bool:
    interval = self.config.eval_interval
    return interval > 0 and (completed % interval == 0 or completed == self.config.steps)

  def save(self, completed: int, preempted: bool) -> bool:
    period = self.config.checkpoint_period
    return self.checkpointing and (completed % period == 0 or completed == self.config.steps or preempted)


@dataclasses.dataclass(frozen=True)
class Run:
  """A run ready to step: the compiled step, the state it starts from, and the data positioned for it."""

  config: Config
  mesh: jax.sharding.Mesh
  manager: Any  # orbax.checkpoint.CheckpointManager (imported lazily), or None when enable_checkpointing=false
  step: jax.stages.Compiled  # (state, batch) -> (state, metrics)
  eval_fn: Callable  # jitted (params, batch) -> (loss sum, tokens)
  state: state_lib.TrainState
  first_step: int
  data: Iterator | None = None  # the training iterator; None when there is nothing left to do
  resumed: bool = False  # from the run's own checkpoint

  @property
  def run_dir(self) -> str:
    return checkpointing.run_dir(self.config)


def build(config: Config, devices=None):
  """(mesh, model, schedule, tx, layout) of a run on `devices` (default: all): what train() and train_compile.py
  build the step from."""
  mesh = sharding.create_mesh(config, devices)
  missing = sharding.missing_rules(config)
  if missing:
    raise ConfigError(f"logical_axis_rules has no rule for {missing}; add [name, [mesh axes]] entries for them")
  model = models.Transformer(config, mesh)
  if config.lora_rank > 0 and not jax.tree_util.tree_leaves(lora.partition(state_lib.abstract_params(config))[0]):
    raise ConfigError(
      f"lora_target_modules={list(config.lora_target_modules)} names no projection of decoder_block="
      f"{config.decoder_block} (multi-head latent attention and the experts take no adapters); name others"
    )
  schedule = optimizers.learning_rate_schedule(config)
  tx = optimizers.create_optimizer(config, schedule)
  return mesh, model, schedule, tx, state_lib.state_layout(model, config, tx, mesh)


def train(config: Config, devices=None) -> TrainSummary:
  """Runs the training loop on `devices` (default: all); returns what it did."""
  checkpointing.run_dir(config)  # An empty run_name is refused before any work.
  mesh, model, schedule, tx, layout = build(config, devices)
  state_bytes = compiled_step.state_bytes_per_device(layout.abstract)
  compiled_step.check_fits("the train state (params and optimizer)", state_bytes, config, mesh, step=False)
  checkpointing.check_start_paths(config, layout)  # Before anything is written.
  input_pipeline.check(config)
  checkpointing.check_shared_run_dir(config)

  manager = checkpointing.create_manager(config)
  try:
    with _full_disk_stops_the_run(config, layout):
      run = _prepare(config, mesh, manager, model=model, schedule=schedule, tx=tx, layout=layout)
      if run.data is None:
        cli.log(f"Nothing to do: the run is already at step {run.first_step} of steps={config.steps}.")
        return TrainSummary(first_step=run.first_step)
      return _loop(run)
  finally:
    if manager is not None:
      manager.close()


@contextlib.contextmanager
def _full_disk_stops_the_run(config: Config, layout: state_lib.StateLayout):
  """A save that fails for want of space ends the run with one line (_check_room refuses to start one that
  cannot fit; this catches what it cannot foresee, at once: the loop checks Orbax's background save after every
  step). Orbax writes into a temporary folder, so earlier checkpoints stay intact."""
  try:
    yield
  except metrics.WriteError as e:  # TensorBoard's events or the metrics file.
    raise TrainingError(str(e)) from None
  except Exception as e:
    directory = checkpointing.checkpoint_dir(config)
    if not checkpointing.out_of_space(e) or storage.is_remote(directory):
      raise
    while not os.path.isdir(directory):  # (no save has made it yet)
      directory = os.path.dirname(directory)
    free = shutil.disk_usage(directory).free
    raise TrainingError(_full_disk(config, _checkpoint_bytes(config, layout.abstract), free)) from None


def _check_room(config: Config, manager, state: state_lib.TrainState) -> None:
  """Refuses to start a local save that the disk cannot hold (measured against the newest checkpoint, or the
  state's size for the first), so a full disk never leaves a half-written save behind. A save still in flight
  has not taken all its space yet: when space is short, it is waited for and the disk measured again. In a
  multi-process job the processes would have to agree, so only the error path of _full_disk_stops_the_run applies."""
  directory = checkpointing.checkpoint_dir(config)
  if storage.is_remote(directory) or jax.process_count() > 1:
    return
  need = _checkpoint_bytes(config, state)
  os.makedirs(directory, exist_ok=True)  # The first save makes the folder (nothing is written before the run fits).
  if shutil.disk_usage(directory).free < 2 * need:
    manager.wait_until_finished()
    free = shutil.disk_usage(directory).free
    if free < need:
      raise TrainingError(_full_disk(config, need, free))


def _checkpoint_bytes(config: Config, state) -> int:
  """What the next checkpoint will take: the space the newest complete one takes on disk, else the state's
  bytes plus 64 KiB of metadata; and 1% more."""
  steps = checkpointing.complete_steps(config)
  if steps:
    newest = os.path.join(checkpointing.checkpoint_dir(config), str(steps[-1]))
    size = sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(newest) for f in files)
  else:
    size = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(state)) + 2**16
  return int(size * 1.01)


def _full_disk(config: Config, need: int, free: int) -> str:
  steps = checkpointing.complete_steps(config)
  then = f"resume from checkpoint {steps[-1]}" if steps else "start afresh (no checkpoint is complete)"
  return (
    f"no space left on device for a checkpoint in {checkpointing.checkpoint_dir(config)} (it needs about "
    f"{need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free); free space, then run the same command again to {then}"
  )


@dataclasses.dataclass(frozen=True)
class JittedStep:
  """train_step jitted for a mesh, and the abstract arguments it is lowered for: what train.py runs and what
  train_compile.py compiles for a TPU topology."""

  fn: Callable  # jax.jit of (state, batch) -> (state, metrics), the state donated
  abstract_state: state_lib.TrainState  # ShapeDtypeStructs with shardings
  abstract_batch: dict[str, jax.ShapeDtypeStruct]  # BATCH_KEYS -> [global_batch_size, max_target_length] int32

  def lower(self) -> jax.stages.Lowered:
    return self.fn.lower(self.abstract_state, self.abstract_batch)


def jit_train_step(config: Config, mesh, *, model, schedule, tx, layout: state_lib.StateLayout) -> JittedStep:
  """train_step with the state's and the batch's shardings on `mesh`, the state donated."""
  batch_sharding = sharding.batch_sharding(mesh, config)
  step_fn = jax.jit(
    lambda s, b: train_step(model, config, tx, schedule, s, b),
    in_shardings=(layout.shardings, batch_sharding),
    out_shardings=(layout.shardings, sharding.logical_sharding((), mesh, config)),
    donate_argnums=(0,),
  )
  batch_shape = jax.ShapeDtypeStruct(
    (config.global_batch_size, config.max_target_length), jnp.int32, sharding=batch_sharding
  )
  return JittedStep(step_fn, layout.abstract, dict.fromkeys(input_pipeline.batch_keys(config), batch_shape))


def compile_step(lowered: jax.stages.Lowered, mesh) -> jax.stages.Compiled:
  """Compiles a lowered step with the options of the mesh's platform (cli.compiler_options)."""
  return lowered.compile(cli.compiler_options(mesh))


def _prepare(config: Config, mesh, manager, *, model, schedule, tx, layout: state_lib.StateLayout) -> Run:
  """Compiles the step ahead of time, in the background while the state is restored or initialised; or loads
  the one train_compile.py wrote to compiled_trainstep_file, once it is checked to be this run's. Nothing is
  written before the compiled step is known to fit in memory."""
  step = jit_train_step(config, mesh, model=model, schedule=schedule, tx=tx, layout=layout)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    lowered = step.lower()  # Tracing holds the GIL: do it first, here.
    if config.compiled_trainstep_file:
      loaded = compiled_step.load(config.compiled_trainstep_file, config, mesh, lowered)  # Before any work.
      compiling = pool.submit(lambda: loaded)
    else:
      compiling = pool.submit(compile_step, lowered, mesh)
    start = checkpointing.restore_or_init(config, manager, model, tx, layout)
    compiled = _compiled(compiling, config, mesh)
  first_step = int(jax.device_get(start.state.step))
  data = None
  if first_step < config.steps:
    data = input_pipeline.create_iterator(config, mesh, start_step=first_step)
    if start.resumed and config.dataset_type != "synthetic":
      checkpointing.restore_data(config, manager, first_step, data)
  for damaged in start.skipped:
    cli.log(f"skipped: {damaged}")
  if start.resumed:
    warning = _schedule_change(config, schedule, first_step)
    if warning:
      cli.log(warning)
  cli.write_resolved_config(config, checkpointing.run_dir(config))
  num_params = metrics.count_params(layout.abstract.params)
  origin = start.source if start.resumed else f"starting from {start.source}"
  cli.log(f"Model: {num_params / 1e6:.2f}M parameters; mesh {dict(mesh.shape)}; {origin}")
  if pipeline.num_stages(config) > 1:
    cli.log(pipeline.describe(config))
  batch_sharding = sharding.batch_sharding(mesh, config)
  eval_fn = jax.jit(
    lambda p, r, b: eval_step(model, p, r, b),
    in_shardings=(layout.shardings.params, layout.shardings.reference_params, batch_sharding),
    out_shardings=sharding.logical_sharding((), mesh, config),
  )
  return Run(
    config=config,
    mesh=mesh,
    manager=manager,
    step=compiled,
    eval_fn=eval_fn,
    state=start.state,
    first_step=first_step,
    data=data,
    resumed=start.resumed,
  )


def _schedule_change(config: Config, schedule: optax.Schedule, first_step: int) -> str | None:
  """A warning line when a resumed run's learning-rate schedule differs from the one it last ran with (the run's
  config.yml, written at each start): extending `steps` stretches the schedule, so the rate jumps."""
  path = storage.join(checkpointing.run_dir(config), "config.yml")
  try:
    earlier = yaml.safe_load(storage.read_text(path)) if storage.isfile(path) else None
  except (OSError, yaml.YAMLError):
    return None
  read = (*optimizers.SCHEDULE_KEYS, "warmup_steps")
  if not isinstance(earlier, dict) or any(key not in earlier for key in read):
    return None
  changed = [key for key in optimizers.SCHEDULE_KEYS if earlier[key] != getattr(config, key)]
  if not changed:
    return None
  # The earlier schedule as this run would follow it (with its steps): what passing the earlier values gives.
  before = optimizers.learning_rate_schedule(
    types.SimpleNamespace(**{key: earlier[key] for key in read}, steps=config.steps)
  )
  last = first_step - 1
  return (
    f"warning: the learning-rate schedule differs from this run's last start "
    f"({', '.join(f'{key} {earlier[key]} -> {getattr(config, key)}' for key in changed)}): the rate was "
    f"{float(before(last)):.3e} at step {last} and is now {float(schedule(first_step)):.3e} at step {first_step}, "
    f"where the earlier schedule gives {float(before(first_step)):.3e}; to keep the earlier schedule, pass "
    f"{' '.join(f'{key}={earlier[key]}' for key in changed)}"
  )


def _compiled(compiling: concurrent.futures.Future, config: Config, mesh) -> jax.stages.Compiled:
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


def _loop(run: Run) -> TrainSummary:
  """Steps from run.first_step to config.steps; logs, evaluates and saves when Cadence says."""
  config, manager, state = run.config, run.manager, run.state
  cadence = Cadence(config, run.first_step, checkpointing=manager is not None)
  profiler = metrics.Profiler(config, storage.join(run.run_dir, "tensorboard"))
  goodput = metrics.Goodput(_PROCESS_START)
  if run.resumed:
    earlier = config.metrics_file or (metrics.metrics_path(run.run_dir) if config.gcs_metrics else "")
    goodput.read_earlier_metrics(earlier, run.first_step)
  writer = metrics.MetricWriter(config, run.run_dir)
  clock = metrics.StepClock(config, run.mesh.devices.flat[0].device_kind, run.first_step, _PROCESS_START)  # Last.
  summary = TrainSummary(first_step=run.first_step)
  batch, completed = None, run.first_step
  stop = StopRequest()
  failed = True
  try:
    for step in range(run.first_step, config.steps):
      profiler.before_step(step)
      if batch is None or config.reuse_example_batch <= 0:  # reuse_example_batch: benchmark on one batch.
        with goodput.waiting("data"):
          batch = _next_batch(run, stop, state, completed)
      state, step_metrics = run.step(state, batch)
      completed = step + 1
      if manager is not None:
        manager.check_for_errors()  # A background save that failed (a full disk) stops the run now.
      profiler.after_step(completed, state)
      signal_name = "SIGTERM" if checkpointing.reached_preemption(manager, completed) else stop.signal_name
      preempted = signal_name is not None
      save, evaluate = cadence.save(completed, preempted), cadence.evaluate(completed)
      if not (save or evaluate or preempted or cadence.log(completed)):
        continue
      scalars = {k: float(v) for k, v in jax.device_get(step_metrics).items()} | clock.lap(completed)
      _check_finite(scalars, step, config, manager)
      summary.losses.append((step, scalars["learning/loss"]))
      cli.log(metrics.format_step(step, scalars))
      writer.write(step, scalars)
      if evaluate:
        with goodput.waiting("evaluation"):
          summary.last_eval = _evaluate_and_log(run, state, step, writer)
      if save:
        with goodput.waiting("checkpoint"):
          _save(run, state, completed)
      if evaluate or save:
        clock.pause_until_now()  # Evaluation, and the part of a save that blocks the loop, are not step time.
      if preempted and completed < config.steps:
        what = "preempted" if signal_name == "SIGTERM" else "interrupted"
        if manager is None:
          raise TrainingError(f"{what} ({signal_name}) after step {step}; nothing saved (enable_checkpointing=false)")
        raise TrainingError(
          f"{what} ({signal_name}) after step {step}; checkpoint {completed} is saved: run the same command again to resume"
        )
    failed = False
  finally:
    stop.restore()
    try:
      if manager is not None:
        with goodput.waiting("checkpoint"):
          manager.wait_until_finished()  # The save in flight completes (before a stop, too), or its error is raised.
    finally:
      summary.goodput = goodput.report()
      # A run that failed reports its own error: a metrics write failing now (the same full disk) would replace it.
      with contextlib.suppress(metrics.WriteError) if failed else contextlib.nullcontext():
        try:
          writer.write_goodput(completed, summary.goodput)
        finally:
          writer.close()
      cli.log(metrics.format_goodput(summary.goodput))
  return _finish(summary, config, clock)


def _next_batch(run: Run, stop: "StopRequest", state: state_lib.TrainState, completed: int) -> dict:
  """The next training batch. A wait for data may never end by itself (a stalled bucket or data loader), so a
  SIGTERM or SIGINT during it stops the run there; data that runs out (a finite num_epoch) stops it too. Either
  way the steps completed since the last save are saved, with the data position from before the wait, and the
  run exits with one line. In a multi-process job nothing is saved here: the other processes are in the step's
  collectives, not in a save (and signals are JAX's preemption service's, see StopRequest)."""
  saves = run.manager is not None and completed > run.first_step and jax.process_count() == 1
  position = run.data.get_state() if saves and run.config.dataset_type != "synthetic" else None
  try:
    with stop.interrupting():
      return next(run.data)
  except StopRequest.Interrupted:
    what = "preempted" if stop.signal_name == "SIGTERM" else "interrupted"
    why, fix = f"{what} ({stop.signal_name}) while waiting for the data of step {completed}", "run the same command again"
  except StopIteration:
    why = f"the training data ran out before step {completed} (num_epoch={run.config.num_epoch})"
    fix = "raise num_epoch or lower steps, then run again"
  if saves:
    _save(run, state, completed, position)
    run.manager.wait_until_finished()
    raise TrainingError(f"{why}; checkpoint {completed} is saved: {fix} to resume")
  latest = run.manager.latest_step() if run.manager is not None else None
  if latest is None:
    raise TrainingError(f"{why}; no checkpoint is saved: {fix}")
  raise TrainingError(f"{why}; checkpoint {latest} is the latest: {fix} to resume from it")


class StopRequest:
  """SIGTERM (a preemption or maintenance notice) or SIGINT (Ctrl-C) to a single-process run: the step in
  progress finishes, a checkpoint is saved, the save in flight completes, and the run exits with a line on how
  to resume. Within `interrupting()` (a wait for data) the signal raises Interrupted at once instead. A second
  SIGINT interrupts at once. In a multi-process job nothing is taken here: JAX's preemption
  service turns a SIGTERM to any process into a save by all of them (checkpointing.reached_preemption), and a
  save by one process alone would wait forever for the others, so SIGINT stops that process (cli.run_cli)."""

  class Interrupted(Exception):
    """A signal arrived within interrupting()."""

  def __init__(self):
    self.signal_name: str | None = None
    self._previous = {}
    self._interrupting = False
    if jax.process_count() > 1 or threading.current_thread() is not threading.main_thread():
      return  # Python delivers signals to the main thread only.
    for sig in (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    self.signal_name = signal.Signals(signum).name
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if self._interrupting:
      raise StopRequest.Interrupted(self.signal_name)

  @contextlib.contextmanager
  def interrupting(self):
    """Within: a signal (or one that came just before) raises Interrupted, ending a blocking wait."""
    if self.signal_name is not None:
      raise StopRequest.Interrupted(self.signal_name)
    self._interrupting = True
    try:
      yield
    finally:
      self._interrupting = False

  def restore(self):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _check_finite(scalars: dict, step: int, config: Config, manager) -> None:
  """Stops the run at a non-finite loss, or parameter norm.

  The loss is that of the params before this step; the updated params (about to be saved) are checked
  through their norm, so a non-finite state is never checkpointed.
  """
  loss, norm = scalars["learning/loss"], scalars["learning/param_norm"]
  if not (math.isfinite(loss) and math.isfinite(norm)):
    latest = manager.latest_step() if manager is not None else None
    raise TrainingError(
      f"loss={loss}, param_norm={norm} after step {step}; lower learning_rate (now {config.learning_rate}) "
      f"or set gradient_clipping_threshold; last good checkpoint: {latest}"
    )


def _evaluate_and_log(run: Run, state: state_lib.TrainState, step: int, writer: metrics.MetricWriter) -> dict:
  scalars = evaluate(run.config, run.mesh, run.eval_fn, state, step=step)
  if run.config.use_dpo:
    cli.log(
      f"eval after step {step}: DPO loss {scalars['eval/avg_loss']:.4f}, reward accuracy "
      f"{scalars['eval/dpo_reward_accuracy']:.3f}, margin {scalars['eval/dpo_reward_margin']:.4f} "
      f"over {scalars['eval/total_weights']} pairs"
    )
  else:
    cli.log(
      f"eval after step {step}: loss {scalars['eval/avg_loss']:.4f}, perplexity {scalars['eval/perplexity']:.2f} "
      f"over {scalars['eval/total_weights']} tokens"
    )
  writer.write(step, scalars)
  return scalars


def _save(run: Run, state: state_lib.TrainState, completed: int, position: dict | None = None) -> None:
  """Starts saving checkpoint <completed>, with the text pipeline's position (`position`, by default the
  iterator's now; synthetic data has none), once there is room for it."""
  _check_room(run.config, run.manager, state)
  if run.config.dataset_type == "synthetic":
    data_state = None
  else:
    data_state = position if position is not None else run.data.get_state()
  if checkpointing.save(run.manager, state, data_state):
    cli.log(f"saving checkpoint {completed} to {checkpointing.checkpoint_dir(run.config)}")
  else:
    cli.log(f"checkpoint {completed} exists already in {checkpointing.checkpoint_dir(run.config)}; kept as it is")


def _finish(summary: TrainSummary, config: Config, clock: metrics.StepClock) -> TrainSummary:
  memory, memory_kind = metrics.peak_memory_bytes()
  summary.steps_run = config.steps - summary.first_step
  summary.total_tokens = summary.steps_run * config.global_batch_size * config.max_target_length
  summary.time_to_first_step = clock.time_to_first_step
  summary.median_step_time = metrics.median(clock.step_times)
  summary.peak_memory_bytes = memory
  cli.log(
    f"Done: {summary.total_tokens} tokens in {summary.steps_run} steps; median step time "
    f"{summary.median_step_time:.3f} s (steps after the first); peak memory {memory / 2**30:.2f} GiB "
    f"({memory_kind}); time to first step {summary.time_to_first_step:.1f} s"
  )
  return summary


def _train_cli(config: Config) -> None:
  if config.log_config:  # The keys that differ from base.yml; config.yml in the run's folder has them all.
    defaults = pyconfig.defaults()
    changed = [f"{k}={v}" for k, v in sorted(config.as_dict().items()) if k in defaults and v != defaults[k]]
    cli.log(
      f"Config (where it differs from base.yml; every key: {checkpointing.run_dir(config)}/config.yml): {' '.join(changed)}"
    )
  train(config)


def main(argv) -> int:
  return cli.run_cli(_train_cli, argv, writes_run_dir=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
