"""Model families: one registered `Family` per `decoder_block` value, owning all that is particular to it.

A family is two files: its decoder layer in layers/ (a subclass of LlamaDecoderLayer that changes its hooks, or
Llama's own) and its module here, `MaxText/families/<decoder_block>.py`, which defines `FAMILY = Family(...)`: where
its layer is, the layer's traits the config is checked against, the config checks and derived keys (pyconfig runs
them), the Hugging Face mapping (convert/hf_families.py: config.json keys both ways, architecture, tensor layout) and
the small transformers models its parity test builds. The modules are found by listing this package, so the valid
`decoder_block` values are the names in FAMILIES and no list anywhere names them.

This package imports neither jax nor flax, so reading a config needs neither: a family names its layer by its import
path ("MaxText.layers.gemma3:Gemma3DecoderLayer"), which layers/decoders.py imports when a model is built, and
declares the layer's traits (attention_type, moe, ...) that pyconfig checks; families_test checks that they are the
layer class's own. What a family's layer and its Hugging Face mapping share (which layers are global, MoE, NoPE)
lives here, and the layer imports it.
"""

import dataclasses
import functools
import importlib
import os
import pkgutil
import re
from collections.abc import Callable, Mapping
from typing import Any

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families

__all__ = ["FAMILIES", "Family", "for_hf_config", "get", "hf_mapping", "model_keys_from_hf", "no_checks", "presets"]
__all__ += ["register", "rope_rotates_pairs", "summary_table", "text_tower", "unregister"]

MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")


def no_checks(values: Mapping[str, Any]) -> None:
  del values


def no_derived_keys(values: Mapping[str, Any]) -> dict:
  del values
  return {}


def rope_rotates_pairs(values: Mapping[str, Any]) -> None:
  if values["head_dim"] % 2:
    raise ConfigError(f"head_dim={values['head_dim']} is odd; rotary embeddings rotate pairs, use an even head_dim")


def _resolve(layer):
  """A layer class, or the one an import path "module:Class" names (imported now)."""
  if not isinstance(layer, str):
    return layer
  module, name = layer.split(":")
  return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its layer and the layer's traits, its config checks and derived keys, its Hugging Face mapping."""

  name: str  # the decoder_block value, and the name of the family's module in this package
  # The decoder layer (x [batch, length, embed] -> (x, kv); see layers/llama.py): its import path "module:Class", or
  # the class itself (a test's family).
  layer: Any
  hf: hf_families.HFMapping | None = None  # the Hugging Face mapping; None: no import or export
  # Raises ConfigError for typed config values (pyconfig.parse's) this family cannot run; the default suits a
  # family with rotary embeddings.
  check: Callable[[Mapping[str, Any]], None] = rope_rotates_pairs
  # Keys this family adds to the Config, from the values pyconfig.derive has computed (emb_dim, mesh, ...).
  derive: Callable[[Mapping[str, Any]], dict] = no_derived_keys
  summary: str = ""  # what it adds to Llama's layer, one line (README's table of families: summary_table)
  # Small random transformers models of the family, by a name unique among all families: the parity tests
  # (tests/hf_checkpoint_test.py) run each against transformers. A family with an `hf` mapping needs one.
  hf_examples: Mapping[str, hf_families.HFExample] = dataclasses.field(default_factory=dict)

  # The layer's traits, which pyconfig checks the config against (the layer class's attributes of the same names:
  # families_test checks that they agree).
  attention_type: str = "global"  # the config's attention_type it runs (MaxText's key): "mla" for MLA
  moe: bool = False  # its MLP is a mixture of experts (layers/moe.py): num_experts >= 2
  dense_layers: bool = False  # its first first_num_dense_layers layers are a dense layer class (DeepSeek's)
  clamped_swiglu: bool = False  # it has gpt-oss's clamped SwiGLU (mlp_activations_limit)
  router_logit_bias: bool = False  # its router has a bias on its logits (routed_bias under softmax routing)
  attention_sinks: bool = False  # its attention has a learned sink logit per head

  @functools.cached_property
  def layer_class(self):
    """The decoder layer class (its module imported on first use)."""
    return _resolve(self.layer)


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
  """Adds a family (its module's FAMILY, or one a test defines) to FAMILIES."""
  if family.name in FAMILIES:
    raise ValueError(f"a family named {family.name!r} is registered already")
  FAMILIES[family.name] = family


def unregister(name: str) -> None:
  """Removes a registered family (a test's throwaway one)."""
  del FAMILIES[name]


def _register_modules() -> None:
  """Registers the FAMILY of every module of this package, in the order of their names."""
  for module in pkgutil.iter_modules(__path__):
    family = importlib.import_module(f"{__name__}.{module.name}").FAMILY
    if family.name != module.name:
      raise ValueError(f"MaxText/families/{module.name}.py registers {family.name!r}; name the module after its family")
    register(family)


_register_modules()


def get(decoder_block: str) -> Family:
  try:
    return FAMILIES[decoder_block]
  except KeyError:
    raise ConfigError(
      f"decoder_block={decoder_block!r} is not supported; choose one of {', '.join(map(repr, FAMILIES))}"
    ) from None


def for_hf_config(config_json: Mapping) -> Family:
  """The family whose Hugging Face model_type a config.json names (its causal LM's, or that of a multimodal model
  holding it as its text tower); ConfigError if none has it."""
  model_type = config_json.get("model_type")
  with_hf = [f for f in FAMILIES.values() if f.hf is not None]
  for family in with_hf:
    tower = family.hf.text_tower
    if model_type == family.hf.model_type or (tower is not None and model_type == tower.model_type):
      return family
  towers = [f.hf.text_tower.model_type for f in with_hf if f.hf.text_tower]
  supported = ", ".join([f.hf.model_type for f in with_hf] + [f"{t} (its text model)" for t in towers])
  raise hf_families.unsupported(f"model_type={model_type!r} is not supported; supported: {supported}")


def text_tower(config_json: Mapping) -> hf_families.TextTower | None:
  """The TextTower of a multimodal config.json (its tensors are stored under its names); None for a causal LM's."""
  tower = for_hf_config(config_json).hf.text_tower
  return tower if tower is not None and config_json.get("model_type") == tower.model_type else None


def model_keys_from_hf(config_json: Mapping) -> dict:
  """Our model keys (decoder_block included) from a Hugging Face config.json, a causal LM's or a multimodal model's
  (its text model's keys); ConfigError if unsupported, or if a field holds what no family reads (one line naming
  it, before any family reads a field: hf_families.check_fields)."""
  hf_families.check_fields(config_json)
  family = for_hf_config(config_json)
  hf_families.check_quantization(family.hf, config_json)  # a multimodal checkpoint says it at its top level
  tower = text_tower(config_json)
  if tower is not None:
    config_json = tower.text_config(family.hf, config_json)
  return hf_families.model_keys(family.hf, family.name, config_json)


def hf_mapping(config: Config) -> hf_families.HFMapping:
  """The Hugging Face mapping of the config's family; ConfigError if it has none."""
  family = get(config.decoder_block)
  if family.hf is None:
    raise ConfigError(f"decoder_block={config.decoder_block} has no Hugging Face mapping; it cannot be exported")
  return family.hf


def presets(name: str) -> list[str]:
  """The presets in configs/models/ whose decoder_block is the family `name`, sorted."""
  found = []
  for file in sorted(f for f in os.listdir(MODELS_DIR) if f.endswith(".yml")):
    with open(os.path.join(MODELS_DIR, file), encoding="utf-8") as f:
      text = f.read()
    if re.search(rf"^decoder_block:\s*[\"']?{re.escape(name)}[\"']?\s*(#|$)", text, re.M):
      found.append(file.removesuffix(".yml"))
  return found


def summary_table() -> str:
  """README's table of the registered families (markdown): decoder_block, what it adds to Llama's layer, presets."""
  rows = ["| decoder_block | what it adds to Llama's layer | presets |", "|---|---|---|"]
  for family in FAMILIES.values():
    rows.append(f"| `{family.name}` | {family.summary} | {', '.join(presets(family.name)) or '-'} |")
  return "\n".join(rows)
