"""The RL policy loss (rl/loss.py) against a float64 NumPy reference written token by token from the papers' formulas:
GRPO (Shao et al. 2024, arXiv:2402.03300, eqs. 3-4), GSPO-token (Zheng et al. 2025, arXiv:2507.18071) and DAPO's
clip-higher (Yu et al. 2025, arXiv:2503.14476); the reference's gradient is checked by central finite differences.

Tolerances: float32 against float64 on values of order 1 from a few dozen terms, rtol 1e-5 and atol 1e-6 (float32's
rounding is about 6e-8 per operation); the float64 finite differences (step 1e-6, away from the clip's kinks by at
least 0.01 in log-ratio) are accurate to about 1e-9.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText.objectives import losses as losses_lib
from MaxText.rl import loss as rl_loss

EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.1
RTOL, ATOL = 1e-5, 1e-6
NAMES = ("rl_tokens", "rl_sequences", "rl_kl", "rl_clipped", "rl_ratio", "rl_pg")


def _rollouts():
  """4 completions x 6 positions: lengths 6, 3, 0 and 5; advantages of both signs; log-ratios lp - old chosen so that
  GRPO clips on both sides (and leaves tokens outside the range unclipped where the advantage's sign says so), and
  GSPO-token's sequence ratio is clipped above (row 0), inside (row 1) and clipped below (row 3). Off the mask the
  values are hostile: -inf log-probabilities and differences of 200 that overflow exp."""
  mask = np.array(
    [[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]],
    bool,
  )
  log_ratio = np.array(
    [
      [0.6, 0.5, -0.5, 0.4, 0.3, 0.45],  # A > 0, mean 0.29 > log 1.28: s_i clipped; the -0.5 token unclipped
      [200.0, 0.0, -0.5, 0.1, 0.35, 200.0],  # A < 0, mean -0.017: s_i inside; -0.5 clipped, 0.35 unclipped
      [200.0] * 6,  # no completion token
      [-0.5, -0.4, 0.3, -0.35, -0.3, 200.0],  # A < 0, mean -0.25 < log 0.8: s_i clipped
    ]
  )
  advantages = np.array([1.3, -0.7, 0.5, -1.1])
  rng = np.random.default_rng(0)
  logps = -rng.uniform(0.1, 3.0, mask.shape)
  logps[1, 0] = logps[2, 3] = -np.inf
  old = logps - log_ratio  # -inf - 200: off the mask, lp - old is NaN where lp is -inf
  ref = np.where(mask, logps + rng.uniform(-0.5, 0.5, mask.shape), 200.0)
  # The fixture's promise: every ratio is at least 0.01 in log away from the clip's kinks.
  edges = np.log([1 - EPS, 1 + EPS_HIGH])
  sequence_log_ratio = [log_ratio[i, mask[i]].mean() for i in (0, 1, 3)]
  assert np.abs(np.subtract.outer(log_ratio[mask], edges)).min() > 0.01
  assert np.abs(np.subtract.outer(sequence_log_ratio, edges)).min() > 0.01
  return logps, old, ref, advantages, mask


def _numpy_loss(lp, lp_frozen, rollout, algo, agg, beta):
  """Float64, completion by completion and token by token: (loss, d loss / d lp, sums); rollout = (old, ref,
  advantages, mask).

  The loss is evaluated at `lp`, with GSPO-token's stop-gradients sg(.) evaluated at `lp_frozen` (so finite
  differences in `lp` at lp == lp_frozen give the gradient autodiff gives); the gradient is at lp == lp_frozen.
  """
  old, ref, advantages, mask = rollout
  sums = dict.fromkeys(NAMES, 0.0)
  grad = np.zeros(lp.shape)
  per_sequence = []  # (sum_t l_it, |o_i|, [(t, d l_it / d lp_it)])
  for i in range(lp.shape[0]):
    ts = np.flatnonzero(mask[i])
    if len(ts) == 0:
      continue
    a = advantages[i]
    s_i = np.exp(np.mean(lp_frozen[i, ts] - old[i, ts]))  # GSPO's length-normalised sequence ratio
    total, dl = 0.0, []
    for t in ts:
      if algo == "grpo":  # pi_theta / pi_old of the token
        ratio = np.exp(lp[i, t] - old[i, t])
      else:  # sg(s_i) * pi_theta / sg(pi_theta)
        ratio = s_i * np.exp(lp[i, t] - lp_frozen[i, t])
      clipped_ratio = min(max(ratio, 1 - EPS), 1 + EPS_HIGH)
      unclipped_term, clipped_term = ratio * a, clipped_ratio * a
      pg = -min(unclipped_term, clipped_term)
      # The min's active branch: the clipped one has no gradient (its ratio is a constant outside the range).
      clip_active = clipped_term < unclipped_term
      d_pg = 0.0 if clip_active else -ratio * a
      kl, d_kl = 0.0, 0.0
      if ref is not None:
        kl = np.exp(ref[i, t] - lp[i, t]) - (ref[i, t] - lp[i, t]) - 1
        d_kl = 1 - np.exp(ref[i, t] - lp[i, t])
      total += pg + beta * kl
      dl.append((t, d_pg + beta * d_kl))
      sums["rl_tokens"] += 1
      sums["rl_kl"] += kl
      sums["rl_clipped"] += clip_active
      sums["rl_ratio"] += ratio
      sums["rl_pg"] += pg
    sums["rl_sequences"] += 1
    per_sequence.append((i, total, len(ts), dl))
  n, tokens = sums["rl_sequences"], sums["rl_tokens"]
  loss = 0.0
  for i, total, length, dl in per_sequence:
    weight = {"token-mean": 1 / tokens, "sequence-mean": 1 / n, "sequence-mean-token-mean": 1 / (n * length)}[agg]
    loss += weight * total
    for t, d in dl:
      grad[i, t] = weight * d
  return loss, grad, sums


def _jax_loss(logps, old, ref, advantages, mask, algo, agg, beta=BETA):
  """rl_loss.policy_loss's loss_sum / weight, its gradient w.r.t. logps, and (loss_sum, weight, sums)."""

  def mean_loss(lp):
    loss_sum, weight, sums = rl_loss.policy_loss(
      lp, old, ref, advantages, mask, algo=algo, agg=agg, epsilon=EPS, epsilon_high=EPS_HIGH, beta=beta
    )
    return loss_sum / weight, (loss_sum, weight, sums)

  (loss, parts), grad = jax.value_and_grad(mean_loss, has_aux=True)(logps)
  return loss, grad, parts


def _f32(*arrays):
  return [None if a is None else jnp.asarray(a, jnp.float32) for a in arrays]


CASES = list(itertools.product(rl_loss.ALGOS, rl_loss.AGG_MODES))


@pytest.mark.parametrize("algo,agg", CASES)
@pytest.mark.parametrize("with_reference", [True, False])
def test_loss_and_gradient_equal_numpy(algo, agg, with_reference):
  logps, old, ref, advantages, mask = _rollouts()
  beta = BETA if with_reference else 0.0
  ref = ref if with_reference else None
  rollout = (old, ref, advantages, mask)
  want, want_grad, want_sums = _numpy_loss(logps, logps, rollout, algo, agg, beta)

  # The reference's own gradient, by central differences of its value on the completion tokens (stop-gradients
  # frozen at the point).
  h = 1e-6
  for i, t in np.argwhere(mask):
    up, down = logps.copy(), logps.copy()
    up[i, t] += h
    down[i, t] -= h
    numeric = (
      _numpy_loss(up, logps, rollout, algo, agg, beta)[0] - _numpy_loss(down, logps, rollout, algo, agg, beta)[0]
    ) / (2 * h)
    np.testing.assert_allclose(want_grad[i, t], numeric, rtol=1e-6, atol=1e-8)

  loss, grad, (_, _, sums) = _jax_loss(*_f32(logps, old, ref, advantages), mask, algo, agg, beta)
  np.testing.assert_allclose(loss, want, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(grad, want_grad, rtol=RTOL, atol=ATOL)  # 0 off the mask, -inf positions included
  for name in NAMES:
    np.testing.assert_allclose(sums[name], want_sums[name], rtol=RTOL, atol=ATOL, err_msg=name)
  # The fixture does what it says: clipping on both sides, so the test sees the clip's zero gradients.
  assert want_sums["rl_clipped"] > 0 and np.isfinite(loss) and np.all(np.isfinite(grad))


def test_gspo_token_gradient_is_gspo_sequence_gradient():
  """GSPO's claim (arXiv:2507.18071, on GSPO-token): with one advantage per sequence, GSPO-token's gradient equals
  that of the sequence-level objective -(1/N) sum_i min(s_i A_i, clip(s_i) A_i) with s_i differentiated, no
  stop-gradient anywhere: finite differences of that objective in float64 against the loss's autodiff gradient."""
  logps, old, _, advantages, mask = _rollouts()

  def gspo(lp):
    terms = []
    for i in np.flatnonzero(mask.any(axis=1)):
      s = np.exp(np.mean(lp[i, mask[i]] - old[i, mask[i]]))
      terms.append(-min(s * advantages[i], min(max(s, 1 - EPS), 1 + EPS_HIGH) * advantages[i]))
    return np.mean(terms)

  h, numeric = 1e-6, np.zeros(logps.shape)
  for i, t in np.argwhere(mask):
    up, down = logps.copy(), logps.copy()
    up[i, t] += h
    down[i, t] -= h
    numeric[i, t] = (gspo(up) - gspo(down)) / (2 * h)
  loss, grad, _ = _jax_loss(*_f32(logps, old, None, advantages), mask, "gspo-token", "sequence-mean-token-mean", 0.0)
  np.testing.assert_allclose(loss, gspo(logps), rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(grad, numeric, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("algo,agg", CASES)
@pytest.mark.parametrize("old_of", [jax.lax.stop_gradient, lambda lp: lp], ids=["stop_gradient", "traced"])
def test_on_policy_ratio_is_exactly_one(algo, agg, old_of):
  """num_iterations=1: old = stop_gradient(logps) makes every ratio exactly 1 and the clip inactive; the gradient is
  the plain policy gradient -A_i plus the KL's 1 - exp(ref - lp), weighted by the aggregation. old_logps is a
  constant to the loss: passing logps itself (no stop_gradient) gives the same gradient."""
  logps, _, ref, advantages, mask = _rollouts()
  logps32, ref32, adv32 = _f32(logps, ref, advantages)

  def mean_loss(lp):
    loss_sum, weight, sums = rl_loss.policy_loss(
      lp,
      old_of(lp),
      ref32,
      adv32,
      mask,
      algo=algo,
      agg=agg,
      epsilon=EPS,
      epsilon_high=EPS_HIGH,
      beta=BETA,
    )
    return loss_sum / weight, sums

  (_, sums), grad = jax.value_and_grad(mean_loss, has_aux=True)(logps32)
  assert float(sums["rl_ratio"]) == float(sums["rl_tokens"]) == mask.sum()
  assert float(sums["rl_clipped"]) == 0.0

  lengths = mask.sum(axis=1)
  n = np.count_nonzero(lengths)
  weight = {
    "token-mean": np.full(4, 1 / mask.sum()),
    "sequence-mean": np.full(4, 1 / n),
    "sequence-mean-token-mean": 1 / (n * np.maximum(lengths, 1)),
  }[agg]
  with np.errstate(invalid="ignore", over="ignore"):
    per_token = -advantages[:, None] + BETA * (1 - np.exp(ref - logps))
  want = np.where(mask, weight[:, None] * per_token, 0.0)
  np.testing.assert_allclose(grad, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("algo,agg", CASES)
def test_micro_batches_add_up(algo, agg):
  """Two halves of the rows, their loss_sum, weight and sums added, give the whole batch's."""
  logps, old, ref, advantages, mask = _f32(*_rollouts()[:4]) + [_rollouts()[4]]
  _, _, (whole_sum, whole_weight, whole) = _jax_loss(logps, old, ref, advantages, mask, algo, agg)
  halves = [
    _jax_loss(logps[rows], old[rows], ref[rows], advantages[rows], mask[rows], algo, agg)[2]
    for rows in (slice(0, 2), slice(2, 4))
  ]
  np.testing.assert_allclose(sum(h[0] for h in halves), whole_sum, rtol=1e-6, atol=1e-6)
  assert float(sum(h[1] for h in halves)) == float(whole_weight)
  for name in NAMES:
    np.testing.assert_allclose(sum(h[2][name] for h in halves), whole[name], rtol=1e-6, atol=1e-6, err_msg=name)


def _numpy_log_softmax(logits, num_tokens):
  x = logits.astype(np.float64)[..., :num_tokens]
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("num_tokens", [None, 5])
def test_token_logps_and_entropy_equal_numpy(num_tokens):
  """log_softmax over the first num_tokens ids (the rest of the 7 left out): the values, the gradient of a weighted
  sum (w (one-hot - softmax) on the kept ids, 0 on the others) and the entropy over the masked tokens."""
  rng = np.random.default_rng(1)
  logits = rng.normal(0, 3, (2, 3, 7)).astype(np.float32)
  targets = rng.integers(0, 5, (2, 3))
  w = rng.normal(size=(2, 3))
  mask = np.array([[1, 1, 0], [0, 1, 1]], bool)
  kept = 7 if num_tokens is None else num_tokens

  logp = _numpy_log_softmax(logits, kept)
  want = np.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  want_grad = np.zeros(logits.shape)
  want_grad[..., :kept] = w[..., None] * (np.eye(kept)[targets] - np.exp(logp))
  want_entropy = -np.sum(np.where(mask, np.sum(np.exp(logp) * logp, axis=-1), 0.0))

  got, vjp = jax.vjp(lambda x: losses_lib.token_logps(x, jnp.asarray(targets), num_tokens), jnp.asarray(logits))
  (got_grad,) = vjp(jnp.asarray(w, jnp.float32))
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got_grad, want_grad, rtol=RTOL, atol=ATOL)
  entropy = losses_lib.entropy_sum(jnp.asarray(logits), jnp.asarray(mask), num_tokens)
  np.testing.assert_allclose(entropy, want_entropy, rtol=RTOL, atol=ATOL)
  assert np.all(jax.grad(lambda x: losses_lib.entropy_sum(x, mask, num_tokens))(jnp.asarray(logits)) == 0)


def test_token_outside_vocabulary_has_no_probability():
  logits = jnp.zeros((1, 2, 6))
  got = losses_lib.token_logps(logits, jnp.array([[4, 1]]), num_tokens=4)
  assert got[0, 0] == -jnp.inf
  np.testing.assert_allclose(got[0, 1], -np.log(4), rtol=RTOL)


@pytest.mark.parametrize(
  "kw,match",
  [
    ({"algo": "ppo"}, "loss_algo='ppo'"),
    ({"agg": "mean"}, "loss_agg_mode='mean'"),
    ({"beta": 0.04, "ref": None}, "grpo_beta=0.04"),
  ],
)
def test_bad_settings_are_refused(kw, match):
  logps, old, ref, advantages, mask = _f32(*_rollouts()[:4]) + [_rollouts()[4]]
  settings = {"algo": "grpo", "agg": "token-mean", "epsilon": EPS, "epsilon_high": EPS_HIGH, "beta": BETA, "ref": ref}
  settings.update(kw)
  ref = settings.pop("ref")
  with pytest.raises(ValueError, match=match):
    rl_loss.policy_loss(logps, old, ref, advantages, mask, **settings)
