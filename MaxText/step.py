"""The step: the loss, `train_step` and `eval_step`, top to bottom, and how they are jitted and compiled.

train.py runs this step in its loop; train_compile.py compiles the same step (the same function, shardings and
compiler options) for a TPU slice that is not here, and train.py can load what it wrote (compiled_step.py).
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

from MaxText import cli, compiled_step, input_pipeline, lora, optimizers, sharding
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import models, pipeline, quantizations
from MaxText.rl import loss as rl_loss


# ---------------------------------------------------------------------------------------------- the loss
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


def rl_loss_fn(  # noqa: PLR0913 (the losses' common five, then the RL step's two)
  model, params, reference_params, batch, dropout_rng, deterministic=False, *, on_policy, num_tokens=None
):
  """GRPO or GSPO (rl/loss.py) on a batch of rollouts (rl/rollouts.py): the clipped importance ratio of the policy to
  the sampler, times each completion's advantage, plus grpo_beta times the KL to the reference model (k3).

  on_policy: the batch's first update (state.step % num_iterations == 0), where the policy is the sampler: the old
  log-probabilities are the policy's own under stop_gradient, so the ratio is exactly 1; later updates use the
  sampler's (batch["old_logprobs"]). The reference model is `reference_params` (under LoRA, None: the base, adapters
  off), without dropout; with grpo_beta = 0 it is never run. num_tokens: the tokenizer's vocabulary, the ids the
  sampler draws from (the model's padded ids beyond it are left out of every softmax, as the engine leaves them).
  Every log-probability is of the distribution the rollouts were drawn from: the logits over
  decode_sampling_temperature (`_sampled`), the policy's, the reference's and the sampler's alike.
  Returns (the loss's sum, aux) with aux["tokens"] its denominator (loss_agg_mode's) and rl/loss.py's sums.
  """
  config = model.config
  args = (batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"])
  logits, sown = model.apply(
    {"params": params}, *args, deterministic=deterministic, rngs={"dropout": dropout_rng}, mutable=["intermediates"]
  )
  logits = _sampled(config, logits)
  mask = batch["targets_segmentation"] != 0
  logps = token_logps(logits, batch["targets"], num_tokens)
  old = jnp.where(on_policy, jax.lax.stop_gradient(logps), batch["old_logprobs"])
  reference = None
  if config.grpo_beta > 0:
    if reference_params is None:  # LoRA: the base model, the adapters off
      reference_params = lora.adapters_off(params)
    reference_logits, _ = model.apply(
      {"params": jax.lax.stop_gradient(reference_params)}, *args, deterministic=True, mutable=["intermediates"]
    )
    reference = jax.lax.stop_gradient(token_logps(_sampled(config, reference_logits), batch["targets"], num_tokens))
  loss, weight, sums = rl_loss.policy_loss(
    logps,
    old,
    reference,
    batch["advantages"][:, 0],
    mask,
    algo=config.loss_algo,
    agg=config.loss_agg_mode,
    epsilon=config.grpo_epsilon,
    epsilon_high=config.epsilon_high,
    beta=config.grpo_beta,
  )
  aux = {"tokens": weight, **sums, "rl_entropy": entropy_sum(logits, mask, num_tokens)}
  if config.num_experts > 1:
    aux.update(_moe_aux(config, sown, weight))
    loss += aux["moe_lb_loss"]
  return loss, aux


def _sampled(config: Config, logits):
  """The logits of the distribution RL's rollouts are drawn from: over decode_sampling_temperature (the engine's
  logprobs are of it too, sampled_logprobs; top-k and top-p are left out, as TRL leaves them)."""
  temperature = config.decode_sampling_temperature
  return logits if temperature == 1 else logits / jnp.asarray(temperature, logits.dtype)


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
  float32 temporaries over [tokens, vocab], the step's largest tensor (measured in docs/changelog.md, "Two
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


def token_logps(logits: jax.Array, targets: jax.Array, num_tokens: int | None = None) -> jax.Array:
  """log_softmax(logits)[targets] in float32: logits [B, L, vocab] (any float dtype), targets [B, L] -> [B, L].

  Only the first num_tokens vocabulary ids count (the tokenizer's; the output head's padding ids are tokens the
  sampler never draws, and its log-probabilities leave them out the same way); None: the whole vocabulary.
  Differentiable w.r.t. logits through cross_entropy, whose custom VJP writes the [B, L, vocab] gradient in
  one pass in the logits' dtype.
  """
  return -cross_entropy(_in_vocabulary(logits, num_tokens), targets)


def entropy_sum(logits: jax.Array, mask: jax.Array, num_tokens: int | None = None) -> jax.Array:
  """The policy's entropy -sum_v p_v log p_v summed over the tokens where mask [B, L] is true, a float32 scalar
  (the same vocabulary as token_logps). A metric: no gradient flows through it."""
  logp = jax.nn.log_softmax(jax.lax.stop_gradient(_in_vocabulary(logits, num_tokens)).astype(jnp.float32), axis=-1)
  p_logp = jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0)  # 0 log 0 = 0 on the ids left out.
  return -jnp.sum(jnp.where(mask, jnp.sum(p_logp, axis=-1), 0.0))


def _in_vocabulary(logits: jax.Array, num_tokens: int | None) -> jax.Array:
  """logits with the ids >= num_tokens at -inf (probability exactly 0); unchanged when none is."""
  if num_tokens is None or num_tokens >= logits.shape[-1]:
    return logits
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens}: needs at least one vocabulary id; pass the tokenizer's vocabulary size")
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(vocab < num_tokens, logits, -jnp.inf)


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

  # The Transformer's quantization reaches only its own call: the head applied here is quantized as it would be there.
  head = quantizations.quantize_model(models.OutputHead(config), config)
  head_params = models.OutputHead.params(params)

  @jax.checkpoint
  def chunk_loss(hidden, targets, mask):
    xent = cross_entropy(head.apply({"params": head_params}, hidden), targets)
    return jnp.sum(jnp.where(mask, xent, 0.0))

  def body(total, chunk):
    return total + chunk_loss(*chunk), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (chunks(hidden_BLE), chunks(targets_BL), chunks(mask_BL)))
  return total


# ---------------------------------------------------------------------------------------------- the step
def train_step(model, config: Config, tx, schedule, state: state_lib.TrainState, batch, num_tokens=None):  # noqa: PLR0913
  """One optimizer step over the global batch, split into gradient_accumulation_steps micro-batches.

  Gradients of the summed loss are added over micro-batches and divided once by the total number of
  target tokens (DPO: pairs; RL: loss_agg_mode's denominator), so k micro-batches of b rows give the same update as
  one batch of k*b rows. num_tokens: RL's vocabulary (rl_loss_fn).
  """
  dropout_rng = jax.random.fold_in(jax.random.key(config.init_weights_seed), state.step)
  # The state holds a circular pipeline's layers stage-major (layers/pipeline.py); the model takes them in the
  # natural order. The view is a reshape and a transpose that XLA folds into the pipeline's own [S, R, LPS] view of
  # them: no data moves (pipeline_test compiles the step to check).
  natural = functools.partial(pipeline.to_natural, config)
  reference_params = natural(state.reference_params)
  if config.use_dpo:
    loss = functools.partial(dpo_loss_fn, model, reference_params=reference_params)
  elif config.use_rl:
    on_policy = state.step % config.num_iterations == 0
    loss = functools.partial(
      rl_loss_fn, model, reference_params=reference_params, on_policy=on_policy, num_tokens=num_tokens
    )
  else:
    loss = functools.partial(loss_fn, model)
  # Gradients of the trainable parameters only: under LoRA the adapters, the frozen base a constant.
  trainable = state_lib.trainable(config, state.params)
  _, frozen = lora.partition(state.params) if config.lora_rank > 0 else (None, None)

  def full(p):
    return p if frozen is None else lora.combine(p, frozen)

  grad_fn = jax.value_and_grad(lambda p, b, r: loss(params=natural(full(p)), batch=b, dropout_rng=r), has_aux=True)
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
      lambda p, b: loss(params=natural(p), batch=b, dropout_rng=dropout_rng)[1], state.params, first
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
    bias = update_routing_bias(natural(params), aux["moe_expert_counts"], config.routed_bias_update_rate)
    params = pipeline.to_stored(config, bias)  # (the counts are per layer in the natural order)
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
  for name in DPO_METRICS:
    if name in aux:  # per pair
      step_metrics[f"learning/{name}"] = aux[name] / denominator
  for name, (total, per) in RL_METRICS.items():
    if total in aux:
      step_metrics[f"learning/{name}"] = aux[total] / jnp.maximum(aux[per], 1)
  return new_state, step_metrics


# DPO's sums in aux that train and eval metrics report per pair.
DPO_METRICS = ("dpo_rewards_chosen", "dpo_rewards_rejected", "dpo_reward_margin", "dpo_reward_accuracy")
# RL's metrics, each a sum in aux (rl/loss.py, rl_loss_fn) per completion token: the KL to the reference (k3), the
# share of tokens whose ratio the clip holds, the mean importance ratio, the policy's entropy, the policy term alone.
RL_METRICS = {
  "rl_kl": ("rl_kl", "rl_tokens"),
  "rl_clip_fraction": ("rl_clipped", "rl_tokens"),
  "rl_importance_ratio": ("rl_ratio", "rl_tokens"),
  "rl_entropy": ("rl_entropy", "rl_tokens"),
  "rl_policy_loss": ("rl_pg", "rl_tokens"),
}


def eval_step(model, params, reference_params, batch):
  """(summed float32 loss, its weight: non-padding targets, or DPO's pairs, {DPO metric: sum}) of one eval batch,
  no dropout. The loss is the cross-entropy (no MoE load-balancing term), or DPO's loss."""
  if model.config.use_dpo:
    loss, aux = dpo_loss_fn(model, params, reference_params, batch, jax.random.key(0), deterministic=True)
    return loss - aux.get("moe_lb_loss", 0.0), aux["tokens"], {k: aux[k] for k in DPO_METRICS}
  _, aux = loss_fn(model, params, batch, jax.random.key(0), deterministic=True)
  return aux["xent"], aux["tokens"], {}


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
  if config.quantize_kvcache and not config.use_rl:  # RL's rollouts decode through the engine, whose cache it is
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
  return Parts(mesh, model, schedule, tx, state_lib.state_layout(model, config, tx, mesh))


@dataclasses.dataclass(frozen=True)
class JittedStep:
  """train_step jitted for a mesh, and the abstract arguments it is lowered for: what train.py runs and what
  train_compile.py compiles for a TPU topology."""

  fn: Callable  # jax.jit of (state, batch) -> (state, metrics), the state donated
  abstract_state: state_lib.TrainState  # ShapeDtypeStructs with shardings
  abstract_batch: dict[str, jax.ShapeDtypeStruct]  # batch_keys -> [global_batch_size, max_target_length] (RL_KEYS float32)

  def lower(self) -> jax.stages.Lowered:
    return self.fn.lower(self.abstract_state, self.abstract_batch)


def jit_train_step(  # noqa: PLR0913 (keyword-only, each named at the call)
  config: Config, mesh, *, model, schedule, tx, layout: state_lib.StateLayout, num_tokens: int | None = None
) -> JittedStep:
  """train_step with the state's and the batch's shardings on `mesh`, the state donated. num_tokens: RL's
  vocabulary (rl_loss_fn); by default the tokenizer's, so train_compile.py compiles the step train.py runs."""
  if config.use_rl and num_tokens is None:
    num_tokens = tokenizer_lib.check_tokenizer(config).vocab_size
  batch_sharding = sharding.batch_sharding(mesh, config)
  step_fn = jax.jit(
    lambda s, b: train_step(model, config, tx, schedule, s, b, num_tokens),
    in_shardings=(layout.shardings, batch_sharding),
    out_shardings=(layout.shardings, sharding.logical_sharding((), mesh, config)),
    donate_argnums=(0,),
  )
  shape = (config.global_batch_size, config.max_target_length)
  batch = {
    key: jax.ShapeDtypeStruct(shape, jnp.float32 if key in input_pipeline.RL_KEYS else jnp.int32, sharding=batch_sharding)
    for key in input_pipeline.batch_keys(config)
  }
  return JittedStep(step_fn, layout.abstract, batch)


def jit_eval_step(config: Config, mesh, model, layout: state_lib.StateLayout) -> Callable:
  """eval_step jitted for `mesh`: (params, reference params, batch) -> (loss sum, weight, {DPO metric: sum}), of
  the train state's params (a circular pipeline's layers stage-major, viewed in the natural order as train_step
  does)."""
  natural = functools.partial(pipeline.to_natural, config)
  return jax.jit(
    lambda p, r, b: eval_step(model, natural(p), natural(r), b),
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
