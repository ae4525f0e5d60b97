"""Configuration, part one: reading. A YAML file and its `base_config:` chain, a model preset, `M_<KEY>`
environment variables and `key=value` overrides become one dict of typed values.

`configs/base.yml` is the schema: every key that may be set exists there, and a value is coerced to the type of
its default. Reading opens yml files and nothing else: no devices, no directories, no network, no JAX (this
module imports neither the layers nor jax). What the values mean is checked by config_validate, and the values
computed from them by config_derive; pyconfig ties the three together.
"""

import copy
import difflib
import functools
import math
import os
import stat
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import yaml

from MaxText import storage
from MaxText.common_types import ConfigError, cut, freeze, shown

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
BASE_YML = os.path.join(CONFIGS_DIR, "base.yml")
MODELS_DIR = os.path.join(CONFIGS_DIR, "models")

# Keys holding a local path or a URL (gs://...). A local one is made absolute once, in `read`, against the
# directory the command was started from: Orbax refuses relative checkpoint paths, and later code may change
# directory.
PATH_KEYS = (
  "base_output_directory",
  "load_parameters_path",
  "load_full_state_path",
  "metrics_file",
  "compiled_trainstep_file",
  "jax_cache_dir",
  "save_quantized_params_path",
)


# Deepest nesting of lists and mappings a config value may have (base.yml's deepest, logical_axis_rules, has 3):
# PyYAML composes a node per level by recursion, so a few thousand "[" would end in a RecursionError.
MAX_YAML_DEPTH = 32


class _Refused(yaml.MarkedYAMLError):
  """YAML that is valid but not accepted in a config; `problem` says what, `problem_mark` where."""


class _ConfigLoader(yaml.SafeLoader):
  """yaml.SafeLoader (no Python tags) for configs, which also refuses:

  - anchors and aliases (&name, *name) and merge keys (<<): nested aliases expand exponentially (the "billion
    laughs": a few lines make gigabytes, and the parse never ends), and a config has no need of them;
  - nesting deeper than MAX_YAML_DEPTH;
  - a key given twice in one mapping (PyYAML silently keeps the last);
  - an integer of more digits than Python converts (a ValueError, not a YAMLError, from PyYAML).
  """

  _depth = 0

  def compose_node(self, parent, index):
    event = self.peek_event()
    if getattr(event, "anchor", None) is not None:  # An AliasEvent's anchor is the name it refers to.
      raise _Refused(
        problem="YAML anchors and aliases (&name, *name) are not supported; write the value out",
        problem_mark=event.start_mark,
      )
    if self._depth >= MAX_YAML_DEPTH:
      raise _Refused(problem=f"values nested over {MAX_YAML_DEPTH} deep are not supported", problem_mark=event.start_mark)
    self._depth += 1
    try:
      return super().compose_node(parent, index)
    finally:
      self._depth -= 1

  def construct_mapping(self, node, deep=False):
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":
        raise _Refused(problem="merge keys (<<) are not supported; write the keys out", problem_mark=key_node.start_mark)
    keys = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if not isinstance(key, Hashable):
        continue  # SafeConstructor refuses it below.
      if key in keys:
        raise _Refused(problem=f"key {shown(key)} is given twice; give it once", problem_mark=key_node.start_mark)
      keys.add(key)
    return super().construct_mapping(node, deep=deep)

  def construct_yaml_int(self, node):
    try:
      return super().construct_yaml_int(node)
    except ValueError:
      digits = len(str(node.value))
      raise _Refused(
        problem=f"an integer of {digits} digits is too large; give a smaller number", problem_mark=node.start_mark
      ) from None


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)


def _load_yaml(stream) -> Any:
  """One YAML document (a str or a text file) through _ConfigLoader."""
  loader = _ConfigLoader(stream)
  try:
    return loader.get_single_data()
  finally:
    loader.dispose()


def _version(path: str) -> tuple[int, int, int]:
  """What tells one content of the file at `path` from another (for _parsed's cache): inode, size, mtime in ns."""
  status = os.stat(path)
  return status.st_ino, status.st_size, status.st_mtime_ns


@functools.lru_cache(maxsize=32)
def _parsed(path: str, *version) -> Any:
  """The YAML document in the file at `path`, parsed once per `version` (_version): a command reads base.yml
  twice, as its schema and as its config file, and that parse is 0.1 s of a 2-core machine's start-up. Callers
  deep-copy what it returns."""
  with open(path, encoding="utf-8") as f:
    return _load_yaml(f)


def _yaml_problem(e: yaml.YAMLError) -> str:
  """A PyYAML error in one line: what is wrong (its first line when it has no problem text) and the line."""
  if isinstance(e, yaml.MarkedYAMLError) and e.problem:
    where = f"line {e.problem_mark.line + 1}: " if e.problem_mark is not None else ""
    what = f"{e.context} {e.problem}" if e.context else e.problem  # e.g. "expected a single document ... but found ..."
    return cut(where + " ".join(what.split()))
  return cut(" ".join((str(e).splitlines() or [type(e).__name__])[0].split()))


def _read_yml(path: str, seen=()) -> dict:
  """Reads a yml file, following `base_config:` (relative to the file's folder) first. A path that is not a
  regular file is refused before it is opened: reading /dev/zero or a FIFO would never end."""
  what = f"config file {shown(path)}"
  try:
    mode = os.stat(path).st_mode
  except (FileNotFoundError, NotADirectoryError):
    raise ConfigError(f"{what} does not exist; pass the path of a yml file such as MaxText/configs/base.yml") from None
  except (OSError, ValueError) as e:  # ValueError: a NUL character in the path.
    raise ConfigError(f"{what} cannot be read ({cut(str(getattr(e, 'strerror', None) or e))}); pass another path") from None
  if not stat.S_ISREG(mode):
    raise ConfigError(f"{what} is {storage.file_kind(mode)}, not a regular file; pass the path of a yml file")
  real = os.path.realpath(path)
  if real in seen:
    raise ConfigError(f"base_config loop through {what}; remove the cycle")
  try:
    values = copy.deepcopy(_parsed(real, *_version(real)))
  except OSError as e:
    raise ConfigError(f"{what} cannot be read ({e.strerror}); pass a readable file") from None
  except UnicodeDecodeError as e:
    raise ConfigError(f"{what} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
  except _Refused as e:
    raise ConfigError(f"{what} {_yaml_problem(e)}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{what} is not valid YAML ({_yaml_problem(e)}); fix its syntax") from None
  if values is None:  # An empty file, or comments only.
    values = {}
  if not isinstance(values, dict):
    raise ConfigError(f"{what} must hold a mapping of key: value, not a {type(values).__name__}")
  for key in values:
    if not isinstance(key, str):
      raise ConfigError(f"{what}: key {shown(key)} is not a name; keys are the names in MaxText/configs/base.yml")
  parent = values.pop("base_config", None)
  if parent is not None and not isinstance(parent, str):
    raise ConfigError(f"{what}: base_config={shown(parent)} is not a path; give the path of the yml it extends")
  if parent:
    parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
    if not os.path.lexists(parent_path) and os.path.isfile(os.path.join(CONFIGS_DIR, parent)):
      parent_path = os.path.join(CONFIGS_DIR, parent)
    return {**_read_yml(parent_path, (*seen, real)), **values}
  return values


def defaults() -> dict:
  """base.yml's keys with their default values: the schema."""
  return _read_yml(BASE_YML)


def _unknown_key_error(key: str, schema: Mapping, where: str) -> ConfigError:
  close = difflib.get_close_matches(key, list(schema), n=1)
  hint = f"did you mean {close[0]!r}?" if close else "see MaxText/configs/base.yml for the valid keys"
  return ConfigError(f"unknown config key {shown(key)} {where}; {hint}")


def coerce(key: str, value: Any, default: Any, from_text: bool) -> Any:
  """Coerces `value` to the type of the schema's `default`; strings from argv/env (`from_text`) are parsed as YAML."""
  if from_text and not isinstance(default, str):
    try:
      value = _load_yaml(value) if value != "" else ""
    except _Refused as e:
      raise ConfigError(f"{key}={shown(value)}: {e.problem}") from None
    except yaml.YAMLError:
      pass
  if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
    try:  # YAML 1.1 reads "1e-3" as a string.
      value = float(value)
    except ValueError:
      pass
  for kind, to_kind in _COERCIONS:  # bool before int: a bool is an int to isinstance.
    if isinstance(default, kind):
      return to_kind(key, value, default, from_text)
  return freeze(value)


def _to_bool(key: str, value: Any, default: bool, from_text: bool) -> bool:
  del default, from_text
  if isinstance(value, str) and value.lower() in ("true", "false"):
    return value.lower() == "true"
  if isinstance(value, bool):
    return value
  raise ConfigError(f"{key}={shown(value)} is not a boolean; use {key}=true or {key}=false")


def _to_int(key: str, value: Any, default: int, from_text: bool) -> int:
  if isinstance(value, float) and value.is_integer() and not from_text:  # A yml's 10000.0 (e.g. imported rope_theta).
    return int(value)
  if isinstance(value, int) and not isinstance(value, bool):
    return value
  raise ConfigError(f"{key}={shown(value)} is not an integer; give a whole number such as {key}={default}")


def _to_float(key: str, value: Any, default: float, from_text: bool) -> float:
  del from_text
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise ConfigError(f"{key}={shown(value)} is not a number; give a number such as {key}={default}")
  try:
    number = float(value)
  except OverflowError:  # An int beyond a float's range.
    number = math.inf
  if not math.isfinite(number):  # No key means anything by nan or inf: they would reach the first step.
    raise ConfigError(f"{key}={shown(value)} is not a finite number; give a number such as {key}={default}")
  return number


def _to_str(key: str, value: Any, default: str, from_text: bool) -> str:
  del default, from_text
  if isinstance(value, (str, int, float)) and not isinstance(value, bool):
    return str(value)
  raise ConfigError(f"{key}={shown(value)} is not a string; quote it")


def _to_list(key: str, value: Any, default: list, from_text: bool) -> tuple:
  del from_text
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"{key}={shown(value)} is not a list; give a YAML list such as {key}='{list(default)}'")
  # A default of names wants names; an empty default (reward_functions, reward_weights) leaves the check to its owner.
  if default and all(isinstance(v, str) for v in default) and not all(isinstance(v, str) for v in value):
    raise ConfigError(f"{key}={shown(value)} is not a list of names; give e.g. {key}='{list(default)}'")
  return freeze(value)


# The schema default's type -> how a value becomes one, in the order `coerce` tries them.
_COERCIONS = ((bool, _to_bool), (int, _to_int), (float, _to_float), (str, _to_str), (list, _to_list))


def _parse_overrides(argv: Sequence[str], schema: Mapping) -> dict:
  overrides = {}
  for arg in argv:
    if "=" not in arg:
      raise ConfigError(f"argument {shown(arg)} is not of the form key=value; write overrides as key=value after the yml")
    key, value = arg.split("=", 1)
    if key not in schema:
      raise _unknown_key_error(key, schema, "on the command line")
    if key in overrides:
      raise ConfigError(f"{key} is given twice on the command line; give it once")
    overrides[key] = value
  return overrides


def _parse_env(env: Mapping[str, str], schema: Mapping) -> dict[str, tuple[str, str]]:
  """key -> (the M_<KEY> variable as the user spelled it, its value)."""
  values = {}
  for name, value in env.items():
    if name.startswith("M_") and len(name) > 2:
      key = name[2:].lower()
      if key not in schema:
        raise _unknown_key_error(key, schema, f"in environment variable {shown(name)}")
      if key in values:
        raise ConfigError(f"environment variables {values[key][0]} and {name} both set {key}; set one of them")
      values[key] = (name, value)
  return values


def _model_preset_path(model_name: str) -> str:
  if model_name.endswith((".yml", ".yaml")):
    if not os.path.lexists(model_name):  # Anything else there, _read_yml says what it is.
      raise ConfigError(f"model_name={shown(model_name)}: file not found; give an existing model yml or a preset name")
    return model_name
  path = os.path.join(MODELS_DIR, f"{model_name}.yml")
  if not os.path.isfile(path):
    presets = sorted(f[:-4] for f in os.listdir(MODELS_DIR) if f.endswith(".yml"))
    raise ConfigError(f"model_name={shown(model_name)} is not a preset; choose 'default' or one of {', '.join(presets)}")
  return path


def read(argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict:
  """Reads `[config.yml, key=value, ...]` into typed values of the schema's keys, not yet validated.

  Precedence, lowest first: base.yml < the given yml (and its base_config chain) < the model preset <
  M_<KEY> environment variables < command line. A key given both in the environment and on the command
  line is an error, as is a key set by the model preset and by the user without override_model_config.
  """
  env = os.environ if env is None else env
  if not argv:
    raise ConfigError("no config file given; run e.g. `python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME`")
  schema = defaults()
  file_values = _read_yml(argv[0])
  for key in file_values:
    if key not in schema:
      raise _unknown_key_error(key, schema, f"in {argv[0]}")
  cli = _parse_overrides(argv[1:], schema)
  env_values = _parse_env(env, schema)
  both = sorted(set(cli) & set(env_values))
  if both:
    raise ConfigError(f"{both[0]} is set both on the command line and as {env_values[both[0]][0]}; set it in one place")
  values = {k: coerce(k, v, schema[k], False) for k, v in {**schema, **file_values}.items()}
  for key, value in {**{key: value for key, (_, value) in env_values.items()}, **cli}.items():
    try:
      values[key] = coerce(key, value, schema[key], True)
    except ConfigError as e:
      if key in cli:
        raise
      raise ConfigError(f"environment variable {env_values[key][0]}: {e}") from None
  if values["model_name"] != "default":
    _apply_preset(values, {*cli, *env_values}, schema)
  for key in PATH_KEYS:
    values[key] = absolute_path(values[key])
  return values


def _apply_preset(values: dict, user: Collection[str], schema: Mapping) -> None:
  """Sets the keys of model_name's preset in `values`, except those the `user` set (an error without
  override_model_config)."""
  preset_path = _model_preset_path(values["model_name"])
  for key, value in _read_yml(preset_path).items():
    if key not in schema:
      raise _unknown_key_error(key, schema, f"in model preset {preset_path}")
    if key in user and not values["override_model_config"]:
      raise ConfigError(
        f"{key} is set by model_name={values['model_name']} and again by you; "
        "pass override_model_config=true to override the preset"
      )
    if key not in user:
      values[key] = coerce(key, value, schema[key], False)


def absolute_path(path: str) -> str:
  """A local path made absolute (with ~ expanded); a URL such as gs://bucket/dir, or "", as it is."""
  if not path or storage.is_remote(path):
    return path
  return os.path.abspath(os.path.expanduser(path))
