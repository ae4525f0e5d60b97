"""Configuration: a YAML file, `base_config:` inheritance, a model preset, `M_<KEY>` environment variables
and `key=value` overrides, resolved into one frozen, typed `Config` (common_types).

`configs/base.yml` is the schema: every key that may be set exists there, and a value is coerced to the
type of its default. Parsing reads yml files and nothing else (no devices, no directories). Keys with a fixed
set of values are checked against the lists of the modules that give the values their meaning (the model
families, remat policies, dtypes, data pipelines, ...), which is why this module sits above the layers.

  parse(argv)                          -> dict of typed raw values (device independent)
  derive(raw, num_devices, num_slices) -> dict of derived values (the one place they are computed)
  load(argv, num_devices, num_slices)  -> Config

A user mistake raises `ConfigError` whose message names the key, the value and the fix.
"""

import difflib
import math
import os
import stat
import types
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

import yaml

from MaxText import families, input_pipeline, lora, metrics, optimizers, storage
from MaxText.common_types import Config, ConfigError, cut, freeze, shown, thaw
from MaxText.inference import sampling
from MaxText.input_pipeline import tokenizer
from MaxText.layers import attention_kernels, context_parallel, embeddings, linears, models

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
BASE_YML = os.path.join(CONFIGS_DIR, "base.yml")
MODELS_DIR = os.path.join(CONFIGS_DIR, "models")

# Mesh axes of the parallelism keys: `ici_<name>_parallelism` and `dcn_<name>_parallelism` set the size
# of mesh axis <axis>. Only these keys name mesh axes outside `logical_axis_rules`.
PARALLELISM_AXES = {
  "data": "data",
  "pipeline": "stage",
  "fsdp": "fsdp",
  "sequence": "sequence",
  "context": "context",
  "tensor": "tensor",
  "expert": "expert",
}
_NAME_OF_AXIS = {axis: name for name, axis in PARALLELISM_AXES.items()}  # mesh axis -> its *_parallelism keys' name
# Axes whose layers do not exist yet: a size above 1 is refused rather than silently ignored.
UNSUPPORTED_AXES: dict[str, str] = {}

# Keys holding a local path or a URL (gs://...). A local one is made absolute once, in `parse`, against the
# directory the command was started from: Orbax refuses relative checkpoint paths, and later code may change
# directory.
PATH_KEYS = (
  "base_output_directory",
  "load_parameters_path",
  "load_full_state_path",
  "metrics_file",
  "compiled_trainstep_file",
  "jax_cache_dir",
)

# `hardware` -> the JAX platform it runs on (cli.configure_jax sets jax_platforms from it).
HARDWARE_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def choices() -> dict[str, Collection[str]]:
  """Each key with a fixed set of values -> those values, read from the module that owns them (at call time, so
  a family registered after import counts)."""
  return {
    "hardware": HARDWARE_PLATFORMS,
    "dtype": linears.DTYPES,
    "weight_dtype": linears.DTYPES,
    "matmul_precision": linears.PRECISIONS,
    "remat_policy": models.REMAT_POLICIES,
    "attention": attention_kernels.KERNELS,
    "rope_type": embeddings.ROPE_TYPES,
    "decoder_block": families.FAMILIES,
    "tokenizer_type": tokenizer.LOADERS,
    "dataset_type": input_pipeline.DATASET_TYPES,
    "profiler": metrics.PROFILERS,
    "decode_sampling_strategy": sampling.STRATEGIES,
    "attention_type": ("global", "mla"),
    "opt_type": optimizers.OPTIMIZERS,
    "lr_schedule_type": optimizers.SCHEDULES,
    "wsd_decay_style": optimizers.WSD_DECAY_STYLES,
    "mu_dtype": ("", *linears.DTYPES),
    "hf_lora_export": ("merged", "adapter", "base"),
    "context_parallel_strategy": context_parallel.STRATEGIES,
  }


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
    with open(path, encoding="utf-8") as f:
      values = _load_yaml(f)
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


def _coerce(key: str, value: Any, default: Any, from_text: bool) -> Any:
  """Coerces `value` to the type of the schema's `default`; strings from argv/env are parsed as YAML."""
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
  if isinstance(default, bool):
    if isinstance(value, str) and value.lower() in ("true", "false"):
      return value.lower() == "true"
    if isinstance(value, bool):
      return value
    raise ConfigError(f"{key}={shown(value)} is not a boolean; use {key}=true or {key}=false")
  if isinstance(default, int):
    if isinstance(value, float) and value.is_integer() and not from_text:  # A yml's 10000.0 (e.g. imported rope_theta).
      return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{key}={shown(value)} is not an integer; give a whole number such as {key}={default}")
  if isinstance(default, float):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      try:
        number = float(value)
      except OverflowError:  # An int beyond a float's range.
        number = math.inf
      if not math.isfinite(number):  # No key means anything by nan or inf: they would reach the first step.
        raise ConfigError(f"{key}={shown(value)} is not a finite number; give a number such as {key}={default}")
      return number
    raise ConfigError(f"{key}={shown(value)} is not a number; give a number such as {key}={default}")
  if isinstance(default, str):
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
    raise ConfigError(f"{key}={shown(value)} is not a string; quote it")
  if isinstance(default, list):
    if isinstance(value, (list, tuple)):
      if all(isinstance(v, str) for v in default) and not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}={shown(value)} is not a list of names; give e.g. {key}='{list(default)}'")
      return freeze(value)
    raise ConfigError(f"{key}={shown(value)} is not a list; give a YAML list such as {key}='{list(default)}'")
  return freeze(value)


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


def parse(argv: Sequence[str], env: Mapping[str, str] | None = None) -> dict:
  """Parses `[config.yml, key=value, ...]` into typed values of the schema's keys (no derived values).

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
  user = {**{key: value for key, (_, value) in env_values.items()}, **cli}

  def typed(key, value, from_text):
    return _coerce(key, value, schema[key], from_text)

  values = {k: typed(k, v, False) for k, v in {**schema, **file_values}.items()}
  for key, value in user.items():
    try:
      values[key] = typed(key, value, True)
    except ConfigError as e:
      if key in cli:
        raise
      raise ConfigError(f"environment variable {env_values[key][0]}: {e}") from None

  if values["model_name"] != "default":
    preset_path = _model_preset_path(values["model_name"])
    preset = _read_yml(preset_path)
    for key, value in preset.items():
      if key not in schema:
        raise _unknown_key_error(key, schema, f"in model preset {preset_path}")
      if key in user and not values["override_model_config"]:
        raise ConfigError(
          f"{key} is set by model_name={values['model_name']} and again by you; "
          "pass override_model_config=true to override the preset"
        )
      if key not in user:
        values[key] = typed(key, value, False)
  for key in PATH_KEYS:
    values[key] = absolute_path(values[key])
  _validate(values)
  return values


def absolute_path(path: str) -> str:
  """A local path made absolute (with ~ expanded); a URL such as gs://bucket/dir, or "", as it is."""
  if not path or storage.is_remote(path):
    return path
  return os.path.abspath(os.path.expanduser(path))


def _check_run_name(values: Mapping) -> None:
  """run_name names one folder under base_output_directory, so nothing that leads anywhere else."""
  name = values["run_name"]
  if "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in name):
    raise ConfigError(
      f"run_name={shown(name)} must be one plain folder name: no '/' or '\\', not '.' or '..', no control characters "
      "(it names the run's folder under base_output_directory)"
    )


# Longest file or folder name, and longest path, in bytes (Linux's NAME_MAX and PATH_MAX less the NUL; macOS's
# NAME_MAX is 255 too): beyond them every open fails with ENAMETOOLONG, some only after the run has started.
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095


def _check_path_names(values: Mapping) -> None:
  """run_name and the local paths of PATH_KEYS: names the file system takes (the bytes of each name, as os.fsencode
  encodes it, within NAME_MAX_BYTES; no NUL character)."""
  paths = [("run_name", values["run_name"])]
  paths += [(key, values[key]) for key in PATH_KEYS if values[key] and not storage.is_remote(values[key])]
  for key, path in paths:
    try:
      encoded = os.fsencode(path)
    except UnicodeEncodeError:
      raise ConfigError(f"{key}={shown(path)} cannot be encoded as a file name; use characters of your locale") from None
    if b"\0" in encoded:
      raise ConfigError(f"{key}={shown(path)} holds a NUL character, which no file name may; remove it")
    if len(encoded) > PATH_MAX_BYTES:
      raise ConfigError(f"{key}={shown(path)} is {len(encoded)} bytes long; a path may have {PATH_MAX_BYTES}")
    for name in encoded.split(b"/"):
      if len(name) > NAME_MAX_BYTES:
        raise ConfigError(
          f"{key}={shown(path)}: the name {shown(os.fsdecode(name), 60)} is {len(name)} bytes long; a file or folder "
          f"name may have {NAME_MAX_BYTES} bytes, so shorten it"
        )


def _check_local_paths(values: Mapping) -> None:
  """Paths read by libraries that take local files only (SentencePiece, safetensors, the HF folder layout)."""
  for key in ("tokenizer_path", "hf_model_path"):
    if storage.is_remote(values[key]):
      raise ConfigError(
        f"{key}={cut(values[key])} must be a local path; copy it first (e.g. gsutil -m cp -r {cut(values[key])} .) or use a "
        "gcsfuse mount"
      )


def _validate(values: Mapping) -> None:
  """Checks that need no devices: choices, ranges, the model's shape, the axis rules, and the family's own."""
  _check_choices(values)
  _check_run_name(values)
  _check_path_names(values)
  _check_local_paths(values)
  _check_model(values)
  _check_training(values)
  _check_axis_rules(values)
  _check_attention(values)
  _check_layers(values)
  _check_moe(values)
  lora.check({**values, **_model_dims(values)})
  families.get(values["decoder_block"]).check(values)


def _check_choices(values: Mapping) -> None:
  for key, valid in choices().items():
    if values[key] not in valid:
      raise ConfigError(f"{key}={shown(values[key])} is not supported; choose one of {', '.join(map(repr, valid))}")
  if not values["mlp_activations"]:
    raise ConfigError("mlp_activations=[] is empty; give at least one activation, e.g. ['silu','linear']")
  for act in values["mlp_activations"]:
    if act not in linears.ACTIVATIONS:
      raise ConfigError(f"mlp_activations contains {shown(act)}; choose among {', '.join(linears.ACTIVATIONS)}")


def _check_positive(values: Mapping, keys: Sequence[str]) -> None:
  for key in keys:
    if values[key] <= 0:
      raise ConfigError(f"{key}={shown(values[key])} must be positive")


def _check_model(values: Mapping) -> None:
  shape = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers")
  _check_positive(values, (*shape, "head_dim", "vocab_size", "max_target_length"))
  _check_positive(values, ("rope_min_timescale", "rope_max_timescale", "rope_scaling_factor"))
  if values["rope_type"] == "yarn":
    _check_positive(values, ("original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow"))
  if values["vocab_size"] >= 2**31:
    raise ConfigError(f"vocab_size={values['vocab_size']} does not fit the int32 token ids; give a size below 2**31")
  if values["base_num_query_heads"] % values["base_num_kv_heads"]:
    raise ConfigError(
      f"base_num_query_heads={values['base_num_query_heads']} is not a multiple of "
      f"base_num_kv_heads={values['base_num_kv_heads']}; grouped-query attention needs whole groups"
    )
  if values["fused_qkv"] and values["base_num_query_heads"] != values["base_num_kv_heads"]:
    raise ConfigError(
      f"fused_qkv=true needs base_num_kv_heads == base_num_query_heads (now {values['base_num_kv_heads']} and "
      f"{values['base_num_query_heads']}): its one matmul makes queries, keys and values of one shape; set fused_qkv=false"
    )
  tiles, length = values["num_vocab_tiling"], values["max_target_length"]
  if tiles < 1 or length % tiles:
    raise ConfigError(
      f"num_vocab_tiling={tiles} must be a positive divisor of max_target_length={length}: each chunk takes every "
      "row's tokens j, j + n, ...; choose e.g. num_vocab_tiling=4"
    )
  if not 0.0 <= values["dropout_rate"] < 1.0:
    raise ConfigError(f"dropout_rate={values['dropout_rate']} must be in [0, 1)")
  if values["rope_high_freq_factor"] <= values["rope_low_freq_factor"]:
    raise ConfigError(
      f"rope_high_freq_factor={values['rope_high_freq_factor']} must exceed "
      f"rope_low_freq_factor={values['rope_low_freq_factor']}"
    )


def _check_training(values: Mapping) -> None:
  _check_positive(values, ("log_period", "checkpoint_period", "gradient_accumulation_steps", "per_device_batch_size"))
  if values["steps"] == -1 and values["learning_rate_schedule_steps"] == -1:
    raise ConfigError("steps=-1 needs learning_rate_schedule_steps set; give one of them a positive value")
  if values["steps"] < -1 or values["steps"] == 0:
    raise ConfigError(f"steps={shown(values['steps'])} must be positive (or -1 to take learning_rate_schedule_steps)")
  # The step counts the compiled step sees: the optimizer's int32 step count against the schedule's boundaries (a
  # count past 2**31 - 1 overflows the jit's int32 arguments) and the accumulation scan's length.
  for key in ("steps", "learning_rate_schedule_steps", "gradient_accumulation_steps"):
    if values[key] >= 2**31:
      raise ConfigError(
        f"{key}={shown(values[key])} does not fit the int32 step counts of the compiled step; give at most {2**31 - 1}"
      )
  if not 0.0 <= values["warmup_steps_fraction"] <= 1.0:
    raise ConfigError(f"warmup_steps_fraction={values['warmup_steps_fraction']} must be in [0, 1]")
  if values["lr_schedule_type"] == "wsd":
    warmup, decay = values["warmup_steps_fraction"], values["wsd_decay_steps_fraction"]
    if not 0.0 <= decay <= 1.0 or warmup + decay > 1.0:
      raise ConfigError(
        f"wsd_decay_steps_fraction={decay} with warmup_steps_fraction={warmup}: the decay must be in [0, 1] and "
        "fit after the warmup (their sum at most 1)"
      )
  if values["mu_dtype"] and values["opt_type"] not in optimizers.USES_MU_DTYPE:
    raise ConfigError(
      f"mu_dtype={values['mu_dtype']} is used by opt_type {' and '.join(optimizers.USES_MU_DTYPE)} only; unset it "
      f"(mu_dtype='') for opt_type={values['opt_type']}"
    )
  if not 0.0 <= values["muon_beta"] < 1.0 or values["muon_consistent_rms"] < 0:
    raise ConfigError(
      f"muon_beta={values['muon_beta']} must be in [0, 1) and muon_consistent_rms={values['muon_consistent_rms']} >= 0"
    )
  if not 0.0 <= values["learning_rate_final_fraction"] <= 1.0:
    raise ConfigError(f"learning_rate_final_fraction={values['learning_rate_final_fraction']} must be in [0, 1]")
  if values["use_sft"] and values["dataset_type"] == "synthetic":
    raise ConfigError("use_sft=true trains on conversations; set dataset_type to grain, tfds or hf")
  if values["use_dpo"]:
    if values["use_sft"]:
      raise ConfigError("use_dpo=true and use_sft=true: DPO trains on preference pairs, SFT on conversations; set one")
    if values["dataset_type"] == "synthetic":
      raise ConfigError("use_dpo=true trains on preference pairs; set dataset_type to grain, tfds or hf")
    if values["dpo_beta"] <= 0 or not 0.0 <= values["dpo_label_smoothing"] <= 0.5:
      raise ConfigError(
        f"dpo_beta={values['dpo_beta']} must be > 0 and dpo_label_smoothing={values['dpo_label_smoothing']} in [0, 0.5]"
      )
    if values["num_vocab_tiling"] > 1:
      raise ConfigError(f"num_vocab_tiling={values['num_vocab_tiling']}: DPO computes whole logits; set num_vocab_tiling=1")
  if values["eval_interval"] > 0 and values["eval_steps"] < 1 and values["dataset_type"] == "synthetic":
    raise ConfigError(f"eval_steps={values['eval_steps']}: synthetic data has no end; set eval_steps to a positive count")
  if values["eval_per_device_batch_size"] < 0:
    raise ConfigError(
      f"eval_per_device_batch_size={values['eval_per_device_batch_size']} must be >= 0 (0: per_device_batch_size)"
    )
  if values["learning_rate"] < 0:
    raise ConfigError(f"learning_rate={values['learning_rate']} is negative; give a peak learning rate >= 0")
  if values["max_num_checkpoints_to_keep"] < 0:
    raise ConfigError(
      f"max_num_checkpoints_to_keep={values['max_num_checkpoints_to_keep']} is negative; give a count (0 keeps all)"
    )
  for key in ("init_weights_seed", "decode_sampling_seed"):  # jax.random.key takes a 32-bit seed.
    if not -(2**31) <= values[key] < 2**32:
      raise ConfigError(f"{key}={shown(values[key])} does not fit 32 bits; give a seed in [-2**31, 2**32)")
  if values["load_parameters_path"] and values["load_full_state_path"]:
    raise ConfigError("load_parameters_path and load_full_state_path are both set; give at most one")


def _check_layers(values: Mapping) -> None:
  """The family's layer kinds: its attention (attention_type; MaxText's key, which the family decides) and how
  many dense layers come before its MoE layers."""
  block = values["decoder_block"]
  family = families.get(block)
  if (values["attention_type"] == "mla") != family.mla:
    need = "mla" if family.mla else "global"
    raise ConfigError(
      f"attention_type={shown(values['attention_type'])}: decoder_block={block} needs attention_type={need!r}"
    )
  first, layers = values["first_num_dense_layers"], values["base_num_decoder_layers"]
  if first and family.dense_layer is None:
    with_dense = ", ".join(name for name, f in families.FAMILIES.items() if f.dense_layer is not None)
    raise ConfigError(
      f"first_num_dense_layers={first}: decoder_block={block} has no dense layers; set it to 0 ({with_dense} has)"
    )
  if not 0 <= first < layers:
    raise ConfigError(
      f"first_num_dense_layers={first} must be in [0, base_num_decoder_layers={layers}): a mixture-of-experts "
      "family needs at least one MoE layer"
    )


def _check_moe(values: Mapping) -> None:
  """A mixture-of-experts family needs experts to route to; a dense one has none."""
  n, k, block = values["num_experts"], values["num_experts_per_tok"], values["decoder_block"]
  moe = [name for name, family in families.FAMILIES.items() if family.moe]
  if families.get(block).moe:
    if n < 2:
      raise ConfigError(f"num_experts={n}: decoder_block={block} is a mixture of experts; give num_experts >= 2")
    if not 1 <= k <= n:
      raise ConfigError(f"num_experts_per_tok={k} must be in [1, num_experts={n}]")
    if values["base_moe_mlp_dim"] == 0 or values["base_moe_mlp_dim"] < -1:
      raise ConfigError(f"base_moe_mlp_dim={values['base_moe_mlp_dim']} must be positive, or -1 to take base_mlp_dim")
  elif n != 1:
    raise ConfigError(
      f"num_experts={n}: decoder_block={block} has a dense MLP; set num_experts=1 or use a mixture-of-experts family "
      f"({', '.join(moe)})"
    )
  sigmoid, groups, top_groups = (
    values["routed_score_func"] == "sigmoid",
    values["n_routing_groups"],
    values["topk_routing_group"],
  )
  if values["routed_score_func"] not in ("", "softmax", "sigmoid"):
    raise ConfigError(
      f"routed_score_func={shown(values['routed_score_func'])} is not supported; choose '' (softmax) or 'sigmoid'"
    )
  if (values["routed_bias"] or groups > 0) and not sigmoid:
    raise ConfigError("routed_bias and n_routing_groups apply to sigmoid routing; set routed_score_func=sigmoid")
  if groups > 0 and (n % groups or not 1 <= top_groups <= groups or k > top_groups * (n // groups) or n // groups < 2):
    raise ConfigError(
      f"n_routing_groups={groups}, topk_routing_group={top_groups}: the groups must split num_experts={n} evenly into "
      f"groups of at least 2, with 1 <= topk_routing_group <= n_routing_groups holding num_experts_per_tok={k} experts"
    )
  if values["routed_bias_update_rate"] < 0 or (values["routed_bias_update_rate"] > 0 and not values["routed_bias"]):
    raise ConfigError(
      f"routed_bias_update_rate={values['routed_bias_update_rate']} must be >= 0, and updates the bias of "
      "routed_bias=true (sigmoid routing); set routed_bias=true or the rate to 0"
    )
  if values["routed_scaling_factor"] <= 0 or values["shared_experts"] < 0 or values["load_balance_loss_weight"] < 0:
    raise ConfigError(
      f"routed_scaling_factor={values['routed_scaling_factor']} must be positive, shared_experts="
      f"{values['shared_experts']} and load_balance_loss_weight={values['load_balance_loss_weight']} >= 0"
    )


def _check_attention(values: Mapping) -> None:
  """What the chosen attention kernel cannot do, known before any device work (attention_kernels raises the same
  errors when the step is traced, for anything only the traced shapes tell)."""
  name, settings = values["attention"], types.SimpleNamespace(**values)
  if name.startswith("cudnn"):
    if values["hardware"] != "gpu":
      raise ConfigError(
        f"attention={name} is cuDNN fused attention, for NVIDIA GPUs; set hardware=gpu, or use attention=flash"
      )
    head_dim = values["head_dim"]
    if values["attention_type"] == "mla":  # the width MLA gives the kernel (attention_mla.py pads to it)
      head_dim = max(values["qk_nope_head_dim"] + values["qk_rope_head_dim"], values["v_head_dim"])
    shape = (1, values["max_target_length"], values["base_num_query_heads"], head_dim)
    window, cap = values["sliding_window_size"], values["attn_logits_soft_cap"]
    reason = attention_kernels.cudnn_unsupported_reason(settings, shape, linears.DTYPES[values["dtype"]], window, cap)
    if reason:
      raise ConfigError(f"attention={name}: {reason}; use attention=flash or attention=dot_product")
  if name == "flash" and (values["hardware"] == "tpu" or values["compile_topology"]):
    attention_kernels.splash_block_sizes(settings, values["max_target_length"])


def _check_axis_rules(values: Mapping) -> None:
  if sorted(values["mesh_axes"]) != sorted(PARALLELISM_AXES.values()):
    raise ConfigError(
      f"mesh_axes={shown(thaw(values['mesh_axes']))} must be an ordering of {sorted(PARALLELISM_AXES.values())}"
    )
  for rule in values["logical_axis_rules"]:
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules entry {shown(thaw(rule))} is not [logical_name, [mesh_axes]]")
    for axis in _rule_axes(rule[1]):
      if axis not in values["mesh_axes"]:
        raise ConfigError(
          f"logical_axis_rules maps {shown(rule[0])} to unknown mesh axis {shown(axis)}; use one of "
          f"{list(values['mesh_axes'])}"
        )


def _rule_axes(mesh_axes) -> tuple[str, ...]:
  """The mesh axes of one rule's right-hand side: an axis name, or a list of them."""
  return mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)


def _scales(global_parameter_scale: int) -> tuple[int, int, int, int]:
  """MaxText's split of a power-of-2 scale into (emb, heads, mlp, layers) powers of 2."""
  log2 = int(math.log2(global_parameter_scale)) if global_parameter_scale > 0 else -1
  if log2 < 0 or 2**log2 != global_parameter_scale:
    raise ConfigError(f"global_parameter_scale={global_parameter_scale} is not a power of 2; use 1, 2, 4, ...")
  base, rem = divmod(log2, 3)
  heads = base + int(rem > 0)
  return base + int(rem > 1), heads, heads, base


def _fill_axes(kind: str, values: Mapping, total: int) -> dict[str, int]:
  """Sizes of the `{kind}_*_parallelism` axes, with one -1 filling what the others leave of `total`."""
  sizes = {name: values[f"{kind}_{name}_parallelism"] for name in PARALLELISM_AXES}
  fill = [name for name, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ConfigError(
      f"{kind}_{fill[0]}_parallelism and {kind}_{fill[1]}_parallelism are both -1; at most one {kind} axis may be -1"
    )
  for name, size in sizes.items():
    if size == 0 or size < -1:
      raise ConfigError(f"{kind}_{name}_parallelism={size} must be positive or -1")
  known = math.prod(size for size in sizes.values() if size != -1)
  unit = "devices per slice" if kind == "ici" else "slices (DCN granules: TPU slices, else processes)"
  given = " x ".join(f"{kind}_{name}_parallelism={size}" for name, size in sizes.items() if size > 1)
  given = given or f"every {kind}_*_parallelism=1"
  if fill:
    if total % known:
      raise ConfigError(
        f"{given} does not divide the {total} {unit} ({kind}_{fill[0]}_parallelism=-1 fills the rest); "
        f"choose {kind}_*_parallelism values whose product divides {total}"
      )
    sizes[fill[0]] = total // known
  elif known != total:
    raise ConfigError(
      f"{given} makes {known}, not the {total} {unit}; make the product {total}, "
      f"or set one {kind}_*_parallelism to -1 to fill"
    )
  for name, label in UNSUPPORTED_AXES.items():
    if sizes[name] > 1:
      raise ConfigError(f"{kind}_{name}_parallelism={sizes[name]}: {label} is not supported yet; set it to 1")
  return sizes


def derive(values: Mapping, num_devices: int, num_slices: int = 1) -> dict:
  """Every derived value, from the typed raw values and the device topology.

  Model shapes follow MaxText's global_parameter_scale; the mesh is ICI x DCN; batch sizes are global; the
  family adds its own derived keys last.
  """
  d = _model_dims(values)
  d |= _schedule(values)
  d |= _mesh(values, num_devices, num_slices)
  d |= _batches(values, num_devices)
  d |= _pipeline(values, d)
  _check_shards(values, d)
  family = families.get(values["decoder_block"])
  extra = family.derive({**values, **d})
  taken = sorted(set(extra) & (set(values) | set(d)))
  if taken:  # A family adds keys; it never changes those of base.yml or of the derivation above.
    raise ValueError(f"family {family.name} derives {taken}, which exist already; give its keys names of their own")
  return d | extra


def _model_dims(values: Mapping) -> dict:
  emb_scale, head_scale, mlp_scale, layer_scale = _scales(values["global_parameter_scale"])
  return {
    "emb_dim": values["base_emb_dim"] * 2**emb_scale,
    "num_query_heads": values["base_num_query_heads"] * 2**head_scale,
    "num_kv_heads": values["base_num_kv_heads"] * 2**head_scale,
    "mlp_dim": values["base_mlp_dim"] * 2**mlp_scale,
    "moe_mlp_dim": (values["base_moe_mlp_dim"] if values["base_moe_mlp_dim"] > 0 else values["base_mlp_dim"]) * 2**mlp_scale,
    "num_decoder_layers": values["base_num_decoder_layers"] * 2**layer_scale,
  }


def _schedule(values: Mapping) -> dict:
  """steps and learning_rate_schedule_steps, each -1 taking the other; the warmup in steps."""
  steps = values["learning_rate_schedule_steps"] if values["steps"] == -1 else values["steps"]
  schedule = steps if values["learning_rate_schedule_steps"] == -1 else values["learning_rate_schedule_steps"]
  warmup = int(values["warmup_steps_fraction"] * schedule)
  return {"steps": steps, "learning_rate_schedule_steps": schedule, "warmup_steps": warmup}


def _mesh(values: Mapping, num_devices: int, num_slices: int) -> dict:
  """The mesh: ICI axes inside a slice times DCN axes across slices, in mesh_axes order."""
  if num_devices % num_slices:
    raise ConfigError(f"{num_devices} devices do not split evenly into {num_slices} slices")
  ici = _fill_axes("ici", values, num_devices // num_slices)
  dcn = _fill_axes("dcn", values, num_slices)
  ici_shape = tuple(ici[_NAME_OF_AXIS[axis]] for axis in values["mesh_axes"])
  dcn_shape = tuple(dcn[_NAME_OF_AXIS[axis]] for axis in values["mesh_axes"])
  return {
    "ici_mesh_shape": ici_shape,
    "dcn_mesh_shape": dcn_shape,
    "mesh_shape": tuple(i * j for i, j in zip(ici_shape, dcn_shape, strict=True)),
    "num_devices": num_devices,
    "num_slices": num_slices,
  }


def _batches(values: Mapping, num_devices: int) -> dict:
  """Global batch sizes: per_device_batch_size x devices rows per micro-batch, and the eval batch."""
  micro = values["per_device_batch_size"] * num_devices
  if micro < 1 or not float(micro).is_integer():
    raise ConfigError(
      f"per_device_batch_size={values['per_device_batch_size']} x {num_devices} devices = {micro} is not a whole "
      "number of sequences; choose a per_device_batch_size that gives one"
    )
  eval_per_device = values["eval_per_device_batch_size"] or values["per_device_batch_size"]
  eval_batch = eval_per_device * num_devices
  if eval_batch < 1 or not float(eval_batch).is_integer():
    raise ConfigError(
      f"eval_per_device_batch_size={eval_per_device} x {num_devices} devices = {eval_batch} is not a whole number "
      "of sequences; choose another eval_per_device_batch_size"
    )
  return {
    "micro_batch_size": int(micro),
    "global_batch_size": int(micro) * values["gradient_accumulation_steps"],
    "eval_batch_size": int(eval_batch),
  }


def _pipeline(values: Mapping, d: Mapping) -> dict:
  """The pipeline's layers, repeats and microbatches (layers/pipeline.py), checked against the model and batch."""
  stages = dict(zip(values["mesh_axes"], d["mesh_shape"], strict=True))["stage"]
  layers = d["num_decoder_layers"]
  family = families.get(values["decoder_block"])
  last_stack = layers - (values["first_num_dense_layers"] if family.dense_layer is not None else 0)
  piped = values["pipeline_parallel_layers"] if values["pipeline_parallel_layers"] > 0 else last_stack
  per_stage = values["num_layers_per_pipeline_stage"]
  repeats = values["num_pipeline_repeats"] if values["num_pipeline_repeats"] > 0 else piped // max(stages * per_stage, 1)
  micro = values["num_pipeline_microbatches"] if values["num_pipeline_microbatches"] > 0 else stages
  derived = {"pipeline_parallel_layers": piped, "num_pipeline_repeats": repeats, "num_pipeline_microbatches": micro}
  if stages == 1:
    return derived
  ici, dcn = values["ici_pipeline_parallelism"], values["dcn_pipeline_parallelism"]
  given = f"{stages} stages (ici_pipeline_parallelism={ici}, dcn_pipeline_parallelism={dcn})"
  if not 0 < piped <= last_stack:
    raise ConfigError(f"pipeline_parallel_layers={piped}: the pipeline takes 1 to {last_stack} layers (the last stack's)")
  if per_stage < 1 or stages * per_stage * repeats != piped:
    raise ConfigError(
      f"the {piped} pipelined layers (pipeline_parallel_layers) must be {given} x num_layers_per_pipeline_stage="
      f"{per_stage} x num_pipeline_repeats={values['num_pipeline_repeats']} (-1: derived); choose values whose "
      f"product is {piped}"
    )
  stacks = [layers - last_stack, last_stack] if last_stack < layers else [layers]
  if any(count % stages for count in stacks if count):
    raise ConfigError(
      f"{given}: the layer stacks of {', '.join(map(str, (c for c in stacks if c)))} layers must split evenly over the "
      "stages (their weights are sharded over them); change the pipeline parallelism or first_num_dense_layers"
    )
  if micro % stages:
    raise ConfigError(f"num_pipeline_microbatches={micro} must be a multiple of the {given}")
  for key, rows in (("per_device_batch_size", d["micro_batch_size"]), ("eval_per_device_batch_size", d["eval_batch_size"])):
    if rows % micro:
      raise ConfigError(
        f"{key} gives batches of {rows} rows, which num_pipeline_microbatches={micro} does not divide; raise {key} or "
        "change num_pipeline_microbatches"
      )
  return derived


def _check_shards(values: Mapping, d: Mapping) -> None:
  """Each sharded dimension must split evenly over the mesh axes its logical name maps to in
  logical_axis_rules (a jitted array cannot be split unevenly)."""
  dims = (
    ("num_query_heads", d["num_query_heads"], "heads"),
    ("num_kv_heads", d["num_kv_heads"], "kv_heads"),
    ("mlp_dim", d["mlp_dim"], "mlp"),
    ("max_target_length", values["max_target_length"], "activation_length"),
  )
  if values["num_experts"] > 1:
    dims += (("moe_mlp_dim", d["moe_mlp_dim"], "mlp"), ("num_experts", values["num_experts"], "exp"))
  if values["attention_type"] == "mla":
    dims += (("kv_lora_rank", values["kv_lora_rank"], "kv_lora"),)
    if values["q_lora_rank"] > 0:
      dims += (("q_lora_rank", values["q_lora_rank"], "q_lora"),)
  for key, size, logical in dims:
    shards, axes = _shards(values, d, logical)
    if size % shards:
      raise ConfigError(
        f"{key}={size} does not split over the {shards} shards of the mesh axes of {logical}: {axes}; make the product "
        f"of these parallelism values divide {size}"
      )
  shards, axes = _shards(values, d, "activation_length")
  if shards > 1 and values["context_parallel_load_balance"] and values["max_target_length"] % (2 * shards):
    raise ConfigError(
      f"context_parallel_load_balance: max_target_length={values['max_target_length']} does not split into 2 x "
      f"{shards} chunks for the {shards} sequence shards of {axes}; make it a multiple of {2 * shards}, or set "
      "context_parallel_load_balance=false"
    )
  if shards > 1 and values["context_parallel_load_balance"] and values["capacity_factor"] > 0:
    raise ConfigError(
      f"capacity_factor={values['capacity_factor']} drops expert assignments in token order, which "
      "context_parallel_load_balance changes; set context_parallel_load_balance=false or capacity_factor=-1 (dropless)"
    )
  stages = dict(zip(values["mesh_axes"], d["mesh_shape"], strict=True))["stage"]
  if shards > 1 and stages > 1:
    raise ConfigError(
      f"pipeline parallelism ({stages} stages) with sequences split over {axes} is not supported yet; set the "
      "*_pipeline_parallelism or the *_context/_sequence_parallelism keys to 1"
    )
  if shards > 1 and values["attention"].startswith("cudnn"):
    raise ConfigError(
      f"attention={values['attention']} (cuDNN) does not run under context parallelism ({axes}); use "
      "attention=flash or dot_product"
    )
  shards, axes = _shards(values, d, "activation_batch")
  batch_axes = _rule_of(values, "activation_batch")
  elsewhere = [
    f"ici_{n}_parallelism" for n, a in PARALLELISM_AXES.items() if a not in batch_axes and n not in UNSUPPORTED_AXES
  ]
  pieces = d["num_pipeline_microbatches"] if stages > 1 else 1
  for key, rows in (("per_device_batch_size", d["micro_batch_size"]), ("eval_per_device_batch_size", d["eval_batch_size"])):
    if (rows // pieces) % shards:
      what = f"pipeline microbatches of {rows // pieces} rows" if pieces > 1 else f"a batch of {rows} rows"
      raise ConfigError(
        f"{key}={values[key] or values['per_device_batch_size']} gives {what} that does not split "
        f"over the {shards} shards of the mesh axes of activation_batch: {axes}; raise {key}, or move devices to axes "
        f"that do not shard the batch ({', '.join(elsewhere)})"
      )


def _rule_of(values: Mapping, logical: str) -> tuple[str, ...]:
  """The mesh axes of a logical name's first rule in logical_axis_rules."""
  rule = next((mesh_axes for name, mesh_axes in values["logical_axis_rules"] if name == logical), ())
  return _rule_axes(rule) if rule else ()


def _shards(values: Mapping, d: Mapping, logical: str) -> tuple[int, str]:
  """How many shards a logical name's mesh axes make, and those axes of size > 1 described with the parallelism
  keys that set them, e.g. "fsdp=4 (ici_fsdp_parallelism=-1, dcn_fsdp_parallelism=1)"."""
  axis_size = dict(zip(values["mesh_axes"], d["mesh_shape"], strict=True))
  axes = _rule_of(values, logical)
  described = []
  for axis in (a for a in axes if axis_size[a] > 1):
    keys = [f"{kind}_{_NAME_OF_AXIS[axis]}_parallelism" for kind in ("ici", "dcn")]
    described.append(f"{axis}={axis_size[axis]} ({', '.join(f'{key}={values[key]}' for key in keys)})")
  return math.prod(axis_size[axis] for axis in axes), " x ".join(described)


def finalize(values: Mapping, num_devices: int, num_slices: int = 1) -> Config:
  """Typed raw values (from `parse`) plus derived values -> a frozen Config."""
  values = {**values, **derive(values, num_devices, num_slices)}
  return Config({k: freeze(v) for k, v in values.items()})


def load(argv: Sequence[str], num_devices: int, num_slices: int = 1, env: Mapping[str, str] | None = None) -> Config:
  """Parses argv (`[config.yml, key=value, ...]`) and the environment into a frozen Config."""
  return finalize(parse(argv, env), num_devices, num_slices)
