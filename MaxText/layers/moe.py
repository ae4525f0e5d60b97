"""The mixture-of-experts feed-forward block (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral, Jiang et
al. 2024): a router sends each token to its `num_experts_per_tok` best of `num_experts` gated MLPs and sums their
outputs, weighted by the router.

The experts run one of three ways, which compute the same function (tests):
  - dropless (capacity_factor <= 0 and sparse_matmul, the default): the (token, choice) assignments are sorted by
    expert, each projection is one grouped matmul over the sorted rows (layers/grouped_matmul.py), and the outputs
    are put back in token order. Each device sorts its own tokens
    (shard_map); with expert parallelism (the `expert` mesh axis) the rows travel to the devices holding their
    experts and back: exactly each device's rows by jax.lax.ragged_all_to_all where the backend has it (TPU;
    _ragged_exchange_and_run), else by all-to-all of padded buffers (XLA's CPU; _exchange_and_run).
  - capacity (capacity_factor > 0): each expert takes at most C = ceil(k * length / num_experts * capacity_factor)
    assignments of a sequence, in order of position and then of choice (as MaxText; GShard, Lepikhin et al. 2020,
    serves all first choices first); the rest are dropped (they add nothing to the token's output) and counted
    (logged as learning/moe_dropped_tokens). Dispatch and combine are one-hot einsums.
  - dense (capacity_factor <= 0, sparse_matmul=false): every expert runs on every token and the router weights
    (zero for experts not chosen) combine them: num_experts / k times the FLOPs, the plainest form.

The load-balancing loss (Switch's, as MaxText weights it) is sown as `moe_lb_loss` in the `intermediates`
collection; the losses add its mean over layers (objectives/losses.py, moe_aux). The capacity path also sows
`moe_dropped`, the number of assignments it dropped.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers.grouped_matmul import grouped_matmul
from MaxText.layers.linears import DenseGeneral, MlpBlock, dtypes, gated_activation


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


def route_sigmoid(
  logits_TN: jax.Array, k: int, bias_N: jax.Array | None, groups: int, top_groups: int, renormalize: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """DeepSeek-V3's routing (arXiv:2412.19437, sec. 2.1.2): (weights [T, k], experts [T, k], probs [T, N]), probs
  being the scores normalised to sum to 1 per token (what its balance loss averages, eq. 20).

  Scores are sigmoids of the logits (float32). Experts are chosen by score + bias (the auxiliary-loss-free
  balancing bias, which only steers the choice), among the `top_groups` of `groups` equal groups of experts whose
  two best biased scores sum highest (all experts when groups <= 0). The weights are the chosen experts'
  unbiased scores, renormalised to sum to 1 when `renormalize`.
  """
  scores_TN = jax.nn.sigmoid(logits_TN.astype(jnp.float32))
  # Without a bias or groups the choice goes by the logits, in the sigmoid's order but unsaturated: in float32 the
  # sigmoids of logits above ~16.6 are all exactly 1 and would tie (Llama 4's router takes its top-k of the logits).
  # Groups rank by sums of scores, which the logits' order does not give.
  plain = bias_N is None and groups <= 0
  choice_TN = logits_TN.astype(jnp.float32) if plain else scores_TN + (0.0 if bias_N is None else bias_N.astype(jnp.float32))
  if groups > 0:
    t, n = choice_TN.shape
    best_two = jax.lax.top_k(choice_TN.reshape(t, groups, n // groups), 2)[0]
    _, kept_groups = jax.lax.top_k(jnp.sum(best_two, axis=-1), top_groups)  # [T, top_groups]
    in_kept_TG = jnp.any(jax.nn.one_hot(kept_groups, groups, dtype=jnp.bool_), axis=1)
    choice_TN = jnp.where(jnp.repeat(in_kept_TG, n // groups, axis=1), choice_TN, -jnp.inf)
  _, experts_TK = jax.lax.top_k(choice_TN, k)
  weights_TK = jnp.take_along_axis(scores_TN, experts_TK, axis=-1)
  if renormalize:
    weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
  return weights_TK, experts_TK, scores_TN / jnp.sum(scores_TN, axis=-1, keepdims=True)


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


class ExpertWeights(NamedTuple):
  """The routed experts' weights in the activation dtype: wi [experts, embed, moe_mlp] (one per mlp_activations
  entry) and wo [experts, moe_mlp, embed]; with MoeBlock.use_bias their biases wi_bias ([experts, moe_mlp] each) and
  wo_bias [experts, embed], else None."""

  wi: list[jax.Array]
  wo: jax.Array
  wi_bias: list[jax.Array] | None = None
  wo_bias: jax.Array | None = None


def _plus(y: jax.Array, bias: jax.Array | None) -> jax.Array:
  return y if bias is None else y + bias


def expert_matmul(x: jax.Array, kernel_NIO: jax.Array) -> jax.Array:
  """Each expert's rows times its kernel [experts, in, out]: x [experts, ..., in] -> [experts, ..., out], or x
  [tokens, in], the same rows for every expert (the dense path) -> [experts, tokens, out]. One dot_general, the op
  quantization intercepts (RoutedExperts)."""
  if x.ndim == 2:
    return jnp.moveaxis(jax.lax.dot_general(x, kernel_NIO, (((1,), (1,)), ((), ()))), 1, 0)
  rows = x.reshape(x.shape[0], -1, x.shape[-1])
  y = jax.lax.dot_general(rows, kernel_NIO, (((2,), (1,)), ((0,), (0,))))
  return y.reshape(*x.shape[:-1], kernel_NIO.shape[-1])


class MoeBlock(nn.Module):
  """The MoE feed-forward block, x [batch, length, embed] -> [batch, length, embed]: the router and the routed
  experts, plus `shared_experts` always-on experts (one MLP of shared_experts * moe_mlp_dim, as DeepSeek's).

  Parameters: gate.kernel [embed, experts], and with routed_bias gate.bias [experts] under softmax routing (a bias
  of the router's logits, gpt-oss's) or gate_bias [experts] under sigmoid routing (DeepSeek's, for the choice only);
  wi_i [experts, embed, moe_mlp] (one per mlp_activations entry) and wo [experts, moe_mlp, embed], with `use_bias`
  also wi_i_bias [experts, moe_mlp] and wo_bias [experts, embed] (gpt-oss); shared.* (an MlpBlock) with shared
  experts. `renormalize` is the family's top-k renormalisation (see route).
  """

  config: Config
  mesh: jax.sharding.Mesh | None = None
  renormalize: bool = False
  use_bias: bool = False  # gpt-oss: a bias on each expert's projections
  # Llama 4 (layers/llama4.py): the router's weight scales the chosen expert's input, not its output (one expert per
  # token); the expert's output is then summed as it is.
  scale_expert_inputs: bool = False

  def expert_kernel(self, name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.Array:
    """An [experts, in, out] kernel, LeCun-normal over `in` for each expert (DenseGeneral's init, per expert)."""
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2, batch_axis=(0,))
    return self.param(name, nn.with_logical_partitioning(init, axes), shape, dtypes(self.config)[1])

  def expert_weights(self) -> ExpertWeights:
    """The experts' parameters (see the class), in the activation dtype; weight-only quantized kernels dequantized
    (quantizations.dense)."""
    from MaxText.layers import quantizations  # here: it imports the decoder registry, which imports this module

    cfg = self.config
    dtype, weight_dtype = dtypes(cfg)
    n, e, m, count = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim, len(cfg.mlp_activations)
    wi = [self.expert_kernel(f"wi_{i}", (n, e, m), (ct.EXP, ct.EMBED_NO_EXP, ct.MLP)) for i in range(count)]
    wo = self.expert_kernel("wo", (n, m, e), (ct.EXP, ct.MLP, ct.EMBED_NO_EXP))
    weights = ExpertWeights([quantizations.dense(w, dtype) for w in wi], quantizations.dense(wo, dtype))
    if not self.use_bias:
      return weights

    def bias(name, shape, axes):
      return self.param(name, nn.with_logical_partitioning(nn.initializers.zeros, axes), shape, weight_dtype).astype(dtype)

    wi_bias = [bias(f"wi_{i}_bias", (n, m), (ct.EXP, ct.MLP)) for i in range(count)]
    return weights._replace(wi_bias=wi_bias, wo_bias=bias("wo_bias", (n, e), (ct.EXP, ct.EMBED_NO_EXP)))

  @nn.compact
  def __call__(self, x_BSE: jax.Array) -> jax.Array:
    cfg = self.config
    dtype = dtypes(cfg)[0]
    n, k = cfg.num_experts, cfg.num_experts_per_tok
    b, s, _ = x_BSE.shape
    logit_bias = cfg.routed_bias and cfg.routed_score_func != "sigmoid"  # gpt-oss's router: a linear layer with bias
    gate = DenseGeneral((n,), (ct.EMBED, None), cfg, use_bias=logit_bias, compute_dtype=jnp.float32, name="gate")
    logits_TN = gate(x_BSE).reshape(b * s, n)
    if cfg.routed_score_func == "sigmoid":
      bias = None
      if cfg.routed_bias:  # DeepSeek-V3's e_score_correction_bias: steers the choice, not the weights
        bias = self.param("gate_bias", nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (n,), jnp.float32)
      groups, top_groups = cfg.n_routing_groups, cfg.topk_routing_group
      weights_TK, experts_TK, probs_TN = route_sigmoid(logits_TN, k, bias, groups, top_groups, self.renormalize)
    else:
      weights_TK, experts_TK, probs_TN = route(logits_TN, k, self.renormalize)
    weights_TK = weights_TK * cfg.routed_scaling_factor
    self.sow("intermediates", "moe_lb_loss", load_balance_loss(experts_TK.reshape(b, s, k), probs_TN.reshape(b, s, n), n))
    if cfg.routed_bias and cfg.routed_bias_update_rate > 0:  # the loads the bias update balances (train.py)
      self.sow("intermediates", "moe_expert_counts", jnp.zeros((n,), jnp.int32).at[experts_TK.ravel()].add(1))

    experts = RoutedExperts(cfg, self.mesh, self.scale_expert_inputs, name="experts")
    y, dropped = experts(x_BSE.astype(dtype), weights_TK, experts_TK, self.expert_weights())
    if dropped is not None:
      self.sow("intermediates", "moe_dropped", dropped)
    if cfg.shared_experts > 0:
      y = y + MlpBlock(cfg, self.mesh, mlp_dim=cfg.shared_experts * cfg.moe_mlp_dim, name="shared")(x_BSE)
    y = sharding.constrain(y, (ct.BATCH, ct.LENGTH, ct.ACT_EMBED), self.mesh, cfg)
    return checkpoint_name(y, "mlpwo")


class RoutedExperts(nn.Module):
  """The routed experts of an MoeBlock: its tokens to their experts, the experts' gated MLPs, and their outputs back
  to the tokens, summed with the router's weights (see the module's docstring for the three ways). No parameters of
  its own (MoeBlock passes its weights in): a module so its matmuls have a module path of their own, mlp/experts,
  which quantization (layers/quantizations.py) names. Each expert matmul is a jax.lax.dot_general (expert_matmul,
  the CPU's grouped matmul) or jax.lax.ragged_dot, the ops qwix quantizes; the dispatch and combine products are
  one-hot gathers and weighted sums, jnp.einsum, which quantization leaves alone.

  Weight-only quantized (int8w, int4w), MoeBlock dequantizes its kernels before they come here (quantizations.dense).
  Quantized training, the weights are operands, not parameters, of this module: qwix calibrates them by
  act_quantization_calibration_method, and its ragged_dot (GPU, TPU) by absmax always. The scales are those of what
  each device computes: on the dropless path under a mesh, its own rows and its shard of the weights, so a sharded
  run's experts quantize with other scales than one device's (the CPU's tiles of rows, too: one scale per tile)."""

  config: Config
  mesh: jax.sharding.Mesh | None = None
  scale_expert_inputs: bool = False  # MoeBlock's

  def __call__(self, x_BSE, weights_TK, experts_TK, w: ExpertWeights) -> tuple[jax.Array, jax.Array | None]:
    """(The routed experts' outputs summed with the router's weights, [batch, length, embed]; on the capacity path
    the number of assignments dropped, else None), by the path the config chooses (see the module's docstring). An
    expert's biases (w.wi_bias, w.wo_bias) join its projections on every path, so a dropped assignment adds nothing,
    its bias neither."""
    if self.scale_expert_inputs:  # Llama 4: x * w through the expert, whose output gets weight 1 (top-1 routing)
      x_BSE = x_BSE * weights_TK.reshape(*x_BSE.shape[:2], 1).astype(x_BSE.dtype)
      weights_TK = jnp.ones_like(weights_TK)
    cfg = self.config
    dtype = x_BSE.dtype
    n, k = cfg.num_experts, cfg.num_experts_per_tok
    b, s, e = x_BSE.shape
    if cfg.capacity_factor > 0:
      dispatch_BSKNC, dropped = capacity_masks(experts_TK.reshape(b, s, k), n, expert_capacity(cfg, s))
      combine_BSNC = jnp.einsum("BSKNC,BSK->BSNC", dispatch_BSKNC, weights_TK.reshape(b, s, k)).astype(dtype)
      x_NBCE = jnp.einsum("BSNC,BSE->NBCE", jnp.sum(dispatch_BSKNC, axis=2).astype(dtype), x_BSE)
      per_slot = lambda bias: None if bias is None else bias[:, None, None]  # noqa: E731
      hidden = self.gated(x_NBCE, w, lambda x, k, b: _plus(expert_matmul(x, k), per_slot(b)))
      y_NBCE = _plus(expert_matmul(hidden, w.wo), per_slot(w.wo_bias))
      return jnp.einsum("NBCE,BSNC->BSE", y_NBCE, combine_BSNC), dropped
    x_TE = x_BSE.reshape(b * s, e)
    if not cfg.sparse_matmul:
      gates_TN = jnp.sum(jax.nn.one_hot(experts_TK, n, dtype=jnp.float32) * weights_TK[..., None], axis=1)
      per_token = lambda bias: None if bias is None else bias[:, None]  # noqa: E731
      hidden = self.gated(x_TE, w, lambda x, k, b: _plus(expert_matmul(x, k), per_token(b)))
      y_NTE = _plus(expert_matmul(hidden, w.wo), per_token(w.wo_bias))
      return jnp.einsum("NTE,TN->TE", y_NTE, gates_TN.astype(dtype)).reshape(b, s, e), None
    weights_BSK, experts_BSK = weights_TK.reshape(b, s, k), experts_TK.reshape(b, s, k)
    y_BSE = self.dropless(x_BSE, weights_BSK, experts_BSK, w._replace(wo_bias=None))
    if w.wo_bias is None:
      return y_BSE, None
    # sum_k weight_k * wo_bias[expert_k], added here rather than per sorted row: under tensor parallelism each
    # device's rows give a partial sum over its moe_mlp shard, and a bias added there would be summed once per shard.
    bias_BSKE = jnp.take(w.wo_bias, experts_BSK, axis=0)
    return y_BSE + jnp.einsum("BSK,BSKE->BSE", weights_BSK.astype(dtype), bias_BSKE), None

  def dropless(self, x_BSE, weights_BSK, experts_BSK, w: ExpertWeights) -> jax.Array:
    """The dropless path on each device's tokens (under shard_map when there is a mesh): its (token, choice)
    assignments sorted by expert, grouped matmuls, back to token order. With expert parallelism, each device holds
    num_experts / ep experts, and the sorted rows go to the devices holding their experts and come back over the
    expert axis (by ragged_all_to_all on TPU, by padded all-to-all elsewhere; see DevicePlan); with tensor
    parallelism, the partial sums over the moe_mlp shards are added.
    `w` has no wo_bias (__call__ adds it)."""
    from MaxText.layers import quantizations  # here: it imports the decoder registry, which imports this module

    cfg, mesh = self.config, self.mesh
    platform = jax.default_backend() if mesh is None else mesh.devices.flat[0].platform
    plan = DevicePlan(cfg, self.gated, platform, quantized=quantizations.quantizes(cfg, "moe"))
    if mesh is None:
      return plan(x_BSE, weights_BSK, experts_BSK, w)
    # Token dimensions that do not split evenly (a decode step's length of 1 over sequence shards) stay whole.
    token_spec = _fitting(sharding.logical_to_mesh_spec((ct.BATCH, ct.LENGTH, None), cfg), x_BSE.shape, mesh)
    wi_spec = sharding.logical_to_mesh_spec((ct.EXP, None, ct.MLP), cfg)
    wo_spec = sharding.logical_to_mesh_spec((ct.EXP, ct.MLP, None), cfg)
    bias_spec = sharding.logical_to_mesh_spec((ct.EXP, ct.MLP), cfg)
    count = len(w.wi)
    w_spec = ExpertWeights([wi_spec] * count, wo_spec, None if w.wi_bias is None else [bias_spec] * count, None)
    exp_axes, mlp_axes = _axes(wi_spec[0]), _axes(wi_spec[2])
    plan = dataclasses.replace(plan, exp_axes=exp_axes, ep=math.prod(mesh.shape[a] for a in exp_axes), mlp_axes=mlp_axes)
    sharded = jax.shard_map(
      plan,
      mesh=mesh,
      in_specs=(token_spec, token_spec, token_spec, w_spec),
      out_specs=token_spec,
      check_vma=False,
    )
    return sharded(x_BSE, weights_BSK, experts_BSK, w)

  def gated(self, x, w: ExpertWeights, project):
    """The experts' gated hidden layer (linears.gated_activation: SwiGLU for [silu, linear]) of the input
    projections project(x, wi_i, wi_bias_i or None), which add the bias where there is one."""
    biases = w.wi_bias or [None] * len(w.wi)
    return gated_activation([project(x, k, b) for k, b in zip(w.wi, biases, strict=True)], self.config)


def _axes(spec_entry) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
  if spec_entry is None:
    return ()
  return tuple(spec_entry) if isinstance(spec_entry, tuple) else (spec_entry,)


def _fitting(spec: PartitionSpec, shape: tuple[int, ...], mesh) -> PartitionSpec:
  """`spec` with the entries whose mesh axes do not divide their dimension of `shape` dropped (left whole)."""
  entries = [e if shape[i] % math.prod(mesh.shape[a] for a in _axes(e)) == 0 else None for i, e in enumerate(spec)]
  return PartitionSpec(*entries)


@dataclasses.dataclass(frozen=True)
class DevicePlan:
  """One device's dropless MoE (see MoeBlock.dropless), as called under shard_map: wi and wo hold the experts of
  this device's shard of the `ep` shards over `exp_axes` (all of them when ep is 1), and its shard of moe_mlp
  over `mlp_axes`."""

  config: Config
  gated: Callable  # RoutedExperts.gated
  platform: str  # the devices' platform, which picks the grouped matmul
  quantized: bool = False  # quantized training reaches the experts (grouped_matmul takes a form qwix intercepts)
  exp_axes: tuple[str, ...] = ()
  ep: int = 1
  mlp_axes: tuple[str, ...] = ()

  def __call__(self, x_BSE, weights_BSK, experts_BSK, w: ExpertWeights) -> jax.Array:
    """Tokens x [b, s, embed] with their router weights and experts [b, s, k] -> [b, s, embed]; `w` without wo_bias."""
    b, s, e = x_BSE.shape
    k = experts_BSK.shape[-1]
    experts_A = experts_BSK.reshape(-1)  # assignment a = t * k + j: token t's j-th choice
    order_A = jnp.argsort(experts_A, stable=True)  # by expert; tokens keep their order within one
    sizes_N = jnp.bincount(experts_A, length=self.config.num_experts).astype(jnp.int32)
    x_AE = jnp.take(x_BSE.reshape(b * s, e), order_A // k, axis=0)

    ragged = self.ep > 1 and self.platform in RAGGED_EXCHANGE_PLATFORMS

    def experts_ffn(rows, group_sizes, w):
      # The exact-size exchange gives zeros past the received rows and reads only those rows back (and their
      # gradients), so the grouped matmuls need not zero the rest.
      matmul = functools.partial(
        grouped_matmul,
        platform=self.platform,
        megablox=self.config.megablox,
        quantized=self.quantized,
        rest_unread=ragged,
      )
      if w.wi_bias is not None:  # each sorted row's expert, by the group sizes; rows past them get none (below)
        expert_R = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows.shape[0]), side="right")

      def project(x, kernel, bias):
        # Rows past the groups take a bias of zero (their expert index is out of range): the take's gradient, a
        # scatter-add over the rows, then drops their cotangents, which the matmuls above leave undefined when
        # rest_unread (NaN in megablox's interpret mode) and which would otherwise reach the last expert's bias.
        y = matmul(x, kernel, group_sizes)
        return y if bias is None else y + jnp.take(bias, expert_R, axis=0, mode="fill", fill_value=0)

      return matmul(self.gated(rows, w, project), w.wo, group_sizes)

    if self.ep == 1:
      y_AE = experts_ffn(x_AE, sizes_N, w)
    elif ragged:
      y_AE = _ragged_exchange_and_run(x_AE, sizes_N, ExchangeSetup(self.ep, self.exp_axes, k), experts_ffn, w)
    else:
      ffn = functools.partial(experts_ffn, w=w)
      y_AE = _exchange_and_run(x_AE, jnp.take(experts_A, order_A), sizes_N, self.ep, self.exp_axes, ffn)
    y_TKE = jnp.take(y_AE, jnp.argsort(order_A), axis=0).reshape(b * s, k, e)
    y_TE = jnp.einsum("TKE,TK->TE", y_TKE, weights_BSK.reshape(b * s, k).astype(y_TKE.dtype))
    if self.mlp_axes:  # each device holds a shard of moe_mlp: its wo gives a partial sum
      y_TE = jax.lax.psum(y_TE, self.mlp_axes)
    return y_TE.reshape(b, s, e)


# The platforms whose XLA backend compiles jax.lax.ragged_all_to_all, where expert parallelism exchanges exactly the
# rows each device routes (_ragged_exchange_and_run). XLA's CPU backend has none ("HLO opcode `ragged-all-to-all` is
# not supported by XLA:CPU"), so there the padded exchange runs (_exchange_and_run).
RAGGED_EXCHANGE_PLATFORMS = ("tpu",)


def _exchange_and_run(x_AE, experts_A, sizes_N, ep, exp_axes, experts_ffn):
  """Expert parallelism without ragged_all_to_all: this device's rows x [A, embed], sorted by expert (experts_A), go
  to the device holding their expert by all-to-all over exp_axes; each device runs its num_experts / ep experts on
  what it received and the outputs come back the same way. Buffers are padded to A rows per device pair (all of a
  device's rows may go to one expert shard), so shapes are static: each device sends and receives ep * A rows, of
  which about A are real. Megablox skips the padding rows; the CPU's tiled matmul computes them too (ep times the
  FLOPs)."""
  rows, e = x_AE.shape
  local = sizes_N.shape[0] // ep
  sizes_DL = sizes_N.reshape(ep, local)  # rows for destination shard d's local expert l
  per_dest_D = jnp.sum(sizes_DL, axis=1)
  start_D = jnp.cumsum(per_dest_D) - per_dest_D
  slot = jnp.arange(rows)
  send_idx = jnp.minimum(start_D[:, None] + slot[None], rows - 1)
  send = jnp.where((slot[None] < per_dest_D[:, None])[..., None], jnp.take(x_AE, send_idx, axis=0), 0)  # [ep, A, E]
  recv = jax.lax.all_to_all(send, exp_axes, 0, 0)  # recv[src]: src's rows for this shard's experts, by expert
  recv_sizes_SL = jax.lax.all_to_all(sizes_DL, exp_axes, 0, 0)  # [src, local expert]
  # Regroup the received rows by local expert (sources in order within each); padding rows go last.
  ends_SL = jnp.cumsum(recv_sizes_SL, axis=1)
  expert_of = jax.vmap(lambda ends: jnp.searchsorted(ends, slot, side="right"))(ends_SL)  # [src, A]; local = padding
  order = jnp.argsort(expert_of.reshape(-1), stable=True)
  y_sorted = experts_ffn(jnp.take(recv.reshape(ep * rows, e), order, axis=0), jnp.sum(recv_sizes_SL, axis=0))
  y_recv = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(ep, rows, e)
  back = jax.lax.all_to_all(y_recv, exp_axes, 0, 0)  # back[d]: outputs of the rows this device sent to shard d
  dest_A = experts_A // local
  return back[dest_A, slot - start_D[dest_A]]


class ExchangePlan(NamedTuple):
  """One device's part of the exact-size exchange (_ragged_exchange_and_run), in ragged_all_to_all's terms. Slice
  (d, l), d = 0 ... ep - 1 and l = 0 ... local - 1, flattened d-major: on the send side, this device's rows for
  local expert l of shard d; on the receive side, the rows source shard d sends for this shard's local expert l.

  input_offsets, send_sizes [ep * local]: where slice (d, l) starts in this device's rows sorted by expert, and its
    rows (the global experts are d * local + l, so sorted by expert is sorted by destination, then local expert).
  recv_offsets, recv_sizes [ep * local]: where source d's rows for local expert l land in this device's receive
    buffer, and how many there are: grouped by local expert, sources in order within each (as the padded exchange
    regroups them), so the received rows are already sorted by local expert.
  group_sizes [local]: the received rows of each local expert, for the grouped matmuls.

  ragged_all_to_all takes the output offsets of the slices a device sends, in the receivers' frames: the receivers'
  recv_offsets, exchanged by an all-to-all (there) and back (the outputs' return goes to input_offsets)."""

  input_offsets: jax.Array
  send_sizes: jax.Array
  recv_offsets: jax.Array
  recv_sizes: jax.Array
  group_sizes: jax.Array


def exchange_plan(sizes_DL: jax.Array, recv_SL: jax.Array) -> ExchangePlan:
  """The plan (see ExchangePlan) from this device's rows per destination shard and local expert sizes_DL [ep, local]
  and the rows it receives from each source shard for each of its local experts recv_SL [ep, local] (the
  all-to-all of every device's sizes_DL)."""
  send = sizes_DL.reshape(-1).astype(jnp.int32)
  group_sizes_L = jnp.sum(recv_SL, axis=0).astype(jnp.int32)
  group_start_L = jnp.cumsum(group_sizes_L) - group_sizes_L
  recv_offsets_SL = group_start_L[None] + jnp.cumsum(recv_SL, axis=0) - recv_SL
  return ExchangePlan(
    jnp.cumsum(send) - send,
    send,
    recv_offsets_SL.reshape(-1).astype(jnp.int32),
    recv_SL.reshape(-1).astype(jnp.int32),
    group_sizes_L,
  )


def receive_rows(rows: int, k: int, ep: int, local: int) -> int:
  """The receive buffer's rows for `rows` = tokens * k routed rows per device, when each shard receives the rows of
  `local` of its experts: the most it can receive. A token's k choices are distinct experts (top-k), so it sends
  at most min(k, local) rows to one shard, and each of the ep devices sends its tokens' rows (all of them, when
  local >= k: ep * rows)."""
  return ep * (rows // k) * min(k, local)


# The receive buffer's rows at most this many times the device's own routed rows: what one exchange needs at ep = 8
# with k >= 8 (DeepSeek-V3 on a v5p-512 fits so); beyond it the exchange runs in rounds (exchange_rounds).
RECEIVE_BUDGET = 8


def exchange_rounds(rows: int, k: int, ep: int, local: int) -> int:
  """The fewest rounds, a divisor of `local`, that keep each round's receive buffer (receive_rows of its
  local / rounds experts) within RECEIVE_BUDGET * rows; `local` rounds (one expert each, ep * tokens rows) when
  none does. One round is one exchange."""
  for rounds in range(1, local + 1):
    if local % rounds == 0 and receive_rows(rows, k, ep, local // rounds) <= RECEIVE_BUDGET * rows:
      return rounds
  return local


class ExchangeSetup(NamedTuple):
  """What the exact-size exchange needs besides the rows: the expert shards (ep over the mesh axes exp_axes) and k,
  the experts each token chooses (which bounds what one shard can receive)."""

  ep: int
  exp_axes: tuple[str, ...]
  k: int


def _ragged_exchange_and_run(x_AE, sizes_N, setup: ExchangeSetup, experts_ffn, w):
  """Expert parallelism by jax.lax.ragged_all_to_all: this device's rows x [A, embed], sorted by expert, go to the
  shards holding their experts, exactly A rows sent, one (d, l) slice per destination shard and local expert, so
  they arrive grouped by local expert (ExchangePlan); each device runs its local experts on them,
  experts_ffn(rows, group_sizes, w) with `w` the weights of those experts (leading dimension local), and the
  outputs return by a second ragged_all_to_all into exactly A rows, in x's order. JAX transposes ragged_all_to_all
  into the reverse ragged_all_to_all, so the backward pass exchanges the same sizes.

  The receive buffer, and the experts' activations on it, have a static size: the worst case, receive_rows (ep * A
  when a shard holds k experts or more), of which only the rows received are filled (megablox skips the rest).
  Where that exceeds RECEIVE_BUDGET * A (DeepSeek-V3 at ep = 32: 14 GiB per buffer and layer, a dozen such buffers
  in the step), the local experts are exchanged and run in exchange_rounds rounds of local / rounds experts each
  (a scan), each round's buffer bounded by its own experts. Each round is rematerialised in the backward pass
  (jax.checkpoint: its exchange and matmuls run again), so what stays live is one round's buffers, not all of
  them: dropless still, for the cost of one more forward exchange and expert pass per layer."""
  ep, exp_axes, k = setup
  rows, e = x_AE.shape
  local = sizes_N.shape[0] // ep
  rounds = exchange_rounds(rows, k, ep, local)
  per_round = local // rounds
  sizes_DL = sizes_N.reshape(ep, local)
  recv_SL = jax.lax.all_to_all(sizes_DL, exp_axes, 0, 0)
  starts_DL = (jnp.cumsum(sizes_N) - sizes_N).reshape(ep, local).astype(jnp.int32)

  def by_round(a_DL):  # [ep, local] -> [rounds, ep, per_round]: round r's experts are r * per_round ...
    return jnp.moveaxis(a_DL.reshape(ep, rounds, per_round), 1, 0)

  def frames(offsets):  # each peer's offsets of its slices with this device, in its own frame
    return jax.lax.all_to_all(offsets.reshape(ep, -1), exp_axes, 0, 0).reshape(-1)

  def one_round(y_AE, round_inputs):
    sizes_DG, starts_DG, recv_SG, w_round = round_inputs
    plan = exchange_plan(sizes_DG, recv_SG)._replace(input_offsets=starts_DG.reshape(-1))
    recv = jnp.zeros((receive_rows(rows, k, ep, per_round), e), x_AE.dtype)
    recv = jax.lax.ragged_all_to_all(
      x_AE, recv, plan.input_offsets, plan.send_sizes, frames(plan.recv_offsets), plan.recv_sizes, axis_name=exp_axes
    )
    y_recv = experts_ffn(recv, plan.group_sizes, w_round)
    # Into a buffer of zeros, summed: the round's rows only (ragged_all_to_all's transpose for its `output` operand
    # is not relied on).
    back = jax.lax.ragged_all_to_all(
      y_recv, jnp.zeros_like(x_AE), plan.recv_offsets, plan.recv_sizes, frames(plan.input_offsets), plan.send_sizes,
      axis_name=exp_axes,
    )  # fmt: skip
    return y_AE + back, None

  w_R = jax.tree.map(lambda a: a.reshape(rounds, per_round, *a.shape[1:]), w)
  inputs = (by_round(sizes_DL), by_round(starts_DL), by_round(recv_SL), w_R)
  if rounds == 1:
    return one_round(jnp.zeros_like(x_AE), jax.tree.map(lambda a: a[0], inputs))[0]
  return jax.lax.scan(jax.checkpoint(one_round, prevent_cse=False), jnp.zeros_like(x_AE), inputs)[0]
