"""Configuration: a YAML file, `base_config:` inheritance, a model preset, `M_<KEY>` environment variables
and `key=value` overrides, resolved into one frozen, typed `Config`.

`configs/base.yml` is the schema: every key that may be set exists there, and a value is coerced to the
type of its default. Parsing is pure: it reads yml files and nothing else (no jax, no directories).

  parse(argv)                          -> dict of typed raw values (device independent)
  derive(raw, num_devices, num_slices) -> dict of derived values (the one place they are computed)
  load(argv, num_devices, num_slices)  -> Config

A user mistake raises `ConfigError` whose message names the key, the value and the fix.
"""

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import yaml

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
  "tensor": "tensor",
  "expert": "expert",
}
# Axes whose layers do not exist yet: a size above 1 is refused rather than silently ignored.
UNSUPPORTED_AXES = {"pipeline": "pipeline parallelism", "expert": "expert parallelism (no mixture-of-experts model)"}

CHOICES = {
  "hardware": ("cpu", "gpu", "tpu"),
  "dtype": ("bfloat16", "float32", "float16"),
  "weight_dtype": ("bfloat16", "float32", "float16"),
  "matmul_precision": ("default", "high", "highest"),
  "remat_policy": (
    "full",
    "minimal",
    "save_qkv_proj",
    "save_dot_except_mlp",
    "save_dot_except_mlpwi",
    "save_out_proj",
    "none",
  ),
  "rope_type": ("default", "llama3.1"),
  "decoder_block": ("llama2", "mistral", "gemma", "gemma2", "qwen3", "gpt3"),
  "tokenizer_type": ("sentencepiece", "tiktoken", "huggingface"),
  "dataset_type": ("synthetic", "grain", "tfds", "hf"),
  "profiler": ("", "xplane"),
  "decode_sampling_strategy": ("greedy", "weighted", "nucleus", "topk"),
}
ACTIVATIONS = ("silu", "gelu", "relu", "linear", "tanh", "sigmoid")


class ConfigError(ValueError):
  """A mistake in the user's configuration; the message says what is wrong and how to fix it."""


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
    return {k: _thaw(v) for k, v in self._values.items()}

  def replace(self, **changes) -> "Config":
    """A copy with some keys changed (no re-validation: for tests and derived sub-configs)."""
    unknown = set(changes) - set(self._values)
    if unknown:
      raise AttributeError(f"Config has no keys {sorted(unknown)}")
    return Config({**self._values, **{k: _freeze(v) for k, v in changes.items()}})


def _freeze(value):
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


def _thaw(value):
  if isinstance(value, tuple):
    return [_thaw(v) for v in value]
  return value


def _read_yml(path: str, seen=()) -> dict:
  """Reads a yml file, following `base_config:` (relative to the file's folder) first."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist; pass the path of a yml file such as MaxText/configs/base.yml")
  if path in seen:
    raise ConfigError(f"base_config loop through {path!r}; remove the cycle")
  try:
    with open(path, encoding="utf-8") as f:
      values = yaml.safe_load(f) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {path!r} is not valid YAML ({str(e).splitlines()[0]}); fix its syntax") from None
  if not isinstance(values, dict):
    raise ConfigError(f"config file {path!r} must hold a mapping of key: value")
  parent = values.pop("base_config", None)
  if parent:
    parent_path = parent if os.path.isabs(parent) else os.path.join(os.path.dirname(path), parent)
    if not os.path.isfile(parent_path) and os.path.isfile(os.path.join(CONFIGS_DIR, parent)):
      parent_path = os.path.join(CONFIGS_DIR, parent)
    return {**_read_yml(parent_path, seen + (path,)), **values}
  return values


def _unknown_key_error(key: str, schema: Mapping, where: str) -> ConfigError:
  close = difflib.get_close_matches(key, list(schema), n=1)
  hint = f"did you mean {close[0]!r}?" if close else "see MaxText/configs/base.yml for the valid keys"
  return ConfigError(f"unknown config key {key!r} {where}; {hint}")


def _coerce(key: str, value: Any, default: Any, from_text: bool) -> Any:
  """Coerces `value` to the type of the schema's `default`; strings from argv/env are parsed as YAML."""
  if from_text and not isinstance(default, str):
    try:
      value = yaml.safe_load(value) if value != "" else ""
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
    raise ConfigError(f"{key}={value!r} is not a boolean; use {key}=true or {key}=false")
  if isinstance(default, int):
    if isinstance(value, float) and value.is_integer():
      return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    raise ConfigError(f"{key}={value!r} is not an integer; give a whole number such as {key}={default}")
  if isinstance(default, float):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
    raise ConfigError(f"{key}={value!r} is not a number; give a number such as {key}={default}")
  if isinstance(default, str):
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
    raise ConfigError(f"{key}={value!r} is not a string")
  if isinstance(default, list):
    if isinstance(value, (list, tuple)):
      return _freeze(value)
    raise ConfigError(f"{key}={value!r} is not a list; give a YAML list such as {key}='{default}'")
  return _freeze(value)


def _parse_overrides(argv: Sequence[str], schema: Mapping) -> dict:
  overrides = {}
  for arg in argv:
    if "=" not in arg:
      raise ConfigError(f"argument {arg!r} is not of the form key=value; write overrides as key=value after the yml")
    key, value = arg.split("=", 1)
    if key not in schema:
      raise _unknown_key_error(key, schema, "on the command line")
    if key in overrides:
      raise ConfigError(f"{key} is given twice on the command line; give it once")
    overrides[key] = value
  return overrides


def _parse_env(env: Mapping[str, str], schema: Mapping) -> dict:
  values = {}
  for name, value in env.items():
    if name.startswith("M_") and len(name) > 2:
      key = name[2:].lower()
      if key not in schema:
        raise _unknown_key_error(key, schema, f"in environment variable {name}")
      values[key] = value
  return values


def _model_preset_path(model_name: str) -> str:
  if model_name.endswith((".yml", ".yaml")):
    if not os.path.isfile(model_name):
      raise ConfigError(f"model_name={model_name}: file not found; give an existing model yml or a preset name")
    return model_name
  path = os.path.join(MODELS_DIR, f"{model_name}.yml")
  if not os.path.isfile(path):
    presets = sorted(f[:-4] for f in os.listdir(MODELS_DIR) if f.endswith(".yml"))
    raise ConfigError(f"model_name={model_name} is not a preset; choose 'default' or one of {', '.join(presets)}")
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
  schema = _read_yml(BASE_YML)
  file_values = _read_yml(argv[0])
  for key in file_values:
    if key not in schema:
      raise _unknown_key_error(key, schema, f"in {argv[0]}")
  cli = _parse_overrides(argv[1:], schema)
  env_values = _parse_env(env, schema)
  both = sorted(set(cli) & set(env_values))
  if both:
    raise ConfigError(f"{both[0]} is set both on the command line and as M_{both[0].upper()}; set it in one place")
  user = {**env_values, **cli}

  def typed(key, value, from_text):
    return _coerce(key, value, schema[key], from_text)

  values = {k: typed(k, v, False) for k, v in {**schema, **file_values}.items()}
  for key, value in user.items():
    values[key] = typed(key, value, True)

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
  _validate(values)
  return values


def _validate(values: Mapping) -> None:
  """Checks that need no devices: choices, ranges and divisibility within the model."""
  for key, choices in CHOICES.items():
    if values[key] not in choices:
      raise ConfigError(f"{key}={values[key]!r} is not supported; choose one of {', '.join(map(repr, choices))}")
  for act in values["mlp_activations"]:
    if act not in ACTIVATIONS:
      raise ConfigError(f"mlp_activations contains {act!r}; choose among {', '.join(ACTIVATIONS)}")
  if not values["mlp_activations"]:
    raise ConfigError("mlp_activations=[] is empty; give at least one activation, e.g. ['silu','linear']")
  positive = (
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "base_mlp_dim",
    "base_num_decoder_layers",
    "head_dim",
    "vocab_size",
    "max_target_length",
    "log_period",
    "checkpoint_period",
    "gradient_accumulation_steps",
  )
  for key in positive:
    if values[key] <= 0:
      raise ConfigError(f"{key}={values[key]} must be positive")
  if values["eval_interval"] > 0 and values["eval_steps"] < 1 and values["dataset_type"] == "synthetic":
    raise ConfigError(f"eval_steps={values['eval_steps']}: synthetic data has no end; set eval_steps to a positive count")
  if values["eval_per_device_batch_size"] < 0:
    raise ConfigError(
      f"eval_per_device_batch_size={values['eval_per_device_batch_size']} must be >= 0 (0: per_device_batch_size)"
    )
  if values["per_device_batch_size"] <= 0:
    raise ConfigError(f"per_device_batch_size={values['per_device_batch_size']} must be positive")
  if values["base_num_query_heads"] % values["base_num_kv_heads"]:
    raise ConfigError(
      f"base_num_query_heads={values['base_num_query_heads']} is not a multiple of "
      f"base_num_kv_heads={values['base_num_kv_heads']}; grouped-query attention needs whole groups"
    )
  if values["head_dim"] % 2 and values["decoder_block"] != "gpt3":
    raise ConfigError(f"head_dim={values['head_dim']} is odd; rotary embeddings rotate pairs, use an even head_dim")
  if not 0.0 <= values["dropout_rate"] < 1.0:
    raise ConfigError(f"dropout_rate={values['dropout_rate']} must be in [0, 1)")
  if not 0.0 <= values["warmup_steps_fraction"] <= 1.0:
    raise ConfigError(f"warmup_steps_fraction={values['warmup_steps_fraction']} must be in [0, 1]")
  if values["steps"] == -1 and values["learning_rate_schedule_steps"] == -1:
    raise ConfigError("steps=-1 needs learning_rate_schedule_steps set; give one of them a positive value")
  if values["steps"] < -1 or values["steps"] == 0:
    raise ConfigError(f"steps={values['steps']} must be positive (or -1 to take learning_rate_schedule_steps)")
  if values["load_parameters_path"] and values["load_full_state_path"]:
    raise ConfigError("load_parameters_path and load_full_state_path are both set; give at most one")
  for key in ("rope_min_timescale", "rope_max_timescale", "rope_scaling_factor"):
    if values[key] <= 0:
      raise ConfigError(f"{key}={values[key]} must be positive")
  if values["rope_high_freq_factor"] <= values["rope_low_freq_factor"]:
    raise ConfigError(
      f"rope_high_freq_factor={values['rope_high_freq_factor']} must exceed "
      f"rope_low_freq_factor={values['rope_low_freq_factor']}"
    )
  rules = values["logical_axis_rules"]
  for rule in rules:
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules entry {list(rule)!r} is not [logical_name, [mesh_axes]]")
    mesh_axes = rule[1] if isinstance(rule[1], tuple) else (rule[1],)
    for axis in mesh_axes:
      if axis not in values["mesh_axes"]:
        raise ConfigError(
          f"logical_axis_rules maps {rule[0]!r} to unknown mesh axis {axis!r}; use one of {list(values['mesh_axes'])}"
        )
  if sorted(values["mesh_axes"]) != sorted(PARALLELISM_AXES.values()):
    raise ConfigError(f"mesh_axes={list(values['mesh_axes'])} must be an ordering of {sorted(PARALLELISM_AXES.values())}")


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
  unit = "devices per slice" if kind == "ici" else "slices"
  if fill:
    if total % known:
      raise ConfigError(
        f"the {kind} parallelism product {known} does not divide {total} {unit}; "
        f"choose {kind}_*_parallelism values whose product divides {total}"
      )
    sizes[fill[0]] = total // known
  elif known != total:
    raise ConfigError(
      f"the {kind} parallelism product {known} does not match {total} {unit}; "
      f"make the product {total}, or set one {kind} axis to -1 to fill"
    )
  for name, label in UNSUPPORTED_AXES.items():
    if sizes[name] > 1:
      raise ConfigError(f"{kind}_{name}_parallelism={sizes[name]}: {label} is not supported yet; set it to 1")
  return sizes


def derive(values: Mapping, num_devices: int, num_slices: int = 1) -> dict:
  """Every derived value, from the typed raw values and the device topology.

  Model shapes follow MaxText's global_parameter_scale; the mesh is ICI x DCN; batch sizes are global.
  """
  emb_scale, head_scale, mlp_scale, layer_scale = _scales(values["global_parameter_scale"])
  d = {
    "emb_dim": values["base_emb_dim"] * 2**emb_scale,
    "num_query_heads": values["base_num_query_heads"] * 2**head_scale,
    "num_kv_heads": values["base_num_kv_heads"] * 2**head_scale,
    "mlp_dim": values["base_mlp_dim"] * 2**mlp_scale,
    "num_decoder_layers": values["base_num_decoder_layers"] * 2**layer_scale,
  }
  schedule = values["learning_rate_schedule_steps"]
  steps = values["steps"]
  d["steps"] = schedule if steps == -1 else steps
  d["learning_rate_schedule_steps"] = d["steps"] if schedule == -1 else schedule
  d["warmup_steps"] = int(values["warmup_steps_fraction"] * d["learning_rate_schedule_steps"])

  if num_devices % num_slices:
    raise ConfigError(f"{num_devices} devices do not split evenly into {num_slices} slices")
  ici = _fill_axes("ici", values, num_devices // num_slices)
  dcn = _fill_axes("dcn", values, num_slices)
  axis_of = PARALLELISM_AXES
  d["ici_mesh_shape"] = tuple(ici[name] for axis in values["mesh_axes"] for name in axis_of if axis_of[name] == axis)
  d["dcn_mesh_shape"] = tuple(dcn[name] for axis in values["mesh_axes"] for name in axis_of if axis_of[name] == axis)
  d["mesh_shape"] = tuple(i * j for i, j in zip(d["ici_mesh_shape"], d["dcn_mesh_shape"], strict=True))
  d["num_devices"] = num_devices
  d["num_slices"] = num_slices

  micro = values["per_device_batch_size"] * num_devices
  if micro < 1 or not float(micro).is_integer():
    raise ConfigError(
      f"per_device_batch_size={values['per_device_batch_size']} x {num_devices} devices = {micro} is not a whole "
      "number of sequences; choose a per_device_batch_size that gives one"
    )
  d["micro_batch_size"] = int(micro)
  d["global_batch_size"] = int(micro) * values["gradient_accumulation_steps"]

  axis_size = dict(zip(values["mesh_axes"], d["mesh_shape"], strict=True))
  tensor, sequence = axis_size["tensor"], axis_size["sequence"]
  for key, value in (
    ("num_query_heads", d["num_query_heads"]),
    ("num_kv_heads", d["num_kv_heads"]),
    ("mlp_dim", d["mlp_dim"]),
  ):
    if value % tensor:
      raise ConfigError(
        f"{key}={value} is not divisible by tensor parallelism {tensor}; choose ici_tensor_parallelism dividing it"
      )
  if values["max_target_length"] % sequence:
    raise ConfigError(
      f"max_target_length={values['max_target_length']} is not divisible by sequence parallelism {sequence}; "
      "choose ici_sequence_parallelism dividing it"
    )
  batch_shards = axis_size["data"] * axis_size["fsdp"] * axis_size["expert"]
  if d["micro_batch_size"] % batch_shards:
    raise ConfigError(
      f"per_device_batch_size={values['per_device_batch_size']} gives a batch of {d['micro_batch_size']} that "
      f"does not split over {batch_shards} data x fsdp shards; raise per_device_batch_size or move devices to "
      "ici_tensor_parallelism/ici_sequence_parallelism"
    )
  eval_per_device = values["eval_per_device_batch_size"] or values["per_device_batch_size"]
  eval_batch = eval_per_device * num_devices
  if eval_batch < 1 or not float(eval_batch).is_integer() or int(eval_batch) % batch_shards:
    raise ConfigError(
      f"eval_per_device_batch_size={eval_per_device} x {num_devices} devices = {eval_batch} is not a whole number "
      f"of sequences that splits over {batch_shards} data x fsdp shards; choose another eval_per_device_batch_size"
    )
  d["eval_batch_size"] = int(eval_batch)
  return d


def finalize(values: Mapping, num_devices: int, num_slices: int = 1) -> Config:
  """Typed raw values (from `parse`) plus derived values -> a frozen Config."""
  values = {**values, **derive(values, num_devices, num_slices)}
  if not values["run_name"]:
    raise ConfigError("run_name is empty; pass run_name=NAME (output goes to base_output_directory/NAME)")
  return Config({k: _freeze(v) for k, v in values.items()})


def load(argv: Sequence[str], num_devices: int, num_slices: int = 1, env: Mapping[str, str] | None = None) -> Config:
  """Parses argv (`[config.yml, key=value, ...]`) and the environment into a frozen Config."""
  return finalize(parse(argv, env), num_devices, num_slices)
