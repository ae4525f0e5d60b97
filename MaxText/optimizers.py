"""The optimizer (`opt_type`) and the learning-rate schedule (`lr_schedule_type`), from optax, with global-norm
clipping.

opt_type: adamw (optax.adamw), adam_pax (Adam keeping bias-corrected moments, as Pax/MaxText), sgd (optax.sgd),
adafactor (optax.adafactor with its defaults) and muon (optax.contrib.muon: Newton-Schulz orthogonalised momentum
for the matrices, AdamW for embeddings, the output head, norms and biases). lr_schedule_type: cosine or wsd.
"""

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from optax.contrib import MuonDimensionNumbers

from MaxText import common_types as ct
from MaxText import lora
from MaxText.common_types import Config
from MaxText.layers import models
from MaxText.layers.linears import DTYPES
from MaxText.sections import implement
from MaxText.sections import optimizer as section

SCHEDULE_KEYS = section.SCHEDULE_KEYS  # the keys that set every step's learning rate

# Parameters that AdamW does not decay: DeepSeek-V3's routing bias (layers/moe.py) steers the choice of experts
# only, so its gradient is zero; decay would pull a loaded bias to 0.
NOT_DECAYED = ("gate_bias",)


def decays(params):
  """A tree of bools like params: False for the parameters in NOT_DECAYED."""
  return jax.tree_util.tree_map_with_path(
    lambda path, _: not any(getattr(k, "key", None) in NOT_DECAYED for k in path), params
  )


# ------------------------------------------------------------------------------------- schedules
def _cosine(init: float, final: float, length: int) -> optax.Schedule:
  """init -> final along half a cosine, reaching final at step length - 1 (MaxText's make_cos_schedule)."""

  def schedule(step):
    progress = step / (length - 1) if length > 1 else 1.0
    weight = 0.5 * (jnp.cos(jnp.pi * progress) + 1)
    return init * weight + final * (1 - weight)

  return schedule


def learning_rate_schedule(config: Config) -> optax.Schedule:
  """MaxText's schedules (create_learning_rate_schedule), step for step, over learning_rate_schedule_steps S
  with peak learning_rate P, final value f * P (learning_rate_final_fraction) and W warmup steps:

  cosine: linear warmup 0 -> P over steps [0, W), then half a cosine from P at step W to f * P at step S - 1
  (Chinchilla, Hoffmann et al. 2022). wsd (warmup-stable-decay, Hu et al. 2024, arXiv:2404.06395): the same
  warmup, P until the last D = wsd_decay_steps_fraction * S steps, which go from P to f * P at step S - 1,
  linearly or by a cosine (wsd_decay_style; a 1-step linear decay stays at P, as in MaxText). Both are 0 from
  S on when the run takes more steps than S.
  """
  peak, warmup, total = config.learning_rate, config.warmup_steps, config.learning_rate_schedule_steps
  final = peak * config.learning_rate_final_fraction
  pieces, boundaries = [], []
  if warmup > 0:
    pieces.append(optax.linear_schedule(0.0, peak, warmup))
    boundaries.append(warmup)
  if config.lr_schedule_type == "cosine":
    if total - warmup > 0:
      pieces.append(_cosine(peak, final, total - warmup))
      boundaries.append(total)
  else:
    decay = int(config.wsd_decay_steps_fraction * total)
    stable = total - warmup - decay
    if stable > 0:
      pieces.append(optax.constant_schedule(peak))
      boundaries.append(warmup + stable)
    if decay > 0:
      linear = config.wsd_decay_style == "linear"
      pieces.append(optax.linear_schedule(peak, final, decay - 1) if linear else _cosine(peak, final, decay))
      boundaries.append(total)
  if config.steps > total:
    pieces.append(optax.constant_schedule(0.0))
    boundaries.append(total)
  # join_schedules switches to pieces[i + 1] at boundaries[i]; a boundary after the last piece is unused.
  return optax.join_schedules(pieces, boundaries[: len(pieces) - 1])


# ------------------------------------------------------------------------------------- optimizers
def _adamw(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return optax.adamw(
    schedule, **_adam(config), weight_decay=config.adam_weight_decay, mu_dtype=_mu_dtype(config), mask=decays
  )


def _adam_pax(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return adam_pax(schedule, **_adam(config), weight_decay=config.adam_weight_decay)


def _muon(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  return _muon_with(config, schedule, muon_dimensions(config))


def _muon_with(config: Config, schedule: optax.Schedule, dimensions) -> optax.GradientTransformation:
  """optax's Muon with MaxText's keys, for the parameters' MuonDimensionNumbers `dimensions` (None: AdamW's)."""
  muon = optax.contrib.muon(
    schedule,
    beta=config.muon_beta,
    eps=config.adam_eps,
    weight_decay=config.muon_weight_decay,
    mu_dtype=_mu_dtype(config),
    adam_b1=config.adam_b1,
    adam_b2=config.adam_b2,
    adam_eps_root=config.adam_eps_root,
    adam_weight_decay=config.adam_weight_decay,
    muon_weight_dimension_numbers=dimensions,
    consistent_rms=config.muon_consistent_rms or None,
  )
  # Muon's AdamW branch decays every parameter it updates; NOT_DECAYED ones (zero gradient) are left unchanged.
  return optax.chain(
    muon, optax.masked(optax.set_to_zero(), lambda params: jax.tree_util.tree_map(lambda d: not d, decays(params)))
  )


# opt_type -> the optimizer (before clipping), from the config and the schedule.
OPTIMIZERS = implement(
  section.OPTIMIZERS,
  {
    "adamw": _adamw,
    "adam_pax": _adam_pax,
    "sgd": lambda config, schedule: optax.sgd(schedule),
    "adafactor": lambda config, schedule: optax.adafactor(schedule),
    "muon": _muon,
  },
)


def _adam(config: Config) -> dict:
  return dict(b1=config.adam_b1, b2=config.adam_b2, eps=config.adam_eps, eps_root=config.adam_eps_root)


def _mu_dtype(config: Config):
  return DTYPES[config.mu_dtype] if config.mu_dtype else None


def create_optimizer(config: Config, schedule: optax.Schedule) -> optax.GradientTransformation:
  """The optimizer of opt_type, after clipping to gradient_clipping_threshold (0: none)."""
  opt = OPTIMIZERS[config.opt_type](config, schedule)
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), opt)
  return opt


def adam_pax(learning_rate: optax.Schedule, b1, b2, eps, eps_root, weight_decay) -> optax.GradientTransformation:
  """Adam as Pax (praxis's sharded_adam) and MaxText's adam_pax: the moments are kept bias-corrected, by decays
  b * (1 - b^(t-1)) / (1 - b^t) at step t (Shazeer and Stern 2018, arXiv:1804.04235, sec. 7.1), so the update
  is mu / (sqrt(nu + eps_root) + eps) with no correction at use; weight decay (all but NOT_DECAYED) is added
  before the learning rate. The same updates as adamw up to rounding; the state holds other numbers."""

  def init(params):
    zeros = lambda: jax.tree_util.tree_map(jnp.zeros_like, params)  # noqa: E731
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros(), nu=zeros())

  def corrected(decay, count):
    t = count.astype(jnp.float32) + 1.0
    return decay * (1.0 - decay ** (t - 1.0)) / (1.0 - decay**t)

  def update(grads, opt_state, params=None):
    d1, d2 = corrected(b1, opt_state.count), corrected(b2, opt_state.count)
    mu = jax.tree_util.tree_map(lambda g, m: (1 - d1).astype(g.dtype) * g + d1.astype(g.dtype) * m, grads, opt_state.mu)
    nu = jax.tree_util.tree_map(lambda g, v: (1 - d2).astype(g.dtype) * g * g + d2.astype(g.dtype) * v, grads, opt_state.nu)
    updates = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu, nu)
    if weight_decay > 0:
      updates = jax.tree_util.tree_map(
        lambda u, p, decayed: u + weight_decay * p if decayed else u, updates, params, decays(params)
      )
    lr = learning_rate(opt_state.count)
    updates = jax.tree_util.tree_map(lambda u: (-lr * u).astype(u.dtype), updates)
    return updates, optax.ScaleByAdamState(count=opt_state.count + 1, mu=mu, nu=nu)

  return optax.GradientTransformation(init, update)


# Logical axes that are not a matrix's rows or columns: the stacked layers and the experts.
_BATCH_AXES = (ct.LAYERS, ct.EXP)


def muon_dimensions(config: Config):
  """Muon's MuonDimensionNumbers for each parameter, None for those AdamW updates, from the parameters' logical
  axes: embeddings and the output head (a vocab axis), biases, and anything with fewer than two axes besides
  layers and experts, go to AdamW. A kernel whose last axis is the model's (embed: the attention output, an
  MLP's wo) or a LoRA rank (lora_a) reduces over all its other axes; any other reduces over its first (the input)
  and outputs the rest. Under LoRA, only the adapters': the parameters the optimizer sees."""
  inputs = models.init_inputs(1, config.max_target_length)
  boxed = jax.eval_shape(lambda rng: models.Transformer(config).init(rng, *inputs)["params"], jax.random.key(0))

  def dims(path, spec):
    names = tuple(spec)
    matrix = [i for i, name in enumerate(names) if name not in _BATCH_AXES]
    if len(matrix) < 2 or ct.VOCAB in names or path[-1].key.endswith("bias"):
      return None
    if names[matrix[-1]] in (ct.EMBED, ct.EMBED_NO_EXP, ct.LORA_RANK):
      return MuonDimensionNumbers(reduction_axis=tuple(matrix[:-1]), output_axis=(matrix[-1],))
    return MuonDimensionNumbers(reduction_axis=(matrix[0],), output_axis=tuple(matrix[1:]))

  specs = nn.get_partition_spec(boxed)
  out = jax.tree_util.tree_map_with_path(dims, specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  return lora.partition(out)[0] if config.lora_rank > 0 else out
