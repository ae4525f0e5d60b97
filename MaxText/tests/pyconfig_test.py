"""Config parsing: precedence, types, presets, derived values, and one-line errors for bad input."""

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import yaml

from MaxText import pyconfig, train
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, deadline


def test_overrides_are_typed_and_frozen():
  cfg = config(
    "per_device_batch_size=3",
    "scan_layers=False",
    "learning_rate=1e-3",
    "mlp_activations=['gelu','linear']",
    "override_model_config=true",
  )
  assert cfg.per_device_batch_size == 3.0 and isinstance(cfg.per_device_batch_size, float)
  assert cfg.scan_layers is False
  assert cfg.learning_rate == 1e-3
  assert cfg.mlp_activations == ("gelu", "linear")
  with pytest.raises(AttributeError):
    cfg.steps = 3


def test_precedence_env_and_base_config(tmp_path):
  child = tmp_path / "child.yml"
  child.write_text(f"base_config: {BASE_YML}\nsteps: 7\nlearning_rate: 0.5\n")
  values = pyconfig.parse([str(child), "learning_rate=0.25"], env={"M_LOG_PERIOD": "9"})
  assert (values["steps"], values["learning_rate"], values["log_period"]) == (7, 0.25, 9)
  with pytest.raises(ConfigError, match="log_period is set both"):
    pyconfig.parse([str(child), "log_period=3"], env={"M_LOG_PERIOD": "9"})


def test_model_preset_and_override_rule():
  values = pyconfig.parse([BASE_YML, "model_name=llama2-70b"], env={})
  assert (values["base_emb_dim"], values["base_num_kv_heads"], values["base_num_decoder_layers"]) == (8192, 8, 80)
  with pytest.raises(ConfigError, match="base_emb_dim is set by model_name=llama2-70b"):
    pyconfig.parse([BASE_YML, "model_name=llama2-70b", "base_emb_dim=128"], env={})
  values = pyconfig.parse([BASE_YML, "model_name=llama2-70b", "base_emb_dim=128", "override_model_config=true"], env={})
  assert values["base_emb_dim"] == 128


@pytest.mark.parametrize(
  "scale, expected", [(1, (64, 4, 2, 128, 2)), (2, (64, 8, 4, 256, 2)), (4, (128, 8, 4, 256, 2)), (8, (128, 8, 4, 256, 4))]
)
def test_global_parameter_scale(scale, expected):
  """MaxText's split: log2(scale) = 3*base + rem; heads/mlp grow first, then emb, then layers."""
  cfg = config(f"global_parameter_scale={scale}", "base_emb_dim=64", "base_mlp_dim=128", override_model_config="true")
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.mlp_dim, cfg.num_decoder_layers) == expected


def test_derived_mesh_and_batch():
  cfg = config("ici_fsdp_parallelism=-1", "ici_tensor_parallelism=2", "per_device_batch_size=1", num_devices=8)
  axes = dict(zip(cfg.mesh_axes, cfg.mesh_shape, strict=True))
  assert axes == {"data": 1, "stage": 1, "fsdp": 4, "sequence": 1, "context": 1, "tensor": 2, "expert": 1}
  assert cfg.micro_batch_size == 8 and cfg.global_batch_size == 8
  cfg = config("gradient_accumulation_steps=4", "per_device_batch_size=0.5", "ici_tensor_parallelism=2", num_devices=8)
  assert cfg.micro_batch_size == 4 and cfg.global_batch_size == 16
  cfg = config("steps=100", "warmup_steps_fraction=0.25")
  assert (cfg.learning_rate_schedule_steps, cfg.warmup_steps) == (100, 25)


def test_every_base_key_has_a_comment():
  with open(BASE_YML, encoding="utf-8") as f:
    lines = f.read().splitlines()
  for line in lines:
    if line and not line.startswith((" ", "#", "]")) and ":" in line and not line.rstrip().endswith("["):
      key = line.split(":")[0]
      assert "#" in line, f"base.yml key {key} has no comment"


BAD = [
  (["modle_name=tiny"], "modle_name"),
  (["steps=ten"], "steps"),
  (["scan_layers=maybe"], "scan_layers"),
  (["remat_policy=sometimes"], "remat_policy"),
  (["dtype=int8"], "dtype"),
  (["ici_tensor_parallelism=3"], "ici_tensor_parallelism=3 does not divide the 8 devices"),
  (["ici_fsdp_parallelism=3"], "ici_fsdp_parallelism=3 makes 3, not the 8 devices per slice"),
  (["ici_fsdp_parallelism=4", "ici_tensor_parallelism=4"], "ici_fsdp_parallelism=4 x ici_tensor_parallelism=4 makes 16"),
  (["ici_fsdp_parallelism=2", "ici_tensor_parallelism=-1"], "num_kv_heads"),
  (["per_device_batch_size=0.1"], "per_device_batch_size"),
  (["base_num_kv_heads=3", "override_model_config=true"], "base_num_kv_heads"),
  (["base_emb_dim=64"], "base_emb_dim"),
  (["model_name=llama9"], "model_name"),
  (["run_name="], "run_name is empty"),
  (["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=3"], "num_pipeline_microbatches=3"),
  (["load_parameters_path=/nonexistent/checkpoint"], "load_parameters_path"),
  (["run_name=../escape"], "run_name='../escape' must be one plain folder name"),
  (["run_name=/abs/run"], "run_name='/abs/run'"),
  (["run_name=nested/run"], "run_name='nested/run'"),
  (["run_name=.."], "run_name='..'"),
  (["run_name=."], "run_name='.'"),
  (["run_name=tab\there"], "run_name='tab\\there'"),
  (["steps=1e3"], "steps=1000.0 is not an integer"),
  (["learning_rate=-1"], "learning_rate=-1.0 is negative"),
  (["max_num_checkpoints_to_keep=-1"], "max_num_checkpoints_to_keep=-1 is negative"),
  (["vocab_size=2147483648", "override_model_config=true"], "vocab_size=2147483648 does not fit the int32 token ids"),
  ([f"init_weights_seed={2**70}"], f"init_weights_seed={2**70} does not fit 32 bits"),
  (["hardware=gpu"], "hardware=gpu but JAX runs on cpu"),
  (["steps=2147483648"], "steps=2147483648 does not fit the int32 step counts"),
  (["learning_rate=nan"], "learning_rate=nan is not a finite number"),
  (["learning_rate=inf"], "learning_rate=inf is not a finite number"),
  (["run_name=" + "r" * 256], "is 256 bytes long; a file or folder name may have 255 bytes"),
]


@pytest.mark.parametrize("overrides, key", BAD, ids=[b[0][0][:40] for b in BAD])
@pytest.mark.mesh
def test_bad_config_exits_2_with_one_line(overrides, key, tmp_path, capsys):
  """A mistake is one line naming the key and value (the expected text), exit code 2, nothing written."""
  run_name = [] if any(o.startswith("run_name=") for o in overrides) else ["run_name=bad"]
  argv = ["train.py", BASE_YML, *run_name, "model_name=tiny", f"base_output_directory={tmp_path}/out", "jax_cache_dir="]
  argv += overrides
  assert train.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert len(err.splitlines()) == 1 and err.startswith("error: ") and key in err, err
  assert not os.path.exists(tmp_path / "out"), "a rejected config must not create anything"


def test_a_yml_with_a_key_twice_or_not_utf8_is_one_line(tmp_path):
  twice = tmp_path / "twice.yml"
  twice.write_text("base_config: base.yml\nsteps: 10\nlearning_rate: 1.0e-3\nsteps: 20\n")
  with pytest.raises(ConfigError, match="key 'steps' is given twice"):
    pyconfig.parse([str(twice)], env={})
  latin1 = tmp_path / "latin1.yml"
  latin1.write_bytes("base_config: base.yml\nrun_name: caf\xe9\n".encode("latin-1"))
  with pytest.raises(ConfigError, match="is not UTF-8 text"):
    pyconfig.parse([str(latin1)], env={})


def test_local_paths_are_made_absolute_once_and_urls_kept(tmp_path, monkeypatch):
  """NVIDIA's command passes base_output_directory=local_train: Orbax refuses relative checkpoint paths, so
  every path key is resolved against the directory the command started in, once, when parsed."""
  monkeypatch.chdir(tmp_path)
  values = pyconfig.parse(
    [BASE_YML, "base_output_directory=local_train", "metrics_file=out/m.jsonl", "load_parameters_path=gs://b/c/0/items"],
    env={},
  )
  assert values["base_output_directory"] == str(tmp_path / "local_train")
  assert values["metrics_file"] == str(tmp_path / "out" / "m.jsonl")
  assert values["load_parameters_path"] == "gs://b/c/0/items"
  assert values["load_full_state_path"] == ""
  assert values["jax_cache_dir"] == os.path.expanduser("~/jax_cache")


def _rules_with(logical: str, mesh_axes: list[str]) -> str:
  base = pyconfig.parse([BASE_YML], env={})["logical_axis_rules"]
  rules = [[name, mesh_axes if name == logical else list(axes)] for name, axes in base]
  return "logical_axis_rules=" + yaml.safe_dump(rules, default_flow_style=True).strip()


def test_batch_split_is_checked_over_the_mesh_axes_of_activation_batch_in_the_rules():
  """4 rows over fsdp=8 do not split while activation_batch maps to fsdp; mapped to data alone (size 1) they do."""
  with pytest.raises(ConfigError, match=r"8 shards of the mesh axes of activation_batch: fsdp=8 \(ici_fsdp_parallelism=-1"):
    config("per_device_batch_size=0.5", num_devices=8)
  cfg = config("per_device_batch_size=0.5", _rules_with("activation_batch", ["data"]), num_devices=8)
  assert cfg.global_batch_size == 4
  with pytest.raises(ConfigError, match=r"2 shards of the mesh axes of activation_batch: data=2 \(ici_data_parallelism=2"):
    config("per_device_batch_size=0.125", "ici_data_parallelism=2", _rules_with("activation_batch", ["data"]), num_devices=8)


def test_head_and_length_splits_name_the_parallelism_keys():
  with pytest.raises(
    ConfigError, match=r"num_kv_heads=2 does not split over the 4 shards .*tensor=4 \(ici_tensor_parallelism=4"
  ):
    config("ici_fsdp_parallelism=2", "ici_tensor_parallelism=4", num_devices=8)
  with pytest.raises(ConfigError, match=r"max_target_length=63 .* sequence=2 \(ici_sequence_parallelism=2"):
    config("max_target_length=63", "ici_sequence_parallelism=2", num_devices=8)


def test_every_fixed_choice_is_listed_in_its_base_yml_comment():
  """The valid values live with their owners (pyconfig.choices()); base.yml's comments must not fall behind.
  decoder_block's comment points to the family registry instead, so adding a family needs no edit here."""
  with open(BASE_YML, encoding="utf-8") as f:
    comments = dict(line.split(":", 1) for line in f if "#" in line and not line.startswith((" ", "#")))
  for key, valid in pyconfig.choices().items():
    if key == "decoder_block":
      assert "MaxText/families/" in comments[key]
      continue
    comment = comments[key].split("#", 1)[1]
    # A whole word: "float16" is not found inside "bfloat16", nor "high" inside "highest".
    missing = [v for v in valid if not re.search(rf"(?<![\w.]){re.escape(v)}(?!\w)(?!\.\w)" if v else '""', comment)]
    assert not missing, f"base.yml's comment on {key} does not name {missing}"


def _yml(tmp_path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(f"base_config: {BASE_YML}\n{text}", encoding="utf-8")
  return str(path)


# A "billion laughs" in one list value: nine aliases of nine aliases ... of a list of nine, 9**9 (387 million)
# strings once expanded.
ALIAS_BOMB = (
  "mlp_activations: [&a [lol, lol, lol, lol, lol, lol, lol, lol, lol], "
  + "".join(f"&{c} [{', '.join([f'*{p}'] * 9)}], " for p, c in zip("abcdefgh", "bcdefghi", strict=True))
  + "*i]\n"
)

YAML_TRICKS = [
  (ALIAS_BOMB, "line 2: YAML anchors and aliases (&name, *name) are not supported"),
  ("steps: &s 3\nlog_period: *s\n", "line 2: YAML anchors and aliases"),
  ("<<: {steps: 3}\n", "line 2: merge keys (<<) are not supported"),
  ("steps: 3\nlog_period: 2\nsteps: 4\n", "line 4: key 'steps' is given twice"),
  ("mlp_activations: " + "[" * 5000 + "]" * 5000 + "\n", "line 2: values nested over 32 deep are not supported"),
  ("steps: " + "9" * 5000 + "\n", "line 2: an integer of 5000 digits is too large"),
  ("steps: !!python/object:os.system [ls]\n", "could not determine a constructor for the tag"),
  ("1: 2\n", "key 1 is not a name"),
  ("steps: 3\n---\nsteps: 4\n", "expected a single document in the stream but found another document"),
]


@pytest.mark.parametrize("text, message", YAML_TRICKS, ids=[t[1][:24] for t in YAML_TRICKS])
def test_yaml_tricks_in_a_config_file_are_one_short_line_naming_the_file(text, message, tmp_path):
  """Before: the alias bomb never finished (a smaller one printed a 480,000-character line), deep nesting and a
  5000-digit integer raised RecursionError and ValueError tracebacks."""
  path = _yml(tmp_path, "trick.yml", text)
  start = time.monotonic()
  with deadline(20), pytest.raises(ConfigError) as caught:
    pyconfig.parse([path], env={})
  message_text = str(caught.value)
  assert time.monotonic() - start < 5
  assert message in message_text and repr(path) in message_text, message_text
  assert len(message_text) < 400 and "\n" not in message_text, message_text


def test_a_base_config_cycle_through_another_spelling_of_the_path_is_refused(tmp_path):
  """./a.yml and a.yml are one file: the cycle check compares real paths (before, a RecursionError)."""
  (tmp_path / "a.yml").write_text("base_config: ./b.yml\n")
  (tmp_path / "b.yml").write_text("base_config: ../" + tmp_path.name + "/a.yml\n")
  with pytest.raises(ConfigError, match="base_config loop through config file"):
    pyconfig.parse([str(tmp_path / "a.yml")], env={})


@pytest.mark.parametrize(
  "parent, message", [("5", "base_config=5 is not a path"), ("[a]", "base_config=['a'] is not a path")]
)
def test_a_base_config_that_is_no_path_is_refused(parent, message, tmp_path):
  (tmp_path / "a.yml").write_text(f"base_config: {parent}\n")
  with pytest.raises(ConfigError, match=re.escape(message)):
    pyconfig.parse([str(tmp_path / "a.yml")], env={})


def _not_regular_files(tmp_path) -> dict[str, tuple[str, str]]:
  """name -> (path, what the error must call it): a folder, a FIFO (opening it would wait for a writer for ever),
  /dev/zero (reading it never ends)."""
  os.mkfifo(tmp_path / "fifo")
  (tmp_path / "folder").mkdir()
  return {
    "folder": (str(tmp_path / "folder"), "a folder"),
    "fifo": (str(tmp_path / "fifo"), "a FIFO"),
    "dev_zero": ("/dev/zero", "a character device"),
  }


@pytest.mark.parametrize("as_base_config", [False, True])
def test_a_config_path_that_is_not_a_regular_file_is_named_for_what_it_is_and_never_read(as_base_config, tmp_path):
  """Before: "does not exist" for each of them (and a FIFO given as base_config opened and hung)."""
  for path, kind in _not_regular_files(tmp_path).values():
    if as_base_config:
      (tmp_path / "child.yml").write_text(f"base_config: {path}\n")
      argv = [str(tmp_path / "child.yml")]
    else:
      argv = [path]
    with deadline(10), pytest.raises(ConfigError) as caught:
      pyconfig.parse(argv, env={})
    assert str(caught.value) == f"config file {path!r} is {kind}, not a regular file; pass the path of a yml file"


def test_environment_variables_are_named_as_spelled():
  """M_steps sets steps; before, messages named it M_STEPS, and a bad value did not name it at all."""
  with pytest.raises(ConfigError, match="steps is set both on the command line and as M_steps;"):
    pyconfig.parse([BASE_YML, "steps=3"], env={"M_steps": "4"})
  with pytest.raises(ConfigError, match="^environment variable M_steps: steps='ten' is not an integer"):
    pyconfig.parse([BASE_YML], env={"M_steps": "ten"})
  with pytest.raises(ConfigError, match="environment variables M_steps and M_STEPS both set steps"):
    pyconfig.parse([BASE_YML], env={"M_steps": "3", "M_STEPS": "4"})
  assert pyconfig.parse([BASE_YML], env={"M_steps": "7"})["steps"] == 7


def test_quoted_values_are_cut_to_a_readable_length():
  long = "x" * 100_000
  for args in ([f"run_name=[{long}]"], [f"remat_policy={long}"], [f"{long}=3"], [f"mlp_activations=[{long}]"]):
    with pytest.raises(ConfigError) as caught:
      pyconfig.parse([BASE_YML, *args], env={})
    text = str(caught.value)
    assert len(text) < 600 and re.search(r"\.\.\. \(1000\d\d characters\)", text), text[:700]


FLOAT_KEYS = sorted(k for k, v in pyconfig.defaults().items() if type(v) is float)


@pytest.mark.parametrize(
  "value", ["nan", "inf", "-inf", ".nan", "1e400", "1" + "0" * 400], ids=["nan", "inf", "-inf", ".nan", "1e400", "10**400"]
)
def test_non_finite_numbers_are_refused_for_every_float_key(value):
  """No float key of base.yml means anything by nan or inf (before: learning_rate=nan trained and failed at step 0
  with a NaN loss, exit 1)."""
  assert len(FLOAT_KEYS) > 30
  for key in FLOAT_KEYS:
    with pytest.raises(ConfigError, match=f"^{key}=.* is not a finite number"):
      pyconfig.parse([BASE_YML, f"{key}={value}"], env={})


INT32_MAX = int(np.iinfo(np.int32).max)


@pytest.mark.parametrize("key", ["steps", "learning_rate_schedule_steps", "gradient_accumulation_steps"])
def test_step_counts_of_the_compiled_step_must_fit_int32(key):
  """jit takes these as int32 (a schedule over 2**32 steps raised OverflowError in the first step)."""
  with pytest.raises(ConfigError, match=f"{key}={INT32_MAX + 1} does not fit the int32 .*give at most {INT32_MAX}"):
    pyconfig.parse([BASE_YML, f"{key}={INT32_MAX + 1}"], env={})
  assert pyconfig.parse([BASE_YML, f"{key}={INT32_MAX}"], env={})[key] == INT32_MAX


def test_path_names_longer_than_255_bytes_are_refused(tmp_path):
  """Counted in bytes: 128 'é' are 256 bytes (before: an OSError traceback when the run folder was made)."""
  long_name = "é" * 128
  assert len(os.fsencode(long_name)) == 256
  for key, value in [
    ("run_name", long_name),
    ("base_output_directory", f"{tmp_path}/{long_name}/runs"),
    ("metrics_file", f"{tmp_path}/{'é' * 124}mm.jsonl"),
    ("jax_cache_dir", f"{tmp_path}/{long_name}"),
    ("compiled_trainstep_file", f"{tmp_path}/{long_name}"),
  ]:
    with pytest.raises(ConfigError, match=f"^{key}=.* is 256 bytes long; a file or folder name may have 255 bytes"):
      pyconfig.parse([BASE_YML, f"{key}={value}"], env={})
  values = pyconfig.parse([BASE_YML, f"run_name={'a' * 255}", f"base_output_directory={tmp_path}/{'é' * 127}"], env={})
  assert values["run_name"] == "a" * 255


# A config of 8 devices whose steps come from the schedule (steps=-1): derived values that depend on other keys.
REPLACED_FROM = ("steps=-1", "learning_rate_schedule_steps=40", "warmup_steps_fraction=0.25", "per_device_batch_size=1")


@pytest.mark.parametrize(
  "changes",
  [
    {"learning_rate_schedule_steps": 100},  # steps=-1 takes it again; so does the warmup
    {"per_device_batch_size": 2, "gradient_accumulation_steps": 3},  # the global batch
    {"base_emb_dim": 64, "global_parameter_scale": 8},  # the model's dimensions
    {"ici_tensor_parallelism": 2},  # the mesh
    {"scan_layers": False},  # a key nothing derives from
  ],
)
def test_replace_equals_the_config_loaded_with_the_change(changes):
  """pyconfig.replace derives again from the values as given (steps=-1 included), so its Config equals the one the
  command line would have made; Config.replace, which derives nothing, does not (the reference)."""
  cfg = config(*REPLACED_FROM, override_model_config="true", num_devices=8)
  given = [f"{key}={value}" for key, value in changes.items()]
  replaced = pyconfig.replace(cfg, **changes)
  assert replaced == config(*REPLACED_FROM, *given, override_model_config="true", num_devices=8)
  if changes != {"scan_layers": False}:
    assert cfg.replace(**changes) != replaced  # a derived key followed the change


def test_replace_derives_what_depends_on_the_replaced_key():
  cfg = config(*REPLACED_FROM, num_devices=8)
  assert (cfg.steps, cfg.warmup_steps, cfg.global_batch_size) == (40, 10, 8)
  replaced = pyconfig.replace(cfg, learning_rate_schedule_steps=100, per_device_batch_size=2)
  assert (replaced.steps, replaced.learning_rate_schedule_steps, replaced.warmup_steps) == (100, 100, 25)
  assert (replaced.micro_batch_size, replaced.global_batch_size) == (16, 16)
  assert isinstance(replaced.per_device_batch_size, float)  # coerced to base.yml's type, as on the command line
  again = pyconfig.replace(pickle.loads(pickle.dumps(replaced)), learning_rate_schedule_steps=60)
  assert (again.steps, again.global_batch_size) == (60, 16)  # a pickled Config keeps the values it came from


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"ici_tensor_parallelism": 3}, "ici_tensor_parallelism=3 does not divide the 8 devices"),
    ({"base_num_kv_heads": 3}, "base_num_query_heads=4 is not a multiple of base_num_kv_heads=3"),
    ({"lora_rank": -1}, "lora_rank=-1 is negative"),
    ({"steps": "ten"}, "steps='ten' is not an integer"),
    ({"per_device_batch_size": 0.1}, "per_device_batch_size=0.1 x 8 devices"),
    ({"hf_lora_export": "base"}, "hf_lora_export=base exports a LoRA checkpoint's adapters"),
  ],
)
def test_replace_refuses_a_change_that_makes_the_config_invalid(changes, message):
  cfg = config(*REPLACED_FROM, num_devices=8)
  assert cfg.replace(**changes)  # Config.replace checks nothing: the refusal below is pyconfig.replace's
  with pytest.raises(ConfigError, match=re.escape(message)):
    pyconfig.replace(cfg, **changes)


def test_replace_takes_only_base_yml_keys_of_a_loaded_config():
  cfg = config(num_devices=8)
  with pytest.raises(KeyError, match="emb_dim"):
    pyconfig.replace(cfg, emb_dim=8)  # derived: replace base_emb_dim
  with pytest.raises(TypeError, match="made by Config"):
    pyconfig.replace(cfg.replace(steps=3), steps=4)  # Config.replace's copy no longer knows its raw values


def test_replace_as_the_export_scripts_use_it():
  """convert_to_hf_checkpoint.py and generate_param_only_checkpoint.py describe the model without its adapters
  (lora_rank=0, whose hf_lora_export and hf_lora_adapter_path go back to their defaults) and, unrolled, with
  scan_layers=false; both are valid configs of their own."""
  cfg = config("lora_rank=4", "hf_lora_export=base", num_devices=8)
  with pytest.raises(ConfigError, match="hf_lora_export=base exports a LoRA checkpoint's adapters"):
    pyconfig.replace(cfg, lora_rank=0)
  merged = pyconfig.replace(cfg, lora_rank=0, hf_lora_export="merged", hf_lora_adapter_path="")
  assert merged == config(num_devices=8)
  assert pyconfig.replace(merged, scan_layers=False) == config("scan_layers=false", num_devices=8)


def test_reading_a_config_imports_no_kernel_and_touches_no_network_or_folder(tmp_path):
  """pyconfig reads its lists of valid values from their owners without importing Pallas (the splash kernels load
  only when a step runs them), and parsing starts no jax.distributed, opens no connection and creates no folder
  (STYLE.md point 2). In a fresh interpreter, since this one has imported everything."""
  script = f"""
    import socket, sys

    def refuse(*args, **kwargs):
      raise AssertionError("reading a config opened a network connection")

    socket.socket.connect = socket.socket.connect_ex = socket.create_connection = refuse
    from MaxText import pyconfig

    cfg = pyconfig.load(
      [{BASE_YML!r}, "run_name=r", "base_output_directory={tmp_path}/out", "metrics_file={tmp_path}/m/m.jsonl",
       "jax_cache_dir={tmp_path}/cache", "compiled_trainstep_file={tmp_path}/c/step"], num_devices=8, env={{}}
    )
    pyconfig.replace(cfg, steps=7)
    import jax

    pallas = sorted(name for name in sys.modules if name.startswith("jax.experimental.pallas"))
    assert not pallas, f"pyconfig imported {{pallas[:3]}}"
    assert not jax.distributed.is_initialized()
    """
  run = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert os.listdir(tmp_path) == []


def test_reading_alone_needs_no_jax():
  """config_parse (yml, presets, overrides, types) reads a config without importing JAX or the layers."""
  script = f"""
    import sys
    from MaxText import config_parse

    values = config_parse.read([{BASE_YML!r}, "run_name=r", "steps=3"], env={{}})
    assert values["steps"] == 3
    assert not {{"jax", "flax", "MaxText.layers"}} & set(sys.modules), sorted(sys.modules)
    """
  run = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, capture_output=True, text=True, check=False
  )
  assert run.returncode == 0, run.stderr[-2000:]


def test_a_config_is_read_and_validated_with_neither_jax_nor_flax():
  """The config layer sits at the bottom: parsing, validating and deriving every model preset's config, and the
  post-training configs', imports neither jax nor flax, nor the layers, the inference engine or RL (each component's
  rules come from its jax-free section, its family's or its kernel's row)."""
  script = f"""
    import os, sys
    from MaxText import pyconfig

    models = sorted(f[:-4] for f in os.listdir({pyconfig.MODELS_DIR!r}) if f.endswith(".yml"))
    for name in models:
      pyconfig.load([{BASE_YML!r}, "run_name=r", f"model_name={{name}}"], num_devices=1, env={{}})
    for extra in (["objective=dpo", "dataset_type=hf"], ["use_sft=true", "dataset_type=hf"], ["lora_rank=4"]):
      pyconfig.load([{BASE_YML!r}, "run_name=r", *extra], num_devices=1, env={{}})
    loaded = {{"jax", "flax", "optax"}} & set(sys.modules)
    loaded |= {{m for m in sys.modules if m.startswith(("MaxText.layers", "MaxText.inference", "MaxText.rl"))}}
    assert not loaded, sorted(loaded)
    print(len(models))
    """
  run = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO_ROOT, capture_output=True, text=True, check=False
  )
  assert run.returncode == 0, run.stderr[-2000:]
  assert int(run.stdout) > 10  # every preset was read
