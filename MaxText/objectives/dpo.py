"""Direct preference optimization (`objective=dpo`, MaxText's `use_dpo=true`) on preference pairs, against the
frozen model the run started from (the reference): a loss per pair, reported per pair with its rewards, margin
and accuracy."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from MaxText import input_pipeline
from MaxText.common_types import Config
from MaxText.objectives import base
from MaxText.objectives import losses as losses_lib

# DPO's sums in aux that train and eval metrics report per pair.
METRICS = ("dpo_rewards_chosen", "dpo_rewards_rejected", "dpo_reward_margin", "dpo_reward_accuracy")


def dpo_loss_fn(model, params, reference_params, batch, dropout_rng, deterministic=False):
  """Direct preference optimization (Rafailov et al. 2023, arXiv:2305.18290), with label smoothing (cDPO):

    d = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
    loss = -(1 - dpo_label_smoothing) * log sigmoid(dpo_beta * d) - dpo_label_smoothing * log sigmoid(-dpo_beta * d)

  log p(response) sums the log-probabilities of a response's target tokens (targets_segmentation != 0). The
  reference model is `reference_params` (under LoRA, None: the base, adapters off) under stop_gradient, without dropout.

  batch: BATCH_KEYS prefixed chosen_ and rejected_, packed in lockstep: segment s of chosen row r and of rejected
  row r are one pair. Returns (summed loss over pairs, aux) with aux["tokens"] the number of pairs (the step's
  denominator) and the sums of the rewards beta * (log pi - log ref) of chosen and rejected responses, of the
  margins and of the pairs the policy ranks right (lm.loss_fn's moe_* entries too, for mixtures of experts).
  """
  config = model.config
  both = {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]]) for k in input_pipeline.BATCH_KEYS}
  logits, sown = losses_lib.forward(model, params, both, dropout_rng, deterministic=deterministic)
  reference = losses_lib.reference_logits(model, params, reference_params, both)
  loss, aux = dpo_loss_from_logits(config, logits, reference, both)
  if config.num_experts > 1:
    aux.update(losses_lib.moe_aux(config, sown, aux["tokens"]))
    loss += aux["moe_lb_loss"]
  return loss, aux


def dpo_loss_from_logits(config: Config, logits, reference_logits, both) -> tuple[jax.Array, dict]:
  """dpo_loss_fn's loss and aux from the policy's and the reference's logits over `both`: the BATCH_KEYS of the
  chosen rows followed by the rejected rows."""
  policy, scored = losses_lib.sequence_logps(logits, both)
  reference, _ = losses_lib.sequence_logps(reference_logits, both)
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


class DirectPreference(base.Objective):
  """dpo_loss_fn on rows that hold a chosen and a rejected sequence (PREFERENCES), with a reference model."""

  name = "dpo"
  examples = input_pipeline.PREFERENCES
  sequences_per_row = 2
  eval_metrics = METRICS

  def runs_reference(self) -> bool:
    return True

  def batch_keys(self) -> dict[str, jnp.dtype]:
    """BATCH_KEYS for the chosen and for the rejected responses."""
    return {f"{side}_{k}": jnp.int32 for side in ("chosen", "rejected") for k in input_pipeline.BATCH_KEYS}

  def loss(  # noqa: PLR0913 (base.Objective.loss's)
    self, model, params, batch, dropout_rng, *, reference_params=None, step=None, num_tokens=None, deterministic=False
  ):
    del step, num_tokens
    return dpo_loss_fn(model, params, reference_params, batch, dropout_rng, deterministic)

  def step_metrics(self, aux: Mapping[str, jax.Array], denominator: jax.Array) -> dict[str, jax.Array]:
    """Its sums per pair."""
    return {f"learning/{name}": aux[name] / denominator for name in METRICS}

  def eval_line(self, scalars: Mapping[str, float], when: str) -> str:
    return (
      f"eval {when}: DPO loss {scalars['eval/avg_loss']:.4f}, reward accuracy "
      f"{scalars['eval/dpo_reward_accuracy']:.3f}, margin {scalars['eval/dpo_reward_margin']:.4f} "
      f"over {scalars['eval/total_weights']} pairs"
    )


OBJECTIVE = DirectPreference
