"""The interface every training objective implements (`Objective`), with what most of them share: data from the
text pipelines (`Batches`) and an evaluation over the eval split.

`step.train_step` takes the objective's loss and adds its metrics; `step.eval_step` takes its eval loss; `train.py`
checks its data before anything is written, reads its batches, evaluates it and logs its line; `step.build` keeps a
reference model in the train state when it asks for one; `metrics.StepClock` counts its FLOPs. A subclass overrides
what differs. The defaults are those of an objective on text data with no reference model.
"""

import math
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
import tqdm

from MaxText import checkpointing, input_pipeline, metrics
from MaxText.common_types import Config, ConfigError, TrainingError


class Batches:
  """The training data as the loop reads it, here a text pipeline's iterator (RL's rollouts.Rollouts is another):

  batch(params, step)   the batch of step `step` (made with `params` where the data depends on the model), or
                        None once the data has run out
  get_state/set_state   the position a checkpoint saves and a resumed run restores
  metrics(seconds, n)   scalars the data adds to a logged step's (the time of the last n steps: `seconds`)
  """

  def __init__(self, iterator):
    self.iterator = iterator

  def batch(self, params, step: int) -> dict | None:
    del params, step  # A text pipeline's batches are the same whatever the model.
    return next(self.iterator, None)

  def get_state(self) -> dict:
    return self.iterator.get_state()

  def set_state(self, state) -> None:
    self.iterator.set_state(state)

  def start_prefetch(self) -> None:
    getattr(self.iterator, "start_prefetch", lambda: None)()

  def metrics(self, seconds: float | None = None, steps: int = 1) -> dict[str, float]:
    del seconds, steps
    return {}


class Objective:
  """A training objective for one config. Subclasses set `name` (the `objective` value, and its module's name) and
  implement `loss` and `eval_line`; the rest has defaults they override where they differ."""

  name: ClassVar[str] = ""
  examples: ClassVar[input_pipeline.Examples] = input_pipeline.DOCUMENTS  # what a record of its text data is
  sequences_per_row: ClassVar[int] = 1  # sequences a batch row holds (DPO: a chosen and a rejected one)
  decodes: ClassVar[bool] = False  # its batches are made by the inference engine, whose KV cache it has
  evaluates_first: ClassVar[bool] = False  # a run from step 0 evaluates before its first step too (a baseline)
  # The objective whose train step this one's is, when it is another's (SFT's is lm's): a step compiled for one
  # (train_compile.py) loads into a run of the other.
  same_step_as: ClassVar[str] = ""
  eval_metrics: ClassVar[tuple[str, ...]] = ()  # sums of its loss's aux that evaluation reports per weight

  def __init__(self, config: Config):
    self.config = config

  # ------------------------------------------------------------------------------------- what it keeps
  def runs_reference(self) -> bool:
    """Whether its loss compares the policy with a reference model: the parameters the run started from."""
    return False

  def keeps_reference(self) -> bool:
    """Whether the train state holds a copy of the reference model's parameters (state.reference_params): when it
    runs one, except under LoRA, where the base (the adapters off) is that model."""
    return self.runs_reference() and self.config.lora_rank == 0

  # ------------------------------------------------------------------------------------- its data
  def batch_keys(self) -> dict[str, jnp.dtype]:
    """The keys of its batches and their dtypes, each [global_batch_size, max_target_length]."""
    return dict.fromkeys(input_pipeline.BATCH_KEYS, jnp.int32)

  def vocabulary(self) -> int | None:
    """The vocabulary ids its loss reads (None: the model's whole output, padding ids included)."""
    return None

  def check_start(self) -> None:
    """Raises ConfigError for what would stop the run later (its data, the checkpoint it starts from), before the
    run writes anything."""
    self._check_reference_start()
    input_pipeline.check(self.config, self.examples)

  def said(self) -> str:
    """How messages name this objective and the keys that make it what it is."""
    return f"objective={self.name}"

  def _check_reference_start(self) -> None:
    """Under LoRA the reference is the base model (the adapters off), which is the starting policy only when the
    adapters start fresh: a run starting from trained adapters is refused."""
    config = self.config
    if not (self.runs_reference() and config.lora_rank > 0):
      return
    path = config.load_parameters_path and checkpointing.items_path("load_parameters_path", config.load_parameters_path)
    if config.hf_lora_adapter_path or (path and checkpointing.stores_adapters(path)):
      raise ConfigError(
        f"{self.said()} under LoRA compares with the base model (the adapters off), but this run starts "
        "from trained adapters; merge them first (generate_param_only_checkpoint.py with their LoRA keys) and start "
        "from the merge"
      )

  def data(self, mesh, params, first_step: int) -> Batches:
    """Its training data, positioned at the batch of `first_step` (a resumed run then restores its saved
    position); `params` are the parameters the run starts from."""
    del params
    return Batches(input_pipeline.create_iterator(self.config, mesh, start_step=first_step, examples=self.examples))

  # ------------------------------------------------------------------------------------- its loss
  def loss(  # noqa: PLR0913 (the model's three and the batch's two, then keyword-only)
    self, model, params, batch, dropout_rng, *, reference_params=None, step=None, num_tokens=None, deterministic=False
  ) -> tuple[jax.Array, dict]:
    """(summed float32 loss, aux) of a batch: aux["tokens"] is the loss's weight (the step divides the summed
    gradients by it once), and every other entry a sum too, so micro-batches add up to the whole batch's.

    reference_params: the reference model's (None under LoRA: the base, adapters off). step: the train state's
    step (a traced scalar). num_tokens: `vocabulary()`. A mixture of experts adds losses.moe_aux's entries."""
    raise NotImplementedError

  def step_metrics(self, aux: Mapping[str, jax.Array], denominator: jax.Array) -> dict[str, jax.Array]:
    """Its own learning/ metrics of a step, from the step's aux sums and the loss's weight (`denominator`)."""
    del aux, denominator
    return {}

  # ------------------------------------------------------------------------------------- its evaluation
  def eval_loss(self, model, params, reference_params, batch) -> tuple[jax.Array, jax.Array, dict]:
    """(summed eval loss, its weight, {eval metric: sum}) of an eval batch, without dropout or an MoE's balancing
    term."""
    loss, aux = self.loss(model, params, batch, jax.random.key(0), reference_params=reference_params, deterministic=True)
    return loss - aux.get("moe_lb_loss", 0.0), aux["tokens"], {k: aux[k] for k in self.eval_metrics}

  def evaluate(self, mesh, eval_fn, state, data, *, step: int) -> dict[str, float]:
    """The eval/ scalars of `state`: eval_fn (step.jit_eval_step) over eval_steps batches of the eval split (-1:
    one pass over it), as sums over the batches divided by their weight (`eval_scalars`)."""
    del data
    config = self.config
    loss_sum, weight, sums = 0.0, 0, {}
    batches = tqdm.tqdm(  # A progress bar for an evaluation that takes over 2 s (a whole split can take minutes).
      input_pipeline.create_eval_iterator(config, mesh, self.examples),
      desc=f"eval after step {step}",
      total=config.eval_steps if config.eval_steps > 0 else None,
      unit="batch",
      delay=2,
      leave=False,
      disable=jax.process_index() != 0,
    )
    for i, batch in enumerate(batches):
      if i == config.eval_steps:
        break
      batch_loss, batch_weight, batch_sums = jax.device_get(eval_fn(state.params, state.reference_params, batch))
      loss_sum, weight = loss_sum + float(batch_loss), weight + int(batch_weight)
      sums = {k: sums.get(k, 0.0) + float(v) for k, v in batch_sums.items()}
    if weight == 0:
      raise TrainingError(
        "the evaluation split gave no full batch; lower eval_per_device_batch_size or give more eval documents"
      )
    return self.eval_scalars(loss_sum / weight, weight, {k: v / weight for k, v in sums.items()})

  def eval_scalars(self, avg_loss: float, weight: int, means: Mapping[str, float]) -> dict[str, float]:
    """The eval/ scalars of a mean loss over `weight` (tokens, pairs) and the means of eval_loss's metrics."""
    return {"eval/avg_loss": avg_loss, "eval/total_weights": weight} | {f"eval/{k}": v for k, v in means.items()}

  def eval_line(self, scalars: Mapping[str, float], when: str) -> str:
    """The line an evaluation logs ("eval after step 9: ..."); `when`: "after step 9" or "before training"."""
    raise NotImplementedError

  # ------------------------------------------------------------------------------------- its FLOPs
  def flops(self) -> metrics.TrainingFlops:
    """Model FLOPs per device per step (metrics.training_flops_per_device: one training pass, forward and backward,
    over each row's tokens), times its sequences per row, and with a reference model its forward pass too: (3 + 1) /
    3 of a training pass."""
    passes = self.sequences_per_row * (3 + self.runs_reference()) / 3
    return metrics.training_flops_per_device(self.config).scaled(passes)


def perplexity(avg_loss: float) -> float:
  """exp(mean cross-entropy per token), capped where exp overflows."""
  return math.exp(min(avg_loss, 700.0))
