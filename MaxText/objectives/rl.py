"""Reinforcement learning from verifiable rewards (`objective=rl`, MaxText's `use_rl=true`; configs/rl.yml): GRPO
or GSPO. Its data are rollouts of prompts from the inference engine on the training parameters, scored by reward
functions (MaxText/rl/rollouts.py, rewards.py); its loss the clipped policy loss with a KL penalty to the reference
model (rl/loss.py); its evaluation the mean reward of greedy completions of the eval prompts."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from MaxText import cli, input_pipeline
from MaxText.common_types import Config
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.objectives import base, losses
from MaxText.rl import loss as rl_loss
from MaxText.rl import rewards, rollouts

# Its metrics, each a sum in aux (rl/loss.py, rl_loss_fn) per completion token: the KL to the reference (k3), the
# share of tokens whose ratio the clip holds, the mean importance ratio, the policy's entropy, the policy term alone.
METRICS = {
  "rl_kl": ("rl_kl", "rl_tokens"),
  "rl_clip_fraction": ("rl_clipped", "rl_tokens"),
  "rl_importance_ratio": ("rl_ratio", "rl_tokens"),
  "rl_entropy": ("rl_entropy", "rl_tokens"),
  "rl_policy_loss": ("rl_pg", "rl_tokens"),
}


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
  logits, sown = losses.forward(model, params, batch, dropout_rng, deterministic=deterministic)
  logits = _sampled(config, logits)
  mask = batch["targets_segmentation"] != 0
  logps = losses.token_logps(logits, batch["targets"], num_tokens)
  old = jnp.where(on_policy, jax.lax.stop_gradient(logps), batch["old_logprobs"])
  reference = None
  if config.grpo_beta > 0:
    reference_logits = losses.reference_logits(model, params, reference_params, batch)
    reference = jax.lax.stop_gradient(losses.token_logps(_sampled(config, reference_logits), batch["targets"], num_tokens))
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
  aux = {"tokens": weight, **sums, "rl_entropy": losses.entropy_sum(logits, mask, num_tokens)}
  if config.num_experts > 1:
    aux.update(losses.moe_aux(config, sown, weight))
    loss += aux["moe_lb_loss"]
  return loss, aux


def _sampled(config: Config, logits):
  """The logits of the distribution RL's rollouts are drawn from: over decode_sampling_temperature (the engine's
  logprobs are of it too, sampled_logprobs; top-k and top-p are left out, as TRL leaves them)."""
  temperature = config.decode_sampling_temperature
  return logits if temperature == 1 else logits / jnp.asarray(temperature, logits.dtype)


class ReinforcementLearning(base.Objective):
  """rl_loss_fn on batches of rollouts (rollouts.Rollouts), num_iterations updates on each; with grpo_beta > 0, a
  reference model."""

  name = "rl"
  decodes = True  # the rollouts decode through the engine (quantize_kvcache applies to them)
  evaluates_first = True  # the reward before training, the baseline of the rewards after

  def runs_reference(self) -> bool:
    return self.config.grpo_beta > 0

  def said(self) -> str:
    return f"objective=rl with grpo_beta={self.config.grpo_beta}"

  def batch_keys(self) -> dict[str, jnp.dtype]:
    return dict.fromkeys(input_pipeline.BATCH_KEYS, jnp.int32) | dict.fromkeys(rollouts.ROLLOUT_KEYS, jnp.float32)

  def vocabulary(self) -> int:
    """The tokenizer's: the ids the sampler draws from."""
    return tokenizer_lib.check_tokenizer(self.config).vocab_size

  def check_start(self) -> None:
    """The tokenizer, the engine's keys, the reward functions (their modules imported: said in a line), whole groups
    and prompts that fit (rollouts.check)."""
    self._check_reference_start()
    if self.config.dataset_type != "synthetic":
      tokenizer_lib.check_tokenizer(self.config)
    imported = rewards.imported(rollouts.check(self.config))
    if imported:  # A config naming "module:function" runs that module's code: say which.
      cli.log(imported)

  def data(self, mesh, params, first_step: int) -> rollouts.Rollouts:
    del first_step  # The prompts' position is restored from a checkpoint; each step's seeds come from the step.
    return rollouts.Rollouts(self.config, mesh, params, tokenizer_lib.check_tokenizer(self.config))

  def loss(  # noqa: PLR0913 (base.Objective.loss's)
    self, model, params, batch, dropout_rng, *, reference_params=None, step=None, num_tokens=None, deterministic=False
  ):
    """rl_loss_fn, on policy at each batch's first update (step % num_iterations == 0)."""
    on_policy = True if step is None else step % self.config.num_iterations == 0
    return rl_loss_fn(
      model, params, reference_params, batch, dropout_rng, deterministic, on_policy=on_policy, num_tokens=num_tokens
    )

  def step_metrics(self, aux: Mapping[str, jax.Array], denominator: jax.Array) -> dict[str, jax.Array]:
    """Its sums per completion token."""
    del denominator
    return {f"learning/{name}": aux[total] / jnp.maximum(aux[per], 1) for name, (total, per) in METRICS.items()}

  def evaluate(self, mesh, eval_fn, state, data, *, step: int) -> dict[str, float]:
    """The rewards of greedy completions of the eval prompts (rollouts.Rollouts.evaluate)."""
    del mesh, eval_fn, step
    return data.evaluate(state.params)

  def eval_line(self, scalars: Mapping[str, float], when: str) -> str:
    each = ", ".join(f"{k.removeprefix('eval/reward_')} {v:.4f}" for k, v in scalars.items() if k.startswith("eval/reward_"))
    return f"eval {when}: reward {scalars['eval/reward']:.4f} ({each}) over {scalars['eval/total_weights']} prompts"


OBJECTIVE = ReinforcementLearning
