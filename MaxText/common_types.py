"""Types and names every module shares: the frozen `Config` and `ConfigError` (pyconfig builds the one,
raises the other), `TrainingError` (a run that cannot go on), logical axis names, and the model modes.

Logical axis names: parameters and activations have separate names, so that their sharding can differ
(e.g. FSDP shards a weight's `embed` axis while the activation's `activation_embed` stays whole).
Every name here needs a rule in `logical_axis_rules` (configs/base.yml); a test checks that.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any


class ConfigError(ValueError):
  """A mistake in the user's configuration; the message says what is wrong and how to fix it."""


class TrainingError(RuntimeError):
  """A run cannot go on (e.g. the loss is NaN, the disk is full); the message says why and what to try."""


# Longest text an error message quotes from the user (a value, a path, a key): a mistake must stay one readable line.
SHOWN_CHARS = 200


def cut(text: str, limit: int = SHOWN_CHARS) -> str:
  """`text`, or its first `limit` characters and how long it was."""
  return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
  """repr(value) cut to `limit` characters, for quoting a user's value in an error message."""
  try:
    return cut(repr(value), limit)
  except (ValueError, RecursionError):  # An int of over 4300 digits has no repr; a self-nesting list none either.
    return f"<a {type(value).__name__} too large to show>"


class Config:
  """Frozen, typed run configuration: attribute access to the keys of base.yml plus derived values."""

  __slots__ = ("_values",)

  def __init__(self, values: Mapping[str, Any]):
    object.__setattr__(self, "_values", MappingProxyType(dict(values)))

  def __getattr__(self, name: str) -> Any:
    try:
      return self._values[name]
    except KeyError:
      raise AttributeError(f"Config has no key {name!r}") from None

  def __setattr__(self, name, value):
    raise AttributeError(f"Config is frozen; cannot set {name!r}")

  def __reduce__(self):
    return (Config, (dict(self._values),))

  def __eq__(self, other):
    return isinstance(other, Config) and dict(self._values) == dict(other._values)

  def __hash__(self):
    return hash(tuple(sorted(self._values.items())))

  def as_dict(self) -> dict:
    return {k: thaw(v) for k, v in self._values.items()}

  def replace(self, **changes) -> "Config":
    """A copy with some keys changed, neither validated nor derived again: for tests that need a config the checks
    would refuse. Everything else uses pyconfig.replace, which validates and derives again."""
    unknown = set(changes) - set(self._values)
    if unknown:
      raise AttributeError(f"Config has no keys {sorted(unknown)}")
    return Config({**self._values, **{k: freeze(v) for k, v in changes.items()}})


def freeze(value):
  if isinstance(value, (list, tuple)):
    return tuple(freeze(v) for v in value)
  return value


def thaw(value):
  if isinstance(value, tuple):
    return [thaw(v) for v in value]
  return value


# Parameter axes.
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"
NORM = "norm"
LAYERS = "layers"
EXP = "exp"  # The experts of a mixture-of-experts block.
EMBED_NO_EXP = "embed_no_exp"  # The embed axis of expert weights, whose expert axis takes the expert mesh axis.
Q_LORA = "q_lora"  # Multi-head latent attention's compressed query (q_lora_rank).
KV_LORA = "kv_lora"  # Multi-head latent attention's compressed keys and values (kv_lora_rank).
LORA_RANK = "lora_rank"  # The rank axis of LoRA adapters (lora_rank): A [*in, rank], B [rank, *out].

# Activation axes.
BATCH = "activation_batch"
LENGTH = "activation_length"
STAGE = "activation_stage"  # the pipeline's stages (layers/pipeline.py)
ACT_EMBED = "activation_embed"
ACT_MLP = "activation_mlp"
ACT_HEADS = "activation_heads"
ACT_KV_HEADS = "activation_kv_heads"
ACT_HEAD_DIM = "activation_head_dim"
ACT_VOCAB = "activation_vocab"

# KV-cache axes (decoding): [batch, cache length, kv heads, head dim], per layer.
CACHE_BATCH = "cache_batch"
CACHE_SEQUENCE = "cache_sequence"
CACHE_HEADS = "cache_heads"
CACHE_KV = "cache_kv"
CACHE_AXES = (CACHE_BATCH, CACHE_SEQUENCE, CACHE_HEADS, CACHE_KV)
LATENT_CACHE_AXES = (CACHE_BATCH, CACHE_SEQUENCE, None, CACHE_KV)  # MLA's cache: one latent "head", never split

PARAM_AXES = (EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM, VOCAB, NORM, LAYERS, EXP, EMBED_NO_EXP, Q_LORA, KV_LORA, LORA_RANK)
ACTIVATION_AXES = (BATCH, LENGTH, STAGE, ACT_EMBED, ACT_MLP, ACT_HEADS, ACT_KV_HEADS, ACT_HEAD_DIM, ACT_VOCAB) + CACHE_AXES

# What a forward pass is for: training (logits only), prefill (logits and the prompt's keys and values for
# the cache) or autoregressive (one new token per row, attending to the cache).
MODEL_MODE_TRAIN = "train"
MODEL_MODE_PREFILL = "prefill"
MODEL_MODE_AUTOREGRESSIVE = "autoregressive"
