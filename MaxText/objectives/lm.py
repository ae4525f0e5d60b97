"""Language modelling (`objective=lm`, the default): the summed cross-entropy of every next token of the packed
documents (pre-training), evaluated as a mean loss per token and its perplexity."""

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from MaxText.objectives import base, losses


def loss_fn(model, params, batch, dropout_rng, deterministic=False):
  """Summed float32 loss over non-padding targets, and aux: {"tokens": their number, "xent": the summed
  cross-entropy, and for mixture-of-experts models "moe_lb_loss": the summed load-balancing loss, with
  capacity_factor > 0 "moe_dropped": the assignments the experts' capacity dropped, and with
  routed_bias_update_rate > 0 "moe_expert_counts": each MoE block's assignments per expert}.

  batch: inputs, inputs_segmentation, inputs_position, targets, targets_segmentation [batch, length].
  Returning sums (not means) lets micro-batches add up to exactly the full batch's loss.
  """
  config = model.config
  outputs, sown = losses.forward(
    model, params, batch, dropout_rng, deterministic=deterministic, return_hidden=config.num_vocab_tiling > 1
  )
  mask_BL = batch["targets_segmentation"] != 0
  tokens = jnp.sum(mask_BL)
  if config.num_vocab_tiling > 1:
    xent = losses.tiled_cross_entropy(config, params, outputs, batch["targets"], mask_BL)
  else:
    xent = jnp.sum(jnp.where(mask_BL, losses.cross_entropy(outputs, batch["targets"]), 0.0))
  aux = {"tokens": tokens, "xent": xent}
  if config.num_experts > 1:
    aux.update(losses.moe_aux(config, sown, tokens))
    return xent + aux["moe_lb_loss"], aux
  return xent, aux


class LanguageModelling(base.Objective):
  """Pre-training on documents: loss_fn."""

  name = "lm"

  def loss(  # noqa: PLR0913 (base.Objective.loss's)
    self, model, params, batch, dropout_rng, *, reference_params=None, step=None, num_tokens=None, deterministic=False
  ):
    del reference_params, step, num_tokens
    return loss_fn(model, params, batch, dropout_rng, deterministic)

  def eval_loss(self, model, params, reference_params, batch):
    """The cross-entropy alone (no MoE load-balancing term) and its tokens."""
    del reference_params
    _, aux = loss_fn(model, params, batch, jax.random.key(0), deterministic=True)
    return aux["xent"], aux["tokens"], {}

  def eval_scalars(self, avg_loss: float, weight: int, means: Mapping[str, float]) -> dict[str, float]:
    del means  # eval_loss gives none
    return {"eval/avg_loss": avg_loss, "eval/perplexity": base.perplexity(avg_loss), "eval/total_weights": weight}

  def eval_line(self, scalars: Mapping[str, float], when: str) -> str:
    return (
      f"eval {when}: loss {scalars['eval/avg_loss']:.4f}, perplexity {scalars['eval/perplexity']:.2f} "
      f"over {scalars['eval/total_weights']} tokens"
    )


OBJECTIVE = LanguageModelling
