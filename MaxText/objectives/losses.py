"""What the objectives' losses share: the model's forward pass on a batch (the policy's, and the reference model's
without gradient), the cross-entropy in float32 with a fused gradient (and its tiled form for a
large vocabulary), log-probabilities and entropy of the tokens over the tokenizer's vocabulary, the summed
log-probability of each sequence of a packed batch, and a mixture of experts' additions to a loss (its
load-balancing term, dropped assignments and expert counts).

Every loss returns sums, not means, with their weight: micro-batches then add up to exactly the full batch's loss.
"""

import jax
import jax.numpy as jnp
from flax import traverse_util

from MaxText import lora
from MaxText.common_types import Config
from MaxText.layers import models, quantizations


def forward(model, params, batch, dropout_rng=None, *, deterministic=False, return_hidden=False):
  """The model on a batch's inputs, inputs_segmentation and inputs_position [B, L]: (logits [B, L, vocab], or with
  return_hidden the last hidden states [B, L, embed]; what the layers sowed). No dropout without dropout_rng."""
  return model.apply(
    {"params": params},
    batch["inputs"],
    batch["inputs_segmentation"],
    batch["inputs_position"],
    deterministic=deterministic,
    rngs={} if dropout_rng is None else {"dropout": dropout_rng},
    return_hidden=return_hidden,
    mutable=["intermediates"],
  )


def reference_logits(model, params, reference_params, batch) -> jax.Array:
  """The reference model's logits on a batch, without dropout and under stop_gradient: `reference_params`, or under
  LoRA (None) the policy `params` with the adapters off (the base model)."""
  if reference_params is None:
    reference_params = lora.adapters_off(params)
  logits, _ = forward(model, jax.lax.stop_gradient(reference_params), batch, deterministic=True)
  return jax.lax.stop_gradient(logits)


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Per-token cross-entropy in float32 of logits [..., vocab] (any float dtype) and integer targets [...].

  The value of optax.softmax_cross_entropy_with_integer_labels(logits.astype(float32), targets), with its
  gradient (softmax - one-hot) written by one fused pass in the logits' dtype instead of autodiff's chain of
  float32 temporaries over [tokens, vocab], the step's largest tensor (measured in docs/changelog.md, "Two
  simulated CPU devices").
  """
  return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
  peak = jnp.max(logits, axis=-1).astype(jnp.float32)  # Exact in any dtype.
  lse = peak + jnp.log(jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak[..., None]), axis=-1))
  label_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0].astype(jnp.float32)
  return lse - label_logit, (logits, targets, lse)


def _cross_entropy_bwd(residuals, g):
  logits, targets, lse = residuals
  vocab = jax.lax.broadcasted_iota(targets.dtype, logits.shape, logits.ndim - 1)
  softmax = jnp.exp(logits.astype(jnp.float32) - lse[..., None])
  dlogits = (softmax - (vocab == targets[..., None])) * g[..., None]
  return dlogits.astype(logits.dtype), None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def token_logps(logits: jax.Array, targets: jax.Array, num_tokens: int | None = None) -> jax.Array:
  """log_softmax(logits)[targets] in float32: logits [B, L, vocab] (any float dtype), targets [B, L] -> [B, L].

  Only the first num_tokens vocabulary ids count (the tokenizer's; the output head's padding ids are tokens the
  sampler never draws, and its log-probabilities leave them out the same way); None: the whole vocabulary.
  Differentiable w.r.t. logits through cross_entropy, whose custom VJP writes the [B, L, vocab] gradient in
  one pass in the logits' dtype.
  """
  return -cross_entropy(_in_vocabulary(logits, num_tokens), targets)


def entropy_sum(logits: jax.Array, mask: jax.Array, num_tokens: int | None = None) -> jax.Array:
  """The policy's entropy -sum_v p_v log p_v summed over the tokens where mask [B, L] is true, a float32 scalar
  (the same vocabulary as token_logps). A metric: no gradient flows through it."""
  logp = jax.nn.log_softmax(jax.lax.stop_gradient(_in_vocabulary(logits, num_tokens)).astype(jnp.float32), axis=-1)
  p_logp = jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0)  # 0 log 0 = 0 on the ids left out.
  return -jnp.sum(jnp.where(mask, jnp.sum(p_logp, axis=-1), 0.0))


def _in_vocabulary(logits: jax.Array, num_tokens: int | None) -> jax.Array:
  """logits with the ids >= num_tokens at -inf (probability exactly 0); unchanged when none is."""
  if num_tokens is None or num_tokens >= logits.shape[-1]:
    return logits
  if num_tokens < 1:
    raise ValueError(f"num_tokens={num_tokens}: needs at least one vocabulary id; pass the tokenizer's vocabulary size")
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(vocab < num_tokens, logits, -jnp.inf)


def tiled_cross_entropy(config: Config, params, hidden_BLE, targets_BL, mask_BL):
  """The summed cross-entropy of loss_fn, with the output head applied to num_vocab_tiling chunks of tokens in
  turn, each rematerialised in the backward pass, so only one chunk's [tokens, vocab] logits exist at a time.

  Chunk j holds every row's tokens j, j + n, j + 2n, ... (n = num_vocab_tiling): strided, so each device keeps
  its share of every chunk whether the batch or the length is sharded.
  """
  n = config.num_vocab_tiling
  b, length = hidden_BLE.shape[:2]

  def chunks(x):  # [batch, length, ...] -> [n, batch, length / n, ...]
    return jnp.moveaxis(x.reshape(b, length // n, n, *x.shape[2:]), 2, 0)

  # The Transformer's quantization reaches only its own call: the head applied here is quantized as it would be there.
  head = quantizations.quantize_model(models.OutputHead(config), config)
  head_params = models.OutputHead.params(params)

  @jax.checkpoint
  def chunk_loss(hidden, targets, mask):
    xent = cross_entropy(head.apply({"params": head_params}, hidden), targets)
    return jnp.sum(jnp.where(mask, xent, 0.0))

  def body(total, chunk):
    return total + chunk_loss(*chunk), None

  total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (chunks(hidden_BLE), chunks(targets_BL), chunks(mask_BL)))
  return total


def sequence_logps(logits, batch) -> tuple[jax.Array, jax.Array]:
  """(summed log-probabilities of the masked targets, whether the sequence has any), per (row, segment id) of a
  packed batch: [rows * (length + 1)] each, row r's segment s at r * (length + 1) + s."""
  rows, length = batch["targets"].shape
  logps = -cross_entropy(logits, batch["targets"])
  ids = (jnp.arange(rows)[:, None] * (length + 1) + batch["inputs_segmentation"]).ravel()
  in_loss = batch["targets_segmentation"] != 0
  sums = jax.ops.segment_sum(jnp.where(in_loss, logps, 0.0).ravel(), ids, num_segments=rows * (length + 1))
  counts = jax.ops.segment_sum(in_loss.astype(jnp.int32).ravel(), ids, num_segments=rows * (length + 1))
  return sums, counts > 0


def moe_aux(config: Config, sown: dict, weight: jax.Array) -> dict:
  """A mixture of experts' additions to loss_fn's aux (see there); the load-balancing loss scaled by `weight`."""
  # The router's load-balancing loss is a mean over layers of a per-token mean (layers/moe.py), added to the
  # mean loss as in MaxText; scaled by the loss's weight, it adds up over micro-batches as the sum does.
  lb_loss = jnp.mean(jnp.concatenate([jnp.ravel(v) for v in _sown(sown, "moe_lb_loss")]))
  aux = {"moe_lb_loss": config.load_balance_loss_weight * lb_loss * weight.astype(jnp.float32)}
  if config.capacity_factor > 0:
    aux["moe_dropped"] = sum(jnp.sum(v) for v in _sown(sown, "moe_dropped"))
  if config.routed_bias and config.routed_bias_update_rate > 0:
    aux["moe_expert_counts"] = _expert_counts(sown)
  return aux


def _expert_counts(sown: dict) -> dict[tuple[str, ...], jax.Array]:
  """{path of an MoE block in the params: its assignments per expert, [experts] or [layers, experts] when
  scanned}, from what the blocks sowed."""
  flat = traverse_util.flatten_dict(sown["intermediates"])
  return {path[:-1]: value[0] for path, value in flat.items() if path[-1] == "moe_expert_counts"}


def _sown(sown: dict, name: str) -> list[jax.Array]:
  """The values layers sowed under `name` (one per layer, or stacked over scanned layers)."""
  return [v for path, v in jax.tree_util.tree_leaves_with_path(sown) if name in jax.tree_util.keystr(path)]
