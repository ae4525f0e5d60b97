"""The optimizer: AdamW with linear warmup, cosine decay and global-norm clipping (optax)."""

import jax
import optax

from MaxText.common_types import Config

# Parameters that AdamW does not decay: DeepSeek-V3's routing bias (layers/moe.py) steers the choice of experts
# only, so its gradient is zero; decay would pull a loaded bias to 0.
NOT_DECAYED = ("gate_bias",)


def decays(params):
  """A tree of bools like params: False for the parameters in NOT_DECAYED."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: not any(getattr(k, "key", None) in NOT_DECAYED for k in path), params
  )


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """MaxText's schedule: linear warmup 0 -> learning_rate over warmup_steps, cosine decay to
  learning_rate * cosine_learning_rate_final_fraction at learning_rate_schedule_steps, then 0
  (Chinchilla, Hoffmann et al. 2022, decay over the run's length)."""
  peak = config.learning_rate
  warmup = config.warmup_steps
  decay = max(config.learning_rate_schedule_steps - warmup, 1)
  cosine = optax.cosine_decay_schedule(peak, decay, alpha=config.cosine_learning_rate_final_fraction)
  pieces, boundaries = [cosine], []
  if warmup > 0:
    pieces, boundaries = [optax.linear_schedule(0.0, peak, warmup), cosine], [warmup]
  if config.steps > config.learning_rate_schedule_steps:
    pieces.append(optax.constant_schedule(0.0))
    boundaries.append(config.learning_rate_schedule_steps)
  return optax.join_schedules(pieces, boundaries) if boundaries else cosine


def create_optimizer(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  adamw = optax.adamw(
    schedule,
    b1=config.adam_b1,
    b2=config.adam_b2,
    eps=config.adam_eps,
    eps_root=config.adam_eps_root,
    weight_decay=config.adam_weight_decay,
    mask=decays,
  )
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  return adamw
