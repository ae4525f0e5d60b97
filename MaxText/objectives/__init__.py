"""Training objectives: one `Objective` (base.py) per value of the `objective` key, owning all that differs between
pre-training, fine-tuning and reinforcement learning: the batch it needs and how its data is made, its loss, its
evaluation and metrics, whether it keeps a reference model, its FLOPs. `step.py` and `train.py` call the objective and
never branch on its kind.

  lm   language modelling on documents: the cross-entropy of every next token (pre-training)
  sft  supervised fine-tuning on conversations: the same loss, on the tokens the conversation's mask keeps
  dpo  direct preference optimization on preference pairs, against a reference model
  rl   GRPO / GSPO on rollouts of prompts from the inference engine, scored by reward functions

An objective is a module of this package, `MaxText/objectives/<name>.py`, that defines `OBJECTIVE` (its class); the
modules are found by listing the package, so the valid `objective` values are the names this module gives and no
list anywhere names them. A test registers a throwaway objective of its own with `register`.

This module imports none of them (nor jax): the config layer reads `names()` to check the key, and `get` imports an
objective's module when a run first asks for it.
"""

import importlib
import pkgutil

from MaxText.common_types import Config, ConfigError

# The package's modules that hold what objectives share, not an objective.
SUPPORT = ("base", "losses")

REGISTERED: dict[str, type] = {}  # objectives registered at run time (a test's own), by name


def names() -> list[str]:
  """The valid values of the `objective` key: the package's objective modules, then those registered."""
  found = [m.name for m in pkgutil.iter_modules(__path__) if m.name not in SUPPORT]
  return found + [name for name in REGISTERED if name not in found]


def register(objective: type) -> None:
  """Adds an objective class (a test's throwaway one) under its `name`."""
  if objective.name in names():
    raise ValueError(f"an objective named {objective.name!r} exists already")
  REGISTERED[objective.name] = objective


def unregister(name: str) -> None:
  """Removes a registered objective."""
  del REGISTERED[name]


def check_name(name: str) -> None:
  """ConfigError unless `name` is an objective (pyconfig checks the key with it)."""
  if name not in names():
    raise ConfigError(f"objective={name!r} is not supported; choose one of {', '.join(map(repr, names()))}")


def get(config: Config):
  """The objective `config.objective` names, for `config` (a base.Objective)."""
  name = config.objective
  if name in REGISTERED:
    return REGISTERED[name](config)
  check_name(name)
  cls = importlib.import_module(f"{__name__}.{name}").OBJECTIVE
  if cls.name != name:
    raise ValueError(f"MaxText/objectives/{name}.py defines {cls.name!r}; name the module after its objective")
  return cls(config)
