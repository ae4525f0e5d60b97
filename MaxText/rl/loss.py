"""The RL policy loss as pure functions of per-token log-probabilities: GRPO's clipped importance ratio per token,
GSPO-token's per sequence, the k3 KL penalty to the reference model, and the three aggregations.

Notation, for completion i of the batch and its token t: lp_it = log pi_theta(o_it | q, o_i<t) under the policy being
trained, old_it the same under the policy that sampled the rollouts, ref_it under the reference model, A_i the
completion's group-normalised advantage, m_it = 1 on completion tokens (0 on prompt and padding), |o_i| = sum_t m_it.

The loss comes back as (loss_sum, weight): the train step sums both over micro-batches and divides once, so gradient
accumulation is exact in every aggregation mode (a mean per micro-batch would weigh short micro-batches wrongly).
`sums` are metrics that add up over micro-batches in the same way.
"""

import jax
import jax.numpy as jnp

from MaxText.sections import implement
from MaxText.sections.reinforcement import AGG_MODES, ALGOS  # loss_algo, loss_agg_mode: the names of the formulas below


# ---------------------------------------------------------------------------------------------- importance ratios
# Each takes lp, old [B, L] (zero off the mask) and |o_i| [B] and gives the ratio that is clipped, [B, L].
def _grpo_ratio(logps, old_logps, lengths):
  """GRPO (Shao et al. 2024, arXiv:2402.03300, eq. 3; PPO's surrogate per token): r_it = exp(lp_it - old_it)."""
  del lengths
  return jnp.exp(logps - old_logps)


def _gspo_token_ratio(logps, old_logps, lengths):
  """GSPO-token (Zheng et al. 2025, arXiv:2507.18071): the sequence's length-normalised ratio
  s_i = exp(sum_t m_it (lp_it - old_it) / |o_i|), with each token's gradient through its own log-probability only:
  s_it = sg(s_i) * exp(lp_it - sg(lp_it)) (value s_i, d s_it / d lp_it = s_i)."""
  s_i = jnp.exp(jnp.sum(logps - old_logps, axis=1) / jnp.maximum(lengths, 1))
  return jax.lax.stop_gradient(s_i)[:, None] * jnp.exp(logps - jax.lax.stop_gradient(logps))


_RATIOS = implement(ALGOS, {"grpo": _grpo_ratio, "gspo-token": _gspo_token_ratio})


# ---------------------------------------------------------------------------------------------- aggregations
# Each takes the per-sequence sums sum_t m_it l_it [B] and |o_i| [B] and gives (loss_sum, weight): loss = sum / weight.
def _token_mean(row_sums, lengths):
  """sum_i sum_t m l / sum m: every completion token weighs the same (DAPO's token-level loss)."""
  return jnp.sum(row_sums), jnp.sum(lengths)


def _sequence_mean(row_sums, lengths):
  """sum_i (sum_t m l) / N over the N completions with a token: each completion's token sum, a mean over them."""
  return jnp.sum(row_sums), jnp.sum(lengths > 0)


def _sequence_mean_token_mean(row_sums, lengths):
  """sum_i (sum_t m l / |o_i|) / N: each completion's token mean, a mean over completions (GRPO's eq. 3)."""
  return jnp.sum(row_sums / jnp.maximum(lengths, 1)), jnp.sum(lengths > 0)


_AGGREGATIONS = implement(
  AGG_MODES,
  {
    "token-mean": _token_mean,
    "sequence-mean": _sequence_mean,
    "sequence-mean-token-mean": _sequence_mean_token_mean,
  },
)


# ---------------------------------------------------------------------------------------------- the loss
# The keyword-only settings are the config's RL keys one for one (loss_algo, loss_agg_mode, grpo_epsilon,
# epsilon_high, grpo_beta); a settings object would only rename them.
def policy_loss(  # noqa: PLR0913
  logps, old_logps, ref_logps, advantages, mask, *, algo: str, agg: str, epsilon: float, epsilon_high: float, beta: float
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """The clipped policy loss with a KL penalty, per token (completion i, token t):

    pg_it = -min(ratio_it A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon_high) A_i)
    kl_it = exp(ref_it - lp_it) - (ref_it - lp_it) - 1
    l_it  = pg_it + beta kl_it

  GRPO's clipped surrogate and KL penalty (Shao et al. 2024, arXiv:2402.03300, eqs. 3-4; the KL by Schulman's k3
  estimator), clipped asymmetrically as DAPO (Yu et al. 2025, arXiv:2503.14476) when epsilon_high > epsilon; ratio_it
  per `algo` (_grpo_ratio, _gspo_token_ratio), aggregated per `agg` (_token_mean, _sequence_mean,
  _sequence_mean_token_mean).

  Inputs: logps [B, L] float32, differentiable; old_logps [B, L] (a constant: under stop_gradient; pass
  stop_gradient(logps) on-policy, which makes every ratio exactly 1); ref_logps [B, L] (a constant) or None when
  beta == 0; advantages [B]; mask [B, L], true on completion tokens. Off the mask the log-probabilities may hold
  anything (-inf included): they reach neither the values nor the gradients.

  Returns (loss_sum, weight, sums), float32 scalars and a dict of them, each a sum over the batch's rows:
    rl_tokens     completion tokens, sum m
    rl_sequences  completions with at least one token, N
    rl_kl         sum m kl (0 without ref_logps)
    rl_clipped    tokens where the clipped branch is the active one: ratio < 1 - epsilon with A < 0, or
                  ratio > 1 + epsilon_high with A > 0 (gradient 0)
    rl_ratio      sum m ratio (r_it for GRPO, s_i for GSPO-token)
    rl_pg         sum m pg, the policy term alone
  """
  if algo not in _RATIOS:
    raise ValueError(f"loss_algo={algo!r}: not one of {ALGOS}")
  if agg not in _AGGREGATIONS:
    raise ValueError(f"loss_agg_mode={agg!r}: not one of {AGG_MODES}")
  if ref_logps is None and beta != 0:
    raise ValueError(f"grpo_beta={beta} needs the reference log-probabilities; pass ref_logps or set grpo_beta=0")
  mask = mask.astype(bool)
  lengths = jnp.sum(mask, axis=1).astype(jnp.float32)  # |o_i|
  # Zeroed before any exp: a padding position's exp(lp - old) could overflow, and inf * 0 in a gradient is NaN.
  logps = jnp.where(mask, logps, 0.0)
  old_logps = jnp.where(mask, jax.lax.stop_gradient(old_logps), 0.0)
  adv = advantages.astype(jnp.float32)[:, None]

  ratio = _RATIOS[algo](logps, old_logps, lengths)
  pg = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - epsilon, 1 + epsilon_high) * adv)
  kl = jnp.zeros_like(logps)
  if ref_logps is not None:
    log_ref_ratio = jnp.where(mask, jax.lax.stop_gradient(ref_logps), 0.0) - logps
    kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1
  row_sums = jnp.sum(jnp.where(mask, pg + beta * kl, 0.0), axis=1)
  loss_sum, weight = _AGGREGATIONS[agg](row_sums, lengths)

  clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
  sums = {
    "rl_tokens": jnp.sum(lengths),
    "rl_sequences": jnp.sum(lengths > 0),
    "rl_kl": jnp.sum(jnp.where(mask, kl, 0.0)),
    "rl_clipped": jnp.sum(mask & clipped),
    "rl_ratio": jnp.sum(jnp.where(mask, ratio, 0.0)),
    "rl_pg": jnp.sum(jnp.where(mask, pg, 0.0)),
  }
  sums = {k: jax.lax.stop_gradient(v).astype(jnp.float32) for k, v in sums.items()}
  return loss_sum, weight.astype(jnp.float32), sums
