"""Configuration: a YAML file, `base_config:` inheritance, a model preset, `M_<KEY>` environment variables
and `key=value` overrides, resolved into one frozen, typed `Config` (common_types), in three parts:

  config_parse.read      argv and env -> typed values of base.yml's keys (base.yml is the schema)
  config_validate        every rule the values must keep: `validate` (no devices), `check_topology` (the
                         devices), `check_derived` (what the derived values tell); the lists of valid values
                         are their owners' (`choices`)
  config_derive          the derived values: model dims, schedule, mesh, batches, pipeline, the family's keys

This module ties them together:

  parse(argv)                            -> dict of typed, validated values (device independent)
  derive(values, num_devices, slices)    -> dict of derived values, checked against the devices
  finalize(values, num_devices, slices)  -> Config
  load(argv, num_devices, num_slices)    -> Config
  replace(config, **changes)             -> Config, validated and derived again
  given(config)                          -> the values it was derived from (base.yml's keys as the run set them)

Reading a config never starts jax.distributed, creates a directory or touches the network. A user mistake raises
`ConfigError` whose message names the key, the value and the fix.
"""

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from MaxText import config_derive, config_parse, config_validate
from MaxText.common_types import Config, freeze, thaw
from MaxText.config_derive import PARALLELISM_AXES
from MaxText.config_parse import BASE_YML, CONFIGS_DIR, MODELS_DIR, PATH_KEYS, absolute_path, defaults
from MaxText.config_validate import HARDWARE_PLATFORMS, choices

__all__ = [
  "BASE_YML",
  "CONFIGS_DIR",
  "HARDWARE_PLATFORMS",
  "MODELS_DIR",
  "PARALLELISM_AXES",
  "PATH_KEYS",
  "absolute_path",
  "choices",
  "defaults",
  "derive",
  "finalize",
  "given",
  "load",
  "parse",
  "replace",
]


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict:
  """Parses `[config.yml, key=value, ...]` into typed, validated values of the schema's keys (no derived values).
  See config_parse.read for the precedence of the sources."""
  values = config_parse.read(argv, env)
  config_validate.validate(values)
  return values


def derive(values: Mapping, num_devices: int, num_slices: int = 1) -> dict:
  """Every derived value of `parse`'s values on `num_devices` devices in `num_slices` slices, each checked: the
  one place they are computed."""
  config_validate.check_topology(values, num_devices, num_slices)
  derived = config_derive.derive(values, num_devices, num_slices)
  config_validate.check_derived(values, derived)
  return derived | config_derive.family_keys(values, derived)


class _Resolved(Config):
  """A Config that keeps the typed values it was derived from (`parse`'s), so that `replace` can validate and
  derive again: a derived key such as steps=-1's may have replaced the value it came from."""

  __slots__ = ("_raw",)

  def __init__(self, values: Mapping[str, Any], raw: Mapping[str, Any]):
    super().__init__(values)
    object.__setattr__(self, "_raw", MappingProxyType(dict(raw)))

  def __reduce__(self):
    return (_Resolved, (dict(self._values), dict(self._raw)))


def finalize(values: Mapping, num_devices: int, num_slices: int = 1) -> Config:
  """Typed raw values (from `parse`) plus derived values -> a frozen Config."""
  resolved = {**values, **derive(values, num_devices, num_slices)}
  return _Resolved({k: freeze(v) for k, v in resolved.items()}, values)


def load(argv: Sequence[str], num_devices: int, num_slices: int = 1, env: Mapping[str, str] | None = None) -> Config:
  """Parses argv (`[config.yml, key=value, ...]`) and the environment into a frozen Config."""
  return finalize(parse(argv, env), num_devices, num_slices)


def given(config: Config) -> dict[str, Any]:
  """base.yml's keys as the run set them, lists as lists: before derivation (-1 stays -1), with the preset's keys
  written out and paths absolute. A Config not made by `load` or `finalize` (tests' Config.replace) gives its own
  values of those keys."""
  values = config._raw if isinstance(config, _Resolved) else config.as_dict()
  schema = defaults()
  return {k: thaw(v) for k, v in values.items() if k in schema}


def replace(config: Config, **changes) -> Config:
  """`config` with some of base.yml's keys changed, validated and derived again on its devices, as if the changes
  had been given on the command line (without the preset rule): a change the checks refuse raises ConfigError, and
  every derived key follows the keys it comes from. Values are coerced to base.yml's types, paths made absolute.

  Config.replace changes keys without either; it is for tests that need a config the checks would refuse."""
  if not isinstance(config, _Resolved):
    raise TypeError(
      "pyconfig.replace needs a Config made by pyconfig.load or pyconfig.finalize (they keep the values it was "
      "derived from); this one was made by Config(...) or Config.replace"
    )
  schema = defaults()
  not_in_schema = sorted(set(changes) - set(schema))
  if not_in_schema:
    raise KeyError(
      f"{not_in_schema} are not keys of base.yml (a derived key follows the keys it comes from); replace those instead"
    )
  values = dict(config._raw)
  for key, value in changes.items():
    typed = config_parse.coerce(key, value, schema[key], from_text=False)
    values[key] = absolute_path(typed) if key in PATH_KEYS else typed
  config_validate.validate(values)
  return finalize(values, config.num_devices, config.num_slices)
