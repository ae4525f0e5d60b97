"""The config's sections: one module per component, each naming the base.yml keys its component reads, the valid
values of those with a fixed set, and the component's rules on them, with neither jax nor flax imported.

A section is `MaxText/sections/<name>.py` defining `SECTION = Section(...)`; the modules are found by listing this
package (as MaxText/families/ are), so adding one edits no list. The config layer (config_validate) merges their
`choices` and runs their `check`s; a component takes its valid values from its section (optimizers.OPTIMIZERS is
sections.optimizer.OPTIMIZERS), so each list of names exists once. Sections import nothing but the standard library
and common_types: parsing and validating a config needs no accelerator stack.
"""

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

__all__ = ["SECTIONS", "Section", "all", "implement", "no_checks"]


def no_checks(values: Mapping[str, Any]) -> None:
  del values


@dataclasses.dataclass(frozen=True)
class Section:
  """A component's part of the config."""

  name: str  # the section's module name in this package
  keys: tuple[str, ...]  # the base.yml keys the component reads (each in one section only)
  # key -> its valid values, for keys with a fixed set (config_validate refuses any other, naming them in this order)
  choices: Mapping[str, Collection[str]] = dataclasses.field(default_factory=dict)
  # Raises ConfigError for what the component cannot run. `values`: config_parse's typed values, and the model's
  # dimensions (config_derive.model_dims: emb_dim, mlp_dim, ...), which config_validate adds.
  check: Callable[[Mapping[str, Any]], None] = no_checks


def implement(names: Sequence[str], implementations: Mapping[str, Any]) -> dict[str, Any]:
  """A component's registry for a section's `names`: name -> its implementation, in the section's order. Raises at
  import when the two disagree, so a name added to the section without its implementation (or the reverse) fails
  at once rather than as a KeyError in a run."""
  if set(names) != set(implementations) or len(names) != len(implementations):
    raise ValueError(
      f"the implementations {sorted(implementations)} do not match the section's names {list(names)}; give each "
      "name one implementation"
    )
  return {name: implementations[name] for name in names}


SECTIONS: dict[str, Section] = {}


def _load() -> None:
  for module in pkgutil.iter_modules(__path__):
    section = importlib.import_module(f"{__name__}.{module.name}").SECTION
    if section.name != module.name:
      raise ValueError(f"MaxText/sections/{module.name}.py defines Section {section.name!r}; name it {module.name!r}")
    SECTIONS[section.name] = section


def all() -> list[Section]:  # noqa: A001 (the package's one listing: sections.all())
  """Every section, in the order of their names."""
  return [SECTIONS[name] for name in sorted(SECTIONS)]


_load()
