"""The decoder layer of each `decoder_block`, and how a model's layers split into stacks of one layer class.

This is the layers' own registry: `decoder_block` -> its decoder layer class (layers/llama.py's interface). The
family registry (MaxText/families/) fills it when it registers a family, so the layers never import the families,
their config checks or their Hugging Face mappings; a Config comes from pyconfig, which has loaded the families.
"""

import dataclasses

from flax import linen as nn

from MaxText.common_types import Config

# decoder_block -> its decoder layer class (the layer of every layer, or of the layers after a dense stack).
DECODER_LAYERS: dict[str, type[nn.Module]] = {}


def layer(decoder_block: str) -> type[nn.Module]:
  """The decoder layer class of a decoder_block."""
  try:
    return DECODER_LAYERS[decoder_block]
  except KeyError:
    raise KeyError(
      f"decoder_block={decoder_block!r} has no registered decoder layer (registered: {sorted(DECODER_LAYERS)}); "
      "families register theirs when MaxText.families is imported"
    ) from None


@dataclasses.dataclass(frozen=True)
class Stack:
  """Consecutive decoder layers of one class. Their parameters are `name` (scanned: stacked on axis 0) or
  `{name}_{j}` for the stack's j-th layer (unrolled); MaxText's names: `layers`, or DeepSeek's `dense_layers`
  and `moe_layers`."""

  name: str
  layer: type[nn.Module]
  start: int  # the model's index of the stack's first layer
  count: int


def layer_stacks(config: Config) -> list[Stack]:
  """The decoder's layer stacks, in order: one `layers` stack, or `dense_layers` then `moe_layers` for a layer
  class with a `dense_layer` (its first first_num_dense_layers layers; empty stacks left out)."""
  top, n = layer(config.decoder_block), config.num_decoder_layers
  if top.dense_layer is None:
    return [Stack("layers", top, 0, n)]
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
    if stack.start <= index < stack.start + stack.count:
      j = index - stack.start
      return (f"{stack.name}.{path}", j) if config.scan_layers else (f"{stack.name}_{j}.{path}", None)
  raise IndexError(f"layer {index} is not among the {config.num_decoder_layers} decoder layers")
