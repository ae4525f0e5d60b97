"""The optimizer: the learning-rate schedule and AdamW's update, against plain-Python / float64 numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import optimizers
from MaxText.tests.helpers import config


def _reference_lr(step: int, *, peak: float, warmup: int, schedule_steps: int, final: float, steps: int) -> float:
  """The schedule as base.yml describes it: linear 0 -> peak over `warmup` steps, cosine from peak down to
  final * peak at `schedule_steps`, then 0 for the steps a run takes beyond `schedule_steps`."""
  if steps > schedule_steps and step >= schedule_steps:
    return 0.0
  if step < warmup:
    return peak * step / warmup
  progress = min((step - warmup) / max(schedule_steps - warmup, 1), 1.0)
  return peak * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


SCHEDULES = {
  # Warmup, then the cosine, then 0 for the 20 steps the run takes beyond the schedule.
  "warmup, steps > schedule": dict(steps=120, schedule_steps=100, warmup_fraction=0.1),
  # No warmup: the first step already runs at the peak; the run is longer than the schedule, so 0 after it.
  "no warmup, steps > schedule": dict(steps=60, schedule_steps=40, warmup_fraction=0.0),
  # steps == learning_rate_schedule_steps: no zero tail; the cosine ends at final * peak.
  "warmup, steps == schedule": dict(steps=30, schedule_steps=30, warmup_fraction=0.15),
  # learning_rate_schedule_steps=-1 takes steps.
  "schedule from steps": dict(steps=25, schedule_steps=-1, warmup_fraction=0.2),
  # All warmup: the cosine has a single step of length 1.
  "all warmup": dict(steps=12, schedule_steps=12, warmup_fraction=1.0),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_learning_rate_schedule_matches_plain_python(case):
  """Every step of the run (and a few past its end) against _reference_lr.

  Tolerance: optax computes in float32, so each value carries about 1e-7 * peak of rounding (rtol 1e-6, plus
  atol 1e-6 * peak where the value is near 0)."""
  spec = SCHEDULES[case]
  peak, final = 0.5, 0.2
  cfg = config(
    f"steps={spec['steps']}",
    f"learning_rate_schedule_steps={spec['schedule_steps']}",
    f"warmup_steps_fraction={spec['warmup_fraction']}",
    f"learning_rate={peak}",
    f"cosine_learning_rate_final_fraction={final}",
  )
  schedule_steps = spec["steps"] if spec["schedule_steps"] == -1 else spec["schedule_steps"]
  warmup = int(spec["warmup_fraction"] * schedule_steps)  # base.yml: a fraction of learning_rate_schedule_steps
  steps = np.arange(spec["steps"] + 5)
  got = np.asarray(optimizers.learning_rate_schedule(cfg)(jnp.asarray(steps)), np.float64)
  expected = [
    _reference_lr(int(s), peak=peak, warmup=warmup, schedule_steps=schedule_steps, final=final, steps=spec["steps"])
    for s in steps
  ]
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * peak)
  if warmup == 0:
    assert got[0] == pytest.approx(peak)
  if spec["steps"] == schedule_steps:
    assert got[-1] > 0  # No zero tail when the run is exactly the schedule's length.


def _reference_adamw(params, grads_per_step, lrs, *, b1, b2, eps, eps_root, weight_decay, clip):
  """AdamW (Loshchilov & Hutter 2019) in float64 numpy: global-norm clipping (when clip > 0), Adam moments
  with bias correction (Kingma & Ba 2015, eps_root inside the root, eps outside), then decoupled weight
  decay, the sum scaled by the step's learning rate. Returns (params, mu, nu) after every step."""
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  for t, (step_grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
    grads = {k: np.asarray(v, np.float64) for k, v in step_grads.items()}
    if clip > 0:
      norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
      if norm > clip:
        grads = {k: g * (clip / norm) for k, g in grads.items()}
    for k in params:
      mu[k] = b1 * mu[k] + (1 - b1) * grads[k]
      nu[k] = b2 * nu[k] + (1 - b2) * grads[k] ** 2
      mu_hat, nu_hat = mu[k] / (1 - b1**t), nu[k] / (1 - b2**t)
      params[k] = params[k] - lr * (mu_hat / (np.sqrt(nu_hat + eps_root) + eps) + weight_decay * params[k])
  return params, mu, nu


ADAM = dict(b1=0.8, b2=0.9, eps=1e-3, eps_root=1e-4, weight_decay=0.5)
# Gradient norms per step: below and above the clipping threshold of 1, and an all-zero gradient.
GRAD_NORMS = (0.3, 5.0, 0.0, 20.0, 0.05, 2.0)


def _adam_config(clip: float):
  return config(
    "steps=6",
    "warmup_steps_fraction=0.34",  # 2 warmup steps: the first update runs at learning rate 0
    "learning_rate=0.1",
    "cosine_learning_rate_final_fraction=0.1",
    f"adam_b1={ADAM['b1']}",
    f"adam_b2={ADAM['b2']}",
    f"adam_eps={ADAM['eps']}",
    f"adam_eps_root={ADAM['eps_root']}",
    f"adam_weight_decay={ADAM['weight_decay']}",
    f"gradient_clipping_threshold={clip}",
  )


def _grads(rng):
  """One gradient per step, with the global norms of GRAD_NORMS."""
  out = []
  for norm in GRAD_NORMS:
    g = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    total = math.sqrt(sum(float(np.sum(v**2)) for v in g.values()))
    out.append({k: (v * norm / total).astype(np.float32) for k, v in g.items()})
  return out


def _run_optimizer(cfg, params, grads_per_step):
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))

  @jax.jit
  def step(p, s, g):
    updates, s = tx.update(g, s, p)
    return jax.tree_util.tree_map(lambda a, u: a + u, p, updates), s

  state = tx.init(params)
  for grads in grads_per_step:
    params, state = step(params, state, grads)
  return params, state


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_adamw_matches_float64_reference(clip):
  """Six jitted float32 updates of a 2-leaf pytree against _reference_adamw, clipping on (threshold 1) and off (0).

  Tolerance: the float32 path rounds each of ~20 operations per step at ~6e-8 relative; parameters are O(1) and
  updates O(lr)=O(0.1), so 1e-6 absolute on the parameters and 1e-5 relative on the moments leave a wide margin
  while the clipped and unclipped references differ by far more (checked below)."""
  cfg = _adam_config(clip)
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
  grads_per_step = _grads(rng)
  final = cfg.cosine_learning_rate_final_fraction
  lrs = [_reference_lr(t, peak=cfg.learning_rate, warmup=2, schedule_steps=6, final=final, steps=6) for t in range(6)]
  assert lrs[0] == 0.0 and cfg.warmup_steps == 2

  got_params, got_state = _run_optimizer(cfg, params, grads_per_step)
  want_params, want_mu, want_nu = _reference_adamw(params, grads_per_step, lrs, **ADAM, clip=clip)
  for k in params:
    np.testing.assert_allclose(np.asarray(got_params[k], np.float64), want_params[k], rtol=0, atol=1e-6, err_msg=k)

  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam_state,) = [s for s in jax.tree_util.tree_leaves(got_state, is_leaf=is_adam) if is_adam(s)]
  for k in params:
    np.testing.assert_allclose(np.asarray(adam_state.mu[k], np.float64), want_mu[k], rtol=1e-5, atol=1e-9, err_msg=k)
    np.testing.assert_allclose(np.asarray(adam_state.nu[k], np.float64), want_nu[k], rtol=1e-5, atol=1e-12, err_msg=k)
  assert int(adam_state.count) == len(GRAD_NORMS)

  # The test can tell clipping from none: the other setting's reference is far outside the tolerance.
  other, _, _ = _reference_adamw(params, grads_per_step, lrs, **ADAM, clip=1.0 - clip)
  assert max(float(np.max(np.abs(other[k] - want_params[k]))) for k in params) > 1e-3


def test_the_routing_bias_is_not_decayed():
  """With zero gradients, AdamW's decoupled decay shrinks a weight by lr * weight_decay but leaves DeepSeek's
  routing bias (`gate_bias`, zero gradient by construction) as it is."""
  cfg = config("learning_rate=0.1", "adam_weight_decay=0.5", "warmup_steps_fraction=0", "gradient_clipping_threshold=0")
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))
  params = {"mlp": {"gate_bias": jnp.full((4,), 0.3), "wo": jnp.full((2, 2), 0.3)}}
  grads = jax.tree_util.tree_map(jnp.zeros_like, params)
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["mlp"]["gate_bias"], params["mlp"]["gate_bias"])
  np.testing.assert_allclose(new["mlp"]["wo"], 0.3 * (1 - 0.1 * 0.5), rtol=1e-6)
