"""The decoder layer of each `decoder_block`, and how a model's layers split into stacks of one layer class.

`layer(decoder_block)` is the family's layer class (layers/llama.py's interface): the family registry
(MaxText/families/, below the layers: it imports neither jax nor flax) names it by its import path, imported here.

A stack is scanned over one layer class, so layers whose parameters differ go to different stacks (DeepSeek's
dense then MoE layers), or, where they alternate (Llama 4 Maverick's dense and MoE layers), into one stack of
periods: a `Period` module holds one period's layers (`layer_{k}`), and the stack scans over the periods.
"""

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import families
from MaxText.common_types import Config


def layer(decoder_block: str) -> type[nn.Module]:
  """The decoder layer class of a decoder_block (the layer of every layer, or of the layers after a dense stack)."""
  return families.get(decoder_block).layer_class


@dataclasses.dataclass(frozen=True)
class Stack:
  """Consecutive decoder layers of one class. Their parameters are `name` (scanned: stacked on axis 0) or
  `{name}_{j}` for the stack's j-th step (unrolled); MaxText's names: `layers`, or DeepSeek's `dense_layers`
  and `moe_layers`. A step is one layer, or with period > 1 one Period of `period` layers (`layer` is then the
  Period class, and a layer's parameters are under `layer_{k}`, k its place in the period)."""

  name: str
  layer: type[nn.Module]
  start: int  # the model's index of the stack's first layer
  count: int  # its steps: layers, or periods
  period: int = 1  # layers per step

  @property
  def end(self) -> int:
    """The model's index after the stack's last layer."""
    return self.start + self.count * self.period

  def by_step(self, a: jax.Array) -> jax.Array:
    """The stack's layers' [layers, ...] (a KV cache) as [steps, ...]: [count, period, ...] for periods."""
    return a if self.period == 1 else a.reshape(self.count, self.period, *a.shape[1:])

  def by_layer(self, a: jax.Array) -> jax.Array:
    """by_step's inverse: [steps, ...] -> [layers, ...] (of any number of steps)."""
    return a if self.period == 1 else a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


class Period(nn.Module):
  """One period of a stack of periods: its `layers` classes in order (a subclass sets them, see period_block), as
  the sub-modules `layer_{k}`. It is called as a decoder layer (layers/llama.py) with `layer_index` the period's
  index p (an int, or traced inside the scan): its k-th layer is the model's layer p * len(layers) + k, and its
  cache and kv hold its layers' on a leading axis [period, ...]. Its FLOPs (metrics.py) are its layers' summed."""

  config: Config
  mesh: jax.sharding.Mesh | None = None
  deterministic: bool = True
  model_mode: str = ct.MODEL_MODE_TRAIN

  layers: ClassVar[tuple[type[nn.Module], ...]] = ()

  @nn.compact
  def __call__(self, x, segment_ids, positions, cache=None, cache_mask=None, cache_positions=None, layer_index=0):
    kvs = []
    for k, layer_class in enumerate(self.layers):
      layer_cache = None if cache is None else jax.tree_util.tree_map(lambda c, k=k: c[k], cache)
      layer = layer_class(self.config, self.mesh, self.deterministic, self.model_mode, name=f"layer_{k}")
      x, kv = layer(x, segment_ids, positions, layer_cache, cache_mask, cache_positions, layer_index * len(self.layers) + k)
      kvs.append(kv)
    return x, jax.tree_util.tree_map(lambda *a: jnp.stack(a), *kvs) if kvs[0] is not None else None

  @classmethod
  def attention_flops(cls, config: Config):
    """The period's attention projections summed; the cost per (query, key) pair, which its layers share."""
    flops = [layer.attention_flops(config) for layer in cls.layers]
    assert len({f.per_pair for f in flops}) == 1, "a period's layers must share their attention's cost per pair"
    return dataclasses.replace(flops[0], projections=sum(f.projections for f in flops))

  @classmethod
  def mlp_flops(cls, config: Config) -> float:
    return sum(layer.mlp_flops(config) for layer in cls.layers)

  @classmethod
  def attention_pairs(cls, config: Config, layer_index: int, length: int) -> float:
    """The pairs the layers of period `layer_index` attend."""
    p = len(cls.layers)
    return sum(layer.attention_pairs(config, layer_index * p + k, length) for k, layer in enumerate(cls.layers))


@functools.cache
def period_block(layers: tuple[type[nn.Module], ...]) -> type[Period]:
  """The Period of these layer classes (one class per tuple, so equal configs build equal stacks)."""
  return type("Period", (Period,), {"layers": layers})


def period_layers(top: type[nn.Module], config: Config) -> tuple[type[nn.Module], ...]:
  """The layer classes of one period of the model's layers: a layer class's `period_layers(config)` where it has
  one (Llama 4's interleaved dense and MoE layers), else the class alone."""
  periodic = getattr(top, "period_layers", None)
  return (top,) if periodic is None else tuple(periodic(config))


def layer_stacks(config: Config) -> list[Stack]:
  """The decoder's layer stacks, in order: one `layers` stack (of layers, or of periods when the layer class has
  several in one period: its num_decoder_layers must be a multiple), or `dense_layers` then `moe_layers` for a layer
  class with a `dense_layer` (its first first_num_dense_layers layers; empty stacks left out)."""
  top, n = layer(config.decoder_block), config.num_decoder_layers
  if top.dense_layer is None:
    layers = period_layers(top, config)
    if len(layers) == 1:
      return [Stack("layers", top, 0, n)]
    assert n % len(layers) == 0, f"{n} layers do not split into periods of {len(layers)} (the family's checks say so)"
    return [Stack("layers", period_block(layers), 0, n // len(layers), len(layers))]
  first = config.first_num_dense_layers
  stacks = [Stack("dense_layers", top.dense_layer, 0, first), Stack("moe_layers", top, first, n - first)]
  return [stack for stack in stacks if stack.count]


def param_path(config: Config, path: str, index: int | None) -> tuple[str, int | None]:
  """Where one of our parameters is: `path` of the model (index None), or decoder layer `index`'s parameter
  `path` (relative to the layer): its dotted path in the model's params, and the index into its axis 0 when the
  layers are scanned (None when unrolled, and for the model's own)."""
  if index is None:
    return path, None
  for stack in layer_stacks(config):
    if stack.start <= index < stack.end:
      j, k = divmod(index - stack.start, stack.period)
      path = path if stack.period == 1 else f"layer_{k}.{path}"
      return (f"{stack.name}.{path}", j) if config.scan_layers else (f"{stack.name}_{j}.{path}", None)
  raise IndexError(f"layer {index} is not among the {config.num_decoder_layers} decoder layers")
