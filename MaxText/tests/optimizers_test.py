"""The optimizers and the learning-rate schedules against plain-Python / float64 numpy references: AdamW, Pax's Adam,
SGD, Adafactor (Shazeer & Stern 2018) and Muon (Jordan et al. 2024) written out from their published update rules,
not from the optax calls that optimizers.py makes."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from MaxText import optimizers
from MaxText.tests.helpers import config


def _reference_lr(step: int, *, peak: float, warmup: int, schedule_steps: int, final: float, steps: int) -> float:
  """The schedule as MaxText defines it (create_learning_rate_schedule): linear 0 -> peak over `warmup` steps,
  then half a cosine from peak at step `warmup` down to final * peak at step schedule_steps - 1, then 0 for the
  steps a run takes beyond `schedule_steps`. Defined for the steps a run takes."""
  if steps > schedule_steps and step >= schedule_steps:
    return 0.0
  if step < warmup or warmup == schedule_steps:
    return peak * min(step / warmup, 1.0)
  length = schedule_steps - warmup
  progress = (step - warmup) / (length - 1) if length > 1 else 1.0
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
    f"learning_rate_final_fraction={final}",
  )
  schedule_steps = spec["steps"] if spec["schedule_steps"] == -1 else spec["schedule_steps"]
  warmup = int(spec["warmup_fraction"] * schedule_steps)  # base.yml: a fraction of learning_rate_schedule_steps
  # The steps of the run, and a few past its end where the schedule's zero tail covers them.
  steps = np.arange(spec["steps"] + (5 if spec["steps"] > schedule_steps else 0))
  got = np.asarray(optimizers.learning_rate_schedule(cfg)(jnp.asarray(steps)), np.float64)
  expected = [
    _reference_lr(int(s), peak=peak, warmup=warmup, schedule_steps=schedule_steps, final=final, steps=spec["steps"])
    for s in steps
  ]
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6 * peak)
  if warmup == 0:
    assert got[0] == pytest.approx(peak)
  if spec["steps"] == schedule_steps and warmup < schedule_steps:
    assert got[-1] == pytest.approx(final * peak)  # The last step runs at the final learning rate.


def _clip_global_norm(grads: dict, clip: float) -> dict:
  """MaxText's clipping before every optimizer (gradient_clipping_threshold): the whole tree scaled to norm `clip`
  when its global L2 norm is above it (clip 0: no clipping)."""
  grads = {k: np.asarray(v, np.float64) for k, v in grads.items()}
  norm = math.sqrt(sum(float(np.sum(g**2)) for g in grads.values()))
  return {k: g * (clip / norm) for k, g in grads.items()} if 0 < clip < norm else grads


def _reference_adamw(params, grads_per_step, lrs, adam: dict, *, clip):
  """AdamW (Loshchilov & Hutter 2019) in float64 numpy: global-norm clipping (when clip > 0), Adam moments
  with bias correction (Kingma & Ba 2015, eps_root inside the root, eps outside), then decoupled weight
  decay, the sum scaled by the step's learning rate; `adam` holds b1, b2, eps, eps_root and weight_decay (as ADAM).
  Returns (params, mu, nu) after every step."""
  b1, b2, eps, eps_root, weight_decay = (adam[k] for k in ("b1", "b2", "eps", "eps_root", "weight_decay"))
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  for t, (step_grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
    grads = _clip_global_norm(step_grads, clip)
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
    "learning_rate_final_fraction=0.1",
    f"adam_b1={ADAM['b1']}",
    f"adam_b2={ADAM['b2']}",
    f"adam_eps={ADAM['eps']}",
    f"adam_eps_root={ADAM['eps_root']}",
    f"adam_weight_decay={ADAM['weight_decay']}",
    f"gradient_clipping_threshold={clip}",
  )


def _scaled_grads(shapes: dict, rng) -> list[dict]:
  """One gradient tree per step with the global norms of GRAD_NORMS (above and below the clipping threshold of 1,
  and all zero), float32 as a step's gradients are."""
  out = []
  for norm in GRAD_NORMS:
    g = {k: rng.standard_normal(shape) for k, shape in shapes.items()}
    total = math.sqrt(sum(float(np.sum(v**2)) for v in g.values()))
    out.append({k: (v * norm / total).astype(np.float32) for k, v in g.items()})
  return out


def _grads(rng):
  """One gradient per step of a 3 x 4 matrix `w` and a vector `b`, with the global norms of GRAD_NORMS."""
  return _scaled_grads({"w": (3, 4), "b": (4,)}, rng)


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
  final = cfg.learning_rate_final_fraction
  lrs = [_reference_lr(t, peak=cfg.learning_rate, warmup=2, schedule_steps=6, final=final, steps=6) for t in range(6)]
  assert lrs[0] == 0.0 and cfg.warmup_steps == 2

  got_params, got_state = _run_optimizer(cfg, params, grads_per_step)
  want_params, want_mu, want_nu = _reference_adamw(params, grads_per_step, lrs, ADAM, clip=clip)
  for k in params:
    np.testing.assert_allclose(np.asarray(got_params[k], np.float64), want_params[k], rtol=0, atol=1e-6, err_msg=k)

  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam_state,) = [s for s in jax.tree_util.tree_leaves(got_state, is_leaf=is_adam) if is_adam(s)]
  for k in params:
    np.testing.assert_allclose(np.asarray(adam_state.mu[k], np.float64), want_mu[k], rtol=1e-5, atol=1e-9, err_msg=k)
    np.testing.assert_allclose(np.asarray(adam_state.nu[k], np.float64), want_nu[k], rtol=1e-5, atol=1e-12, err_msg=k)
  assert int(adam_state.count) == len(GRAD_NORMS)

  # The test can tell clipping from none: the other setting's reference is far outside the tolerance.
  other, _, _ = _reference_adamw(params, grads_per_step, lrs, ADAM, clip=1.0 - clip)
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


def _reference_wsd(step: int, *, peak, warmup, schedule_steps, decay_steps, final, style, steps) -> float:
  """Warmup-stable-decay as MaxText defines it: linear 0 -> peak over `warmup` steps, peak until the last
  `decay_steps` of the schedule, then linear or cosine from peak down to final * peak at step
  schedule_steps - 1; 0 after the schedule when the run is longer."""
  if steps > schedule_steps and step >= schedule_steps:
    return 0.0
  if step < warmup:
    return peak * step / warmup
  start = schedule_steps - decay_steps
  if step < start:
    return peak
  progress = (step - start) / (decay_steps - 1)
  if style == "linear":
    return peak + (final * peak - peak) * progress
  return peak * (final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress)))


@pytest.mark.parametrize("style", ["linear", "cosine"])
@pytest.mark.parametrize("steps, warmup_fraction", [(120, 0.1), (100, 0.0), (100, 0.8)])
def test_wsd_schedule_matches_plain_python(style, steps, warmup_fraction):
  """lr_schedule_type=wsd over a 100-step schedule with a 20-step decay: with and without warmup, with no stable
  phase (warmup 80 + decay 20), and a run 20 steps longer than the schedule (0 after it)."""
  peak, final = 0.5, 0.2
  cfg = config("lr_schedule_type=wsd", f"wsd_decay_style={style}", "wsd_decay_steps_fraction=0.2", f"steps={steps}",
               "learning_rate_schedule_steps=100", f"warmup_steps_fraction={warmup_fraction}", f"learning_rate={peak}",
               f"learning_rate_final_fraction={final}")  # fmt: skip
  at = np.arange(steps + (5 if steps > 100 else 0))
  got = np.asarray(optimizers.learning_rate_schedule(cfg)(jnp.asarray(at)), np.float64)
  want = [
    _reference_wsd(
      int(s),
      peak=peak,
      warmup=int(warmup_fraction * 100),
      schedule_steps=100,
      decay_steps=20,
      final=final,
      style=style,
      steps=steps,
    )  # fmt: skip
    for s in at
  ]
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * peak)
  assert got[99] == pytest.approx(final * peak)  # the schedule's last step runs at the final learning rate


def test_a_wsd_decay_that_does_not_fit_after_the_warmup_is_a_config_error():
  from MaxText.common_types import ConfigError

  with pytest.raises(ConfigError, match="wsd_decay_steps_fraction=0.5 with warmup_steps_fraction=0.6"):
    config("lr_schedule_type=wsd", "wsd_decay_steps_fraction=0.5", "warmup_steps_fraction=0.6")


def test_adam_pax_matches_the_float64_reference_and_keeps_bias_corrected_moments():
  """opt_type=adam_pax: the parameters of the AdamW reference (its updates are Adam's with the bias correction
  folded into the decays), and moments that are the reference's bias-corrected ones, mu / (1 - b1^t)."""
  cfg = config("opt_type=adam_pax", "steps=6", "warmup_steps_fraction=0.34",
               "learning_rate=0.1", "learning_rate_final_fraction=0.1", *(f"adam_{k}={v}" for k, v in ADAM.items()),
               "gradient_clipping_threshold=1.0")  # fmt: skip
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
  grads_per_step = _grads(rng)
  lrs = [_reference_lr(t, peak=0.1, warmup=2, schedule_steps=6, final=0.1, steps=6) for t in range(6)]
  got_params, got_state = _run_optimizer(cfg, params, grads_per_step)
  want_params, want_mu, want_nu = _reference_adamw(params, grads_per_step, lrs, ADAM, clip=1.0)
  t = len(GRAD_NORMS)
  is_adam = lambda s: isinstance(s, optax.ScaleByAdamState)  # noqa: E731
  (adam_state,) = [s for s in jax.tree_util.tree_leaves(got_state, is_leaf=is_adam) if is_adam(s)]
  for k in params:
    np.testing.assert_allclose(np.asarray(got_params[k], np.float64), want_params[k], rtol=0, atol=1e-6, err_msg=k)
    # Each moment is a float32 sum of terms of either sign up to max |moment|: an entry near 0 carries the
    # rounding of the largest terms, so 1e-6 of the largest entry absolute (float32 is 6e-8 relative).
    mu_hat, nu_hat = want_mu[k] / (1 - ADAM["b1"] ** t), want_nu[k] / (1 - ADAM["b2"] ** t)
    mu_tol, nu_tol = 1e-6 * np.abs(mu_hat).max(), 1e-6 * np.abs(nu_hat).max()
    np.testing.assert_allclose(np.asarray(adam_state.mu[k], np.float64), mu_hat, rtol=1e-5, atol=mu_tol, err_msg=k)
    np.testing.assert_allclose(np.asarray(adam_state.nu[k], np.float64), nu_hat, rtol=1e-5, atol=nu_tol, err_msg=k)


def test_sgd_subtracts_the_learning_rate_times_the_clipped_gradient():
  cfg = config("opt_type=sgd", "steps=6", "warmup_steps_fraction=0.34", "learning_rate=0.1",
               "learning_rate_final_fraction=0.1", "gradient_clipping_threshold=1.0")  # fmt: skip
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32)}
  grads_per_step = _grads(rng)
  lrs = [_reference_lr(t, peak=0.1, warmup=2, schedule_steps=6, final=0.1, steps=6) for t in range(6)]
  want = {k: np.asarray(v, np.float64) for k, v in params.items()}
  for grads, lr in zip(grads_per_step, lrs, strict=True):
    norm = math.sqrt(sum(float(np.sum(np.asarray(g, np.float64) ** 2)) for g in grads.values()))
    scale = 1.0 / norm if norm > 1.0 else 1.0
    want = {k: want[k] - lr * scale * np.asarray(grads[k], np.float64) for k in want}
  got, _ = _run_optimizer(cfg, params, grads_per_step)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0, atol=1e-6, err_msg=k)


# Adafactor's constants (Shazeer & Stern 2018, arXiv:1804.04235) as optax.adafactor's defaults set them, which is
# what opt_type=adafactor uses: eps1 inside the second moment, eps2 the least parameter scale, d the update
# clipping threshold, the decay exponent c of beta2_t = 1 - t^-c, and the least size of both factored axes.
ADAFACTOR = dict(eps1=1e-30, eps2=1e-3, d=1.0, decay_exponent=0.8, min_dim_to_factor=128)


def _reference_adafactor(params, grads_per_step, lrs, *, clip, factored=True):
  """Adafactor (Shazeer & Stern 2018, arXiv:1804.04235, Algorithms 4 and 5) in float64 numpy, as opt_type=adafactor
  configures it (optax.adafactor with its defaults), after MaxText's global-norm clipping at `clip`:

  - second moments decayed by beta2_t = 1 - t^-0.8 (sec. 7.2; t counts from 1, so the first step keeps G^2 alone),
    of G^2 + eps1 (eps1 = 1e-30);
  - factored for a parameter whose two largest axes both have at least 128 entries (optax's rule, as Mesh
    TensorFlow's): row sums R and column sums C over those two axes (the others are a batch of matrices), and
    V = R C^T / (1^T R) (Algorithm 4); any other parameter keeps the full V (Algorithm 5);
  - U = G / sqrt(V), clipped to U / max(1, RMS(U) / d) with d = 1 (sec. 6), RMS over the whole parameter;
  - step size alpha_t = max(eps2, RMS(X_{t-1})) * rho_t (sec. 8, relative step size, eps2 = 1e-3), where rho_t is
    the learning-rate schedule (`lrs`) instead of the paper's min(1e-2, 1/sqrt(t));
  - no first moment (beta1 = 0, sec. 6) and no weight decay.

  factored=False keeps the full V for every parameter (for the test to show that it can tell). Returns the
  parameters after the last step and the number of (step, parameter) updates that the clipping shrank."""
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  moments = {}  # name -> (R, C) of a factored parameter, or its full V
  clipped = 0
  for t, (step_grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
    beta2 = 1.0 - t ** -ADAFACTOR["decay_exponent"]
    grads = _clip_global_norm(step_grads, clip)
    for k, x in params.items():
      g2 = grads[k] ** 2 + ADAFACTOR["eps1"]
      largest = sorted(np.argsort(x.shape, kind="stable")[-2:]) if x.ndim >= 2 else []
      if factored and largest and min(x.shape[i] for i in largest) >= ADAFACTOR["min_dim_to_factor"]:
        g2_m = np.moveaxis(g2, largest, (-2, -1))  # [..., n, m]: a batch of n x m matrices
        r, c = moments.get(k, (0.0, 0.0))
        r = beta2 * r + (1 - beta2) * g2_m.sum(axis=-1)  # R_t: row sums, [..., n]
        c = beta2 * c + (1 - beta2) * g2_m.sum(axis=-2)  # C_t: column sums, [..., m]
        moments[k] = (r, c)
        v = np.moveaxis(r[..., :, None] * c[..., None, :] / r.sum(axis=-1)[..., None, None], (-2, -1), largest)
      else:
        v = beta2 * moments.get(k, 0.0) + (1 - beta2) * g2
        moments[k] = v
      u = grads[k] / np.sqrt(v)
      scale = max(1.0, math.sqrt(float(np.mean(u**2))) / ADAFACTOR["d"])
      clipped += scale > 1.0 and lr > 0
      alpha = max(ADAFACTOR["eps2"], math.sqrt(float(np.mean(x**2)))) * lr
      params[k] = x - alpha * u / scale
  return params, clipped


def test_adafactor_matches_the_published_update_rule_in_float64():
  """Six jitted float32 steps of opt_type=adafactor against _reference_adafactor, on a tree that holds a factored
  matrix (128 x 160), a factored stack of matrices whose two large axes are the first and the last (136 x 2 x 130,
  as a scanned kernel [embed, layers, mlp]), a matrix too small to factor (3 x 4, full second moment) and a
  vector that starts at 0 (as biases do: its step size is eps2 * rho_t), over a warmup (the first update at
  learning rate 0), clipped and unclipped gradients and a zero one.

  Tolerance: each step rounds ~30 float32 operations per entry at ~6e-8 relative (the factored sums over 128-160
  entries add about as much); the parameters are O(1) and move by up to 0.4 in 6 steps, and the largest error
  seen is 6e-7, so 2e-6 absolute. Changing any one constant of the rule (the decay exponent to 0.5 or 1, d to 2,
  eps2 to 1e-2) moves some parameter by 2e-6 or more, and leaving out the factoring moves the matrices by more than
  1e-4 (checked below)."""
  cfg = config("opt_type=adafactor", "steps=6", "warmup_steps_fraction=0.34", "learning_rate=0.1",
               "learning_rate_final_fraction=0.1", "gradient_clipping_threshold=1.0")  # fmt: skip
  rng = np.random.default_rng(0)
  shapes = {"w": (128, 160), "stack": (136, 2, 130), "small": (3, 4), "b": (4,)}
  params = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
  params["b"] = np.zeros(4, np.float32)
  grads_per_step = _scaled_grads(shapes, rng)
  lrs = [_reference_lr(t, peak=0.1, warmup=2, schedule_steps=6, final=0.1, steps=6) for t in range(6)]
  assert lrs[0] == 0.0 and cfg.warmup_steps == 2

  got, _ = _run_optimizer(cfg, params, grads_per_step)
  want, clipped = _reference_adafactor(params, grads_per_step, lrs, clip=1.0)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0, atol=2e-6, err_msg=k)
  assert clipped > 0  # the update clipping (d = 1) acted on some step with a learning rate above 0
  # The test can tell a factored second moment from a full one: without factoring, the matrices end elsewhere.
  full, _ = _reference_adafactor(params, grads_per_step, lrs, clip=1.0, factored=False)
  assert float(np.max(np.abs(full["w"] - want["w"]))) > 1e-4 and np.array_equal(full["small"], want["small"])


def test_muon_orthogonalises_the_matrices_and_leaves_the_rest_to_adamw():
  """The Muon dimension numbers of a scanned deepseek model's parameters (layers and experts are batch axes):
  queries reduce over embed into (heads, head_dim), the attention output over (heads, head_dim) into embed, each
  expert over its input; embeddings, the output head, norms and the routing bias go to AdamW."""
  from optax.contrib import MuonDimensionNumbers as Dims

  cfg = config("model_name=deepseek3-tiny", "max_target_length=32", "opt_type=muon")
  dims = optimizers.muon_dimensions(cfg)
  attention = dims["moe_layers"]["self_attention"]
  assert attention["wq_b"]["kernel"] == Dims(reduction_axis=(1,), output_axis=(2, 3))
  assert attention["wq_a"]["kernel"] == Dims(reduction_axis=(1,), output_axis=(2,))
  assert attention["out"]["kernel"] == Dims(reduction_axis=(1, 2), output_axis=(3,))
  assert dims["moe_layers"]["mlp"]["wi_0"] == Dims(reduction_axis=(2,), output_axis=(3,))
  assert dims["moe_layers"]["mlp"]["wo"] == Dims(reduction_axis=(2,), output_axis=(3,))
  assert dims["dense_layers"]["mlp"]["wo"]["kernel"] == Dims(reduction_axis=(1,), output_axis=(2,))
  for adam in (dims["token_embedder"]["embedding"], dims["logits_dense"]["kernel"], dims["decoder_norm"]["scale"],
               dims["moe_layers"]["mlp"]["gate_bias"], attention["kv_norm"]["scale"]):  # fmt: skip
    assert adam is None


@pytest.mark.parametrize(
  "keys",
  [
    # Three are slow-marked: the NumPy reference tests above check their updates in the quick loop, and Muon's
    # and AdamW's runs here check the resume of a state with several parts (Muon's: its AdamW half too).
    pytest.param(("opt_type=adam_pax",), marks=pytest.mark.slow),
    pytest.param(("opt_type=sgd", "lr_schedule_type=wsd", "wsd_decay_style=cosine"), marks=pytest.mark.slow),
    pytest.param(("opt_type=adafactor",), marks=pytest.mark.slow),
    ("opt_type=muon", "muon_weight_decay=0.01", "muon_consistent_rms=0.2"),
    ("opt_type=adamw", "lr_schedule_type=wsd", "mu_dtype=bfloat16"),
  ],
  ids=["adam_pax", "sgd_wsd", "adafactor", "muon", "adamw_wsd_bf16_mu"],
)
def test_every_optimizer_and_schedule_trains_and_resumes_exactly(keys, tmp_path):
  """6 steps straight, and 3 steps with a checkpoint then a resumed run to 6: the resumed steps' losses and the
  final state (parameters and optimizer state) are bit-identical; the loss goes down."""
  from MaxText import checkpointing, train
  from MaxText.tests.helpers import assert_trees_equal

  common = (*keys, "steps=6", "learning_rate=1e-2", "warmup_steps_fraction=0.2", "learning_rate_schedule_steps=6",
            "per_device_batch_size=2", "max_target_length=32", f"base_output_directory={tmp_path}",
            "enable_checkpointing=true", "async_checkpointing=false", "checkpoint_period=3")  # fmt: skip
  straight = train.train(config(*common, "run_name=straight"), jax.devices()[:1])
  train.train(config(*common, "run_name=resumed", "steps=3"), jax.devices()[:1])
  resumed = train.train(config(*common, "run_name=resumed"), jax.devices()[:1])
  assert resumed.first_step == 3
  assert resumed.losses == [(s, loss) for s, loss in straight.losses if s >= 3]
  losses = [loss for _, loss in straight.losses]
  assert losses[-1] < losses[0]

  def saved(run):  # the whole train state of step 6 as stored: parameters, optimizer state, step
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer().restore(str(tmp_path / run / "checkpoints" / "6" / checkpointing.ITEM))

  assert_trees_equal(saved("resumed"), saved("straight"))


@pytest.mark.parametrize("opt_type", ["muon", "adafactor", "adam_pax"])
@pytest.mark.mesh
def test_sharded_training_equals_one_device(opt_type):
  """fsdp 2 x tensor 2 on 4 devices trains 3 steps to the losses of one device; the optimizer's per-parameter
  state is sharded as its parameter (Adafactor's factored moments, of other shapes, replicated)."""
  from MaxText import step as step_lib
  from MaxText import train

  common = (f"opt_type={opt_type}", "steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "max_target_length=32")
  one = config(*common, "per_device_batch_size=4")
  four = config(*common, "per_device_batch_size=1", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", num_devices=4)
  want = [loss for _, loss in train.train(one, jax.devices()[:1]).losses]
  got = [loss for _, loss in train.train(four, jax.devices()[:4]).losses]
  np.testing.assert_allclose(got, want, rtol=1e-5)

  _, _, _, _, layout = step_lib.build(four, jax.devices()[:4])
  params = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_leaves_with_path(layout.shardings.params)}
  shapes = {jax.tree_util.keystr(p): a.shape for p, a in jax.tree_util.tree_leaves_with_path(layout.abstract.params)}
  matched = 0
  for (path, sharding), leaf in zip(
    jax.tree_util.tree_leaves_with_path(layout.shardings.opt_state),
    jax.tree_util.tree_leaves(layout.abstract.opt_state),
    strict=True,
  ):
    owner = next((k for k in params if jax.tree_util.keystr(path).endswith(k)), None)
    if owner is not None and leaf.shape == shapes[owner]:
      assert sharding.spec == params[owner].spec, jax.tree_util.keystr(path)
      matched += 1
    else:
      assert sharding.is_fully_replicated, jax.tree_util.keystr(path)
  assert matched >= len(params) // 2  # Muon's momentum covers the matrices; Adam's moments every parameter


def test_muon_leaves_biases_and_the_routing_bias_to_adamw_without_decaying_the_bias():
  """GPT-3's 2-D query bias (heads x head_dim) is a bias, not a matrix: AdamW's. And with zero gradients, the
  routing bias keeps its value under Muon (whose AdamW branch decays what it updates) while a kernel decays."""
  small = ("base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4", "head_dim=16", "base_mlp_dim=128")
  gpt_cfg = config("model_name=gpt3-6b", "override_model_config=true", "base_num_decoder_layers=1", *small,
                   "vocab_size=256", "max_target_length=8")  # fmt: skip
  gpt = optimizers.muon_dimensions(gpt_cfg)
  assert gpt["layers"]["self_attention"]["query"]["bias"] is None
  assert gpt["layers"]["self_attention"]["query"]["kernel"] is not None
  cfg = config("model_name=deepseek3-tiny", "max_target_length=32", "opt_type=muon", "learning_rate=0.1",
               "adam_weight_decay=0.5", "warmup_steps_fraction=0", "gradient_clipping_threshold=0")  # fmt: skip
  from flax import linen as nn

  from MaxText.layers import models

  params = nn.meta.unbox(models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 32))["params"])
  params["moe_layers"]["mlp"]["gate_bias"] = jnp.full_like(params["moe_layers"]["mlp"]["gate_bias"], 0.3)
  tx = optimizers.create_optimizer(cfg, optimizers.learning_rate_schedule(cfg))
  updates, _ = tx.update(jax.tree_util.tree_map(jnp.zeros_like, params), tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_array_equal(new["moe_layers"]["mlp"]["gate_bias"], params["moe_layers"]["mlp"]["gate_bias"])
  norm = params["decoder_norm"]["scale"]
  np.testing.assert_allclose(new["decoder_norm"]["scale"], norm * (1 - 0.1 * 0.5), rtol=1e-6)  # AdamW's decay


# Muon's quintic Newton-Schulz coefficients (Jordan et al. 2024), 5 iterations.
NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)


def _newton_schulz(m, eps: float):
  """Jordan et al. 2024's orthogonalisation of one matrix: X = M / (||M||_F + eps), then 5 times
  X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = NEWTON_SCHULZ, on the wide orientation (a tall matrix is
  transposed first and back after), which maps each singular value of M to roughly 0.7-1.2 and keeps its vectors."""
  x = m / (np.linalg.norm(m) + eps)
  tall = x.shape[0] > x.shape[1]
  if tall:
    x = x.T
  a, b, c = NEWTON_SCHULZ
  for _ in range(5):
    gram = x @ x.T
    x = a * x + (b * gram + c * gram @ gram) @ x
  return x.T if tall else x


def _orthogonalised(m, reduction: tuple, output: tuple, eps: float):
  """_newton_schulz on each fan_in x fan_out matrix of `m`: the reduction axes (the input) flattened into rows,
  the output axes into columns, every other axis (stacked layers, experts) a batch of separate matrices."""
  batch = tuple(i for i in range(m.ndim) if i not in reduction + output)
  order = batch + reduction + output
  fan_in, fan_out = math.prod(m.shape[i] for i in reduction), math.prod(m.shape[i] for i in output)
  stacked = np.transpose(m, order).reshape(-1, fan_in, fan_out)
  done = np.stack([_newton_schulz(x, eps) for x in stacked]).reshape([m.shape[i] for i in order])
  return np.transpose(done, np.argsort(order))


def _reference_muon(params, grads_per_step, lrs, dims, *, cfg, clip):
  """Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks",
  kellerjordan.github.io/posts/muon) in float64 numpy, as opt_type=muon configures it, after global-norm clipping:

  - for a matrix (dims[k] = (reduction axes, output axes)): momentum mu_t = beta mu_{t-1} + (1 - beta) g_t
    (beta = muon_beta) used the Nesterov way, m = beta mu_t + (1 - beta) g_t, with each term bias-corrected as
    Adam's (NAdam, Dozat 2016): mu_t / (1 - beta^(t+1)) and g_t / (1 - beta^t); m orthogonalised by the quintic
    Newton-Schulz iteration (_orthogonalised), then scaled by sqrt(max(fan_in, fan_out)) * muon_consistent_rms
    (Liu et al. 2025, arXiv:2502.16982) or, when that is 0, by sqrt(max(1, fan_out / fan_in)) (Jordan's width
    scaling); decoupled weight decay muon_weight_decay * X; the sum times the learning rate;
  - every other parameter (dims[k] None): AdamW (Loshchilov & Hutter 2019) with the adam_* keys, its first moment
    also used the Nesterov way (NAdam), eps adam_eps outside the root and adam_eps_root inside.

  Returns the parameters after the last step."""
  beta, b1, b2 = cfg.muon_beta, cfg.adam_b1, cfg.adam_b2
  params = {k: np.asarray(v, np.float64) for k, v in params.items()}
  mu = {k: np.zeros_like(v) for k, v in params.items()}
  nu = {k: np.zeros_like(v) for k, v in params.items()}
  for t, (step_grads, lr) in enumerate(zip(grads_per_step, lrs, strict=True), start=1):
    grads = _clip_global_norm(step_grads, clip)
    for k, x in params.items():
      g = grads[k]
      if dims[k] is None:
        mu[k] = b1 * mu[k] + (1 - b1) * g
        nu[k] = b2 * nu[k] + (1 - b2) * g**2
        m = b1 * mu[k] / (1 - b1 ** (t + 1)) + (1 - b1) * g / (1 - b1**t)
        direction = m / (np.sqrt(nu[k] / (1 - b2**t) + cfg.adam_eps_root) + cfg.adam_eps)
        params[k] = x - lr * (direction + cfg.adam_weight_decay * x)
        continue
      reduction, output = dims[k]
      mu[k] = beta * mu[k] + (1 - beta) * g
      m = beta * mu[k] / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
      fan_in, fan_out = math.prod(x.shape[i] for i in reduction), math.prod(x.shape[i] for i in output)
      if cfg.muon_consistent_rms > 0:
        scale = math.sqrt(max(fan_in, fan_out)) * cfg.muon_consistent_rms
      else:
        scale = math.sqrt(max(1.0, fan_out / fan_in))
      direction = scale * _orthogonalised(m, reduction, output, cfg.adam_eps)
      params[k] = x - lr * (direction + cfg.muon_weight_decay * x)
  return params


@pytest.mark.parametrize("consistent_rms", [0.2, 0.0])
def test_muon_matches_the_published_update_rule_in_float64(consistent_rms, monkeypatch):
  """Four jitted float32 steps of opt_type=muon against _reference_muon, on the dimension numbers of a stacked
  kernel [layers, embed, mlp] (tall: 8 x 5 per layer, orthogonalised transposed), a query kernel [embed, heads,
  head_dim] (6 x 10, wide), an attention output [heads, head_dim, embed] (12 x 6) and a vector (AdamW's), with
  the consistent-RMS scale (0.2) and the width scale (0), gradients clipped or not.

  Tolerance: the Newton-Schulz iteration multiplies small singular values by up to a = 3.4 per iteration, so the
  float32 path carries about 1e-6 relative error on each orthogonalised entry (6e-7 seen on one step); the
  parameters are O(1), move by 0.05-0.1 in 4 steps, and the largest error seen is 2.4e-7: 1e-6 absolute. The other
  scale rule, or other Newton-Schulz coefficients ((3, -3.2, 1.2)), move the matrices by 8e-3 or more."""
  from optax.contrib import MuonDimensionNumbers as Dims

  cfg = config("opt_type=muon", "learning_rate=0.05", "warmup_steps_fraction=0", "muon_weight_decay=0.1",
               f"muon_consistent_rms={consistent_rms}", "steps=4", "gradient_clipping_threshold=1.0",
               "learning_rate_final_fraction=0.1")  # fmt: skip
  dims = {"stack": ((1,), (2,)), "query": ((0,), (1, 2)), "out": ((0, 1), (2,)), "b": None}
  shapes = {"stack": (3, 8, 5), "query": (6, 2, 5), "out": (4, 3, 6), "b": (5,)}
  optax_dims = {k: None if d is None else Dims(reduction_axis=d[0], output_axis=d[1]) for k, d in dims.items()}
  monkeypatch.setattr(optimizers, "muon_dimensions", lambda config: optax_dims)  # the model's, for this small tree
  rng = np.random.default_rng(0)
  params = {k: rng.standard_normal(shape).astype(np.float32) for k, shape in shapes.items()}
  grads_per_step = [
    {k: (norm * rng.standard_normal(shape)).astype(np.float32) for k, shape in shapes.items()}
    for norm in (1.0, 0.01, 0.3, 2.0)
  ]  # global norms about 11, 0.1, 3.4 and 22: clipped but for the second
  lrs = [_reference_lr(t, peak=0.05, warmup=0, schedule_steps=4, final=0.1, steps=4) for t in range(4)]  # cosine

  got, _ = _run_optimizer(cfg, params, grads_per_step)
  want = _reference_muon(params, grads_per_step, lrs, dims, cfg=cfg, clip=1.0)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=0, atol=1e-6, err_msg=k)
  # The orthogonalised update has the singular values Newton-Schulz gives (~0.7-1.2), not the momentum's.
  step = _orthogonalised(np.asarray(grads_per_step[0]["query"], np.float64), (0,), (1, 2), 1e-8).reshape(6, 10)
  singular = np.linalg.svd(step, compute_uv=False)
  assert np.all((singular > 0.6) & (singular < 1.25)), singular
