"""The mixture-of-experts feed-forward block (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et
al. 2024): a router sends each token to its `num_experts_per_tok` best of `num_experts` gated MLPs and sums their
outputs, weighted by the router.

The experts run one of three ways, which compute the same function (tests):
  - dropless (capacity_factor <= 0 and sparse_matmul, the default): the (token, choice) assignments are sorted by
    expert, each projection is one grouped matmul over the sorted rows (jax.lax.ragged_dot), and the outputs are
    put back in token order. FLOPs are those of the chosen experts only.
  - capacity (capacity_factor > 0): each expert takes at most C = ceil(k * length / num_experts * capacity_factor)
    assignments of a sequence, in order of position and then of choice (GShard, Lepikhin et al. 2020); the rest
    are dropped (they add nothing to the token's output) and counted. Dispatch and combine are one-hot einsums.
  - dense (capacity_factor <= 0, sparse_matmul=false): every expert runs on every token and the router weights
    (zero for experts not chosen) combine them: num_experts / k times the FLOPs, the plainest form.

The load-balancing loss (Switch's, as MaxText weights it) is sown as `moe_lb_loss` in the `intermediates`
collection; train.loss_fn adds its mean over layers to the loss. The capacity path also sows `moe_dropped`, the
number of assignments it dropped.
"""

import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers.linears import ACTIVATIONS, DenseGeneral, MlpBlock, dtypes


def route(logits_TN: jax.Array, k: int, renormalize: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Softmax top-k routing (Mixtral, Qwen3-MoE): (weights [T, k] float32, experts [T, k] int32, probs [T, N]).

  probs is the softmax over all experts in float32; weights are the k largest, renormalised to sum to 1 when
  `renormalize` (Mixtral always; Qwen3-MoE's norm_topk_prob). Ties go to the lower expert index (lax.top_k).
  """
  probs_TN = jax.nn.softmax(logits_TN.astype(jnp.float32), axis=-1)
  weights_TK, experts_TK = jax.lax.top_k(probs_TN, k)
  if renormalize:
    weights_TK = weights_TK / jnp.sum(weights_TK, axis=-1, keepdims=True)
  return weights_TK, experts_TK, probs_TN


def load_balance_loss(experts_BSK: jax.Array, probs_BSN: jax.Array, num_experts: int) -> jax.Array:
  """Switch Transformer's auxiliary loss N * sum_i f_i * P_i (Fedus et al. 2021, eq. 4), per sequence and then
  averaged over the batch, as MaxText computes it: f_i is the number of assignments to expert i per token (they
  sum to k), P_i the mean router probability of expert i. A uniform router gives exactly k."""
  density_BN = jnp.mean(jnp.sum(jax.nn.one_hot(experts_BSK, num_experts, dtype=jnp.float32), axis=2), axis=1)
  density_prob_BN = jnp.mean(probs_BSN, axis=1)
  return num_experts * jnp.mean(jnp.sum(density_BN * density_prob_BN, axis=-1))


def expert_capacity(config: Config, length: int) -> int:
  """Assignments each expert takes per sequence under capacity_factor > 0 (at least 1)."""
  k, n = config.num_experts_per_tok, config.num_experts
  return max(1, math.ceil(k * length / n * config.capacity_factor))


def capacity_masks(experts_BSK: jax.Array, num_experts: int, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(dispatch [B, S, K, N, C] float32 one-hot of the slot each kept assignment takes, dropped [] int32).

  An assignment's slot is its rank among the sequence's assignments to the same expert, counted in order of
  position and then of choice; slots >= capacity are dropped.
  """
  b, s, k = experts_BSK.shape
  assigned = jax.nn.one_hot(experts_BSK, num_experts, dtype=jnp.int32).reshape(b, s * k, num_experts)
  slot = (jnp.cumsum(assigned, axis=1) - 1) * assigned - (1 - assigned)  # -1 where not assigned
  slot = slot.reshape(b, s, k, num_experts)
  dropped = jnp.sum(slot >= capacity)
  return jax.nn.one_hot(slot, capacity, dtype=jnp.float32), dropped  # one_hot of -1 or >= capacity is all zeros


class MoeBlock(nn.Module):
  """The MoE feed-forward block, x [batch, length, embed] -> [batch, length, embed]: the router and the routed
  experts, plus `shared_experts` always-on experts (one MLP of shared_experts * moe_mlp_dim, as DeepSeek's).

  Parameters: gate.kernel [embed, experts]; wi_i [experts, embed, moe_mlp] (one per mlp_activations entry) and
  wo [experts, moe_mlp, embed]; shared.* (an MlpBlock) with shared experts. `renormalize` is the family's top-k
  renormalisation (see route).
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  renormalize: bool = False

  def expert_kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
    """An [experts, in, out] kernel, LeCun-normal over `in` for each expert (DenseGeneral's init, per expert)."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=(0,))
    return self.param(name, nn.with_logical_partitioning(init, axes), shape, dtypes(self.config)[1])

  @nn.compact
  def __call__(self, x_BSE: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = dtypes(cfg)[0]
    n, k, e, m = cfg.num_experts, cfg.num_experts_per_tok, cfg.emb_dim, cfg.moe_mlp_dim
    b, s, _ = x_BSE.shape
    logits_BSN = DenseGeneral((n,), (ct.EMBED, None), cfg, name="gate")(x_BSE)
    weights_TK, experts_TK, probs_TN = route(logits_BSN.reshape(b * s, n), k, self.renormalize)
    weights_TK = weights_TK * cfg.routed_scaling_factor
    self.sow("intermediates", "moe_lb_loss", load_balance_loss(experts_TK.reshape(b, s, k), probs_TN.reshape(b, s, n), n))

    wi = [
      self.expert_kernel(f"wi_{i}", (n, e, m), (ct.EXP, ct.EMBED_NO_EXP, ct.MLP)) for i in range(len(cfg.mlp_activations))
    ]
    wo = self.expert_kernel("wo", (n, m, e), (ct.EXP, ct.MLP, ct.EMBED_NO_EXP))
    wi, wo = [w.astype(dtype) for w in wi], wo.astype(dtype)
    y = self.experts(x_BSE.astype(dtype), weights_TK, experts_TK, wi, wo)
    if cfg.shared_experts > 0:
      y = y + MlpBlock(cfg, self.mesh, mlp_dim=cfg.shared_experts * cfg.moe_mlp_dim, name="shared")(x_BSE)
    y = sharding.constrain(y, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), self.mesh, cfg)
    return checkpoint_name(y, "mlpwo")

  def experts(self, x_BSE, weights_TK, experts_TK, wi, wo) -> jax.Array:
    """The routed experts' outputs summed with the router's weights, [batch, length, embed]: by the path the
    config chooses (see the module's docstring)."""
    cfg = self.config
    dtype = x_BSE.dtype
    n, k = cfg.num_experts, cfg.num_experts_per_tok
    b, s, e = x_BSE.shape
    if cfg.capacity_factor > 0:
      dispatch_BSKNC, dropped = capacity_masks(experts_TK.reshape(b, s, k), n, expert_capacity(cfg, s))
      self.sow("intermediates", "moe_dropped", dropped)
      combine_BSNC = jnp.einsum("BSKNC,BSK->BSNC", dispatch_BSKNC, weights_TK.reshape(b, s, k)).astype(dtype)
      x_NBCE = jnp.einsum("BSNC,BSE->NBCE", jnp.sum(dispatch_BSKNC, axis=2).astype(dtype), x_BSE)
      hidden = self.gated(x_NBCE, wi, lambda x, w: jnp.einsum("NBCE,NEM->NBCM", x, w))
      y_NBCE = jnp.einsum("NBCM,NME->NBCE", hidden, wo)
      return jnp.einsum("NBCE,BSNC->BSE", y_NBCE, combine_BSNC)
    x_TE = x_BSE.reshape(b * s, e)
    if not cfg.sparse_matmul:
      gates_TN = jnp.sum(jax.nn.one_hot(experts_TK, n, dtype=jnp.float32) * weights_TK[..., None], axis=1)
      hidden = self.gated(x_TE, wi, lambda x, w: jnp.einsum("TE,NEM->NTM", x, w))
      y_NTE = jnp.einsum("NTM,NME->NTE", hidden, wo)
      return jnp.einsum("NTE,TN->TE", y_NTE, gates_TN.astype(dtype)).reshape(b, s, e)
    # Dropless: assignment a = t * k + j (token t's j-th choice); sorted by expert, stable so tokens keep order.
    order_A = jnp.argsort(experts_TK.reshape(-1), stable=True)
    group_sizes_N = jnp.bincount(experts_TK.reshape(-1), length=n).astype(jnp.int32)
    x_AE = jnp.take(x_TE, order_A // k, axis=0)
    hidden = self.gated(x_AE, wi, lambda x, w: jax.lax.ragged_dot(x, w, group_sizes_N))
    y_AE = jax.lax.ragged_dot(hidden, wo, group_sizes_N)
    y_TKE = jnp.take(y_AE, jnp.argsort(order_A), axis=0).reshape(b * s, k, e)
    return jnp.einsum("TKE,TK->TE", y_TKE, weights_TK.astype(dtype)).reshape(b, s, e)

  def gated(self, x, wi, project):
    """prod_i act_i(project(x, wi_i)): the experts' gated hidden layer (SwiGLU for [silu, linear])."""
    hidden = None
    for w, act in zip(wi, self.config.mlp_activations, strict=True):
      h = ACTIVATIONS[act](checkpoint_name(project(x, w), "mlpwi"))
      hidden = h if hidden is None else hidden * h
    return hidden
