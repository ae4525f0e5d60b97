"""Config parsing: precedence, types, presets, derived values, and one-line errors for bad input."""

import os
import re

import pytest
import yaml

from MaxText import pyconfig, train
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, config


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
]


@pytest.mark.parametrize("overrides, key", BAD, ids=[b[0][0] for b in BAD])
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
      assert "MaxText/families.py" in comments[key]
      continue
    comment = comments[key].split("#", 1)[1]
    # A whole word: "float16" is not found inside "bfloat16", nor "high" inside "highest".
    missing = [v for v in valid if not re.search(rf"(?<![\w.]){re.escape(v)}(?!\w)(?!\.\w)" if v else '""', comment)]
    assert not missing, f"base.yml's comment on {key} does not name {missing}"
