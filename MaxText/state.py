"""The training state and its sharded initialisation.

Parameters are never materialised whole on one host: `jax.eval_shape` gives the abstract state and its
logical axes, `logical_axis_rules` turn those into shardings, and a jitted init with out_shardings
creates every array already in place.

Under a circular pipeline the state holds the pipelined layers stage-major (layers/pipeline.py): the train state that
init_state and state_from_params make is in that order, the same shapes and shardings as the natural one. `LayerOrder`
is the one adapter between the two orders: the step views the state through it, checkpointing/ permutes through it at
every save and restore (so checkpoints keep the natural order), and RL's rollouts decode through it.
"""

import dataclasses
import functools
import math

import jax
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh

from MaxText import common_types, lora, sharding
from MaxText.common_types import Config
from MaxText.layers import models, pipeline, quantizations


@struct.dataclass
class TrainState:
  step: jax.Array  # number of completed optimizer steps
  params: dict
  opt_state: optax.OptState
  # An objective that keeps a reference model (objectives.base.Objective.keeps_reference: DPO, RL with grpo_beta >
  # 0, not under LoRA): the frozen parameters the run started from, saved with the state so a resumed run compares
  # against the same model. None otherwise.
  reference_params: dict | None = None


def _reference(params, reference: bool):
  """The reference model's parameters for a state around `params`: a copy (never the same buffers, which the train
  step donates) when the state keeps one, else None."""
  return jax.tree_util.tree_map(lambda x: x.copy(), params) if reference else None


def has_reference(layout: "StateLayout") -> bool:
  """Whether the train states of `layout` hold a reference model's parameters."""
  return layout.abstract.reference_params is not None


def trainable(config: Config, params):
  """The parameters the optimizer updates: all, or with lora_rank > 0 only the adapters (MaxText/lora.py)."""
  return lora.partition(params)[0] if config.lora_rank > 0 else params


@dataclasses.dataclass(frozen=True)
class StateLayout:
  """The abstract train state (ShapeDtypeStructs carrying shardings) and the matching shardings."""

  abstract: TrainState
  shardings: TrainState


def init_params(model: nn.Module, config: Config, rng: jax.Array):
  """Boxed (logically partitioned) params of `model`, for a dummy batch of one row per shard of the batch.

  The parameters' shapes do not depend on the batch, but a kernel that splits it over the mesh (splash
  attention under shard_map, on TPUs) needs whole shards, even at init.
  """
  tokens, segments, positions = models.init_inputs(_batch_shards(config), config.max_target_length)
  return model.init({"params": rng, "dropout": rng}, tokens, segments, positions)["params"]


def _batch_shards(config: Config) -> int:
  """Into how many shards the mesh splits a batch (the mesh axes of `activation_batch`)."""
  axes = sharding.logical_to_mesh_spec((common_types.BATCH,), config)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  size = dict(zip(config.mesh_axes, config.mesh_shape, strict=True))
  return math.prod(size[axis] for axis in axes)


def _boxed_state(model, config, tx, rng, reference: bool) -> TrainState:
  params = init_params(model, config, rng)
  return TrainState(
    step=jax.numpy.zeros((), jax.numpy.int32),
    params=params,
    opt_state=_boxed_opt_state(tx, trainable(config, params)),
    reference_params=_reference(params, reference),
  )


def _boxed_opt_state(tx, params):
  """tx.init(params) with each leaf that belongs to a parameter and has its shape (Adam's moments, Muon's
  momentum) boxed with that parameter's logical axes, so it is sharded alike; leaves of other shapes
  (Adafactor's factored second moments, a row and a column per matrix) and counters stay unboxed: replicated.
  A leaf belongs to the parameter whose path its path ends with (.../mu/layers/mlp/wo/kernel)."""
  plain = nn.meta.unbox(params)
  by_path = {}
  for (path, param), names in zip(
    jax.tree_util.tree_leaves_with_path(plain), jax.tree_util.tree_leaves(nn.get_partition_spec(params)), strict=True
  ):
    by_path[tuple(k.key for k in path)] = (param.shape, tuple(names))

  def box(path, leaf):
    keys = []
    for k in reversed(path):
      if not isinstance(k, jax.tree_util.DictKey):
        break
      keys.insert(0, k.key)
    shape, names = by_path.get(tuple(keys), (None, None))
    return nn.Partitioned(leaf, names) if shape == leaf.shape else leaf

  return jax.tree_util.tree_map_with_path(box, tx.init(plain))


def state_layout(  # noqa: PLR0913 (the model's, then whether it keeps a reference)
  model: nn.Module, config: Config, tx: optax.GradientTransformation, mesh: Mesh, *, reference: bool = False
) -> StateLayout:
  """Shapes, dtypes and shardings of the train state, computed without allocating it. reference: the state keeps a
  reference model's parameters (the objective's keeps_reference)."""
  boxed = jax.eval_shape(lambda rng: _boxed_state(model, config, tx, rng, reference), jax.random.key(0))
  return StateLayout(*_abstract(boxed, mesh, config))


def _abstract(boxed, mesh: Mesh, config: Config):
  """Abstract (ShapeDtypeStructs with shardings) and shardings of an eval_shape'd boxed pytree."""
  shardings = sharding.tree_shardings(nn.get_partition_spec(boxed), mesh, config)
  abstract = jax.tree_util.tree_map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.meta.unbox(boxed), shardings
  )
  return abstract, shardings


def params_layout(model: nn.Module, config: Config, mesh: Mesh):
  """(abstract params with shardings, their shardings): the parameters alone, for decoding. Of a weight-only
  quantized model (quantizations.quantize_model with int8w / int4w), its quantized params: each weight a value laid
  out like the float weight and a scale with its reduced axes unsplit (quantizations.unsplit_scales), the routed
  experts' kernels included (quantizations.quantize_experts: PTQ's init leaves them float)."""
  with quantizations.group_size_errors(config):
    boxed = jax.eval_shape(lambda rng: init_params(model, config, rng), jax.random.key(0))
  if quantizations.is_weight_only(config):
    boxed = quantizations.unsplit_scales(quantizations.quantize_experts(boxed, model, config))
  return _abstract(boxed, mesh, config)


def abstract_params(config: Config) -> dict:
  """The params' shapes and dtypes (ShapeDtypeStructs with no shardings: checkpoint conversion needs no devices)."""
  boxed = jax.eval_shape(lambda rng: init_params(models.Transformer(config), config, rng), jax.random.key(0))
  return nn.meta.unbox(boxed)


def init_state(model, config: Config, tx, layout: StateLayout) -> TrainState:
  """A fresh train state from init_weights_seed, created directly with its shardings (in the stored order,
  LayerOrder.store: the natural init's values, permuted)."""
  init = jax.jit(
    lambda rng: LayerOrder(config).store(nn.meta.unbox(_boxed_state(model, config, tx, rng, has_reference(layout)))),
    out_shardings=layout.shardings,
  )
  rng = jax.random.key(config.init_weights_seed)
  # Init runs once, so on CPU it is compiled at LLVM's cheaper optimisation level: 2.5x faster to compile
  # (its many random-number kernels), the same bits, a start-up of about 1.7 s less (docs/changelog.md).
  platform = next(iter(jax.tree_util.tree_leaves(layout.shardings)[0].device_set)).platform
  options = {"xla_backend_optimization_level": 1} if platform == "cpu" else {}
  return init.lower(rng).compile(options)(rng)


def init_adapters(model, config: Config, layout: StateLayout) -> dict:
  """Fresh LoRA adapters from init_weights_seed, created with their shardings, in the natural order (the base's
  init is never run: XLA drops what the output does not need)."""
  adapters = lora.partition(layout.shardings.params)[0]
  init = jax.jit(lambda rng: lora.partition(nn.meta.unbox(init_params(model, config, rng)))[0], out_shardings=adapters)
  return init(jax.random.key(config.init_weights_seed))


def state_from_params(params, tx, layout: StateLayout, config: Config) -> TrainState:
  """A train state at step 0 around given params in the natural order (restored ones): a fresh optimizer state
  (and with a reference model, the params again as it), in the stored order (LayerOrder.store)."""

  def fresh(p):
    p = LayerOrder(config).store(p)
    return TrainState(
      step=jax.numpy.zeros((), jax.numpy.int32),
      params=p,
      opt_state=tx.init(trainable(config, p)),
      reference_params=_reference(p, has_reference(layout)),
    )

  return jax.jit(fresh, out_shardings=layout.shardings)(params)


@dataclasses.dataclass(frozen=True)
class LayerOrder:
  """The one adapter between the train state's layer order and the natural one. A circular pipeline's state holds
  its pipelined layers stage-major (layers/pipeline.py: pipeline.stores_stage_major); the model's loss, checkpoints,
  decoding and RL's rollouts take them in the natural order. For every other config each method is the identity.

    view(tree)     traced, inside a jitted function: stored -> natural, a reshape and a transpose that XLA folds into
                   the pipeline's own view of its layers (no data moves)
    store(tree)    traced: natural -> stored
    natural(tree)  arrays on the devices: a natural-order copy, each array keeping its sharding (checkpoints, decoding)
    stored(tree)   arrays on the devices: in the stored order, each keeping its sharding, their buffers donated (a
                   restored state)
  """

  config: Config

  @property
  def permuted(self) -> bool:
    """Whether the two orders differ."""
    return pipeline.stores_stage_major(self.config)

  def view(self, tree):
    return pipeline.to_natural(self.config, tree)

  def store(self, tree):
    return pipeline.to_stored(self.config, tree)

  def natural(self, tree):
    return _reordered(self.config, tree, to_stored=False)

  def stored(self, tree):
    return _reordered(self.config, tree, to_stored=True)


def _reordered(config: Config, tree, to_stored: bool):
  if not pipeline.stores_stage_major(config):
    return tree
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return _reorderer(config, to_stored, treedef, tuple(x.sharding for x in leaves))(tree)


@functools.lru_cache(maxsize=8)  # compiled once per run and direction: a run saves many times
def _reorderer(config: Config, to_stored: bool, treedef, shardings):
  reorder = pipeline.to_stored if to_stored else pipeline.to_natural
  return jax.jit(
    functools.partial(reorder, config),
    out_shardings=jax.tree_util.tree_unflatten(treedef, shardings),
    donate_argnums=(0,) if to_stored else (),
  )
