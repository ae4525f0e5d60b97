"""The family registry: the only source of decoder_block values, and a new family is one layer class and one entry.

The throwaway family below (Llama's layer with Qwen 3's QK-norm and a derived key of its own) is registered for
one test, trains, and goes to Hugging Face's format and back through the same registry, bit for bit.
"""

import dataclasses
import os

import jax
import numpy as np
import pytest

from MaxText import checkpointing, convert_hf_checkpoint, convert_to_hf_checkpoint, families, pyconfig, state, train
from MaxText.common_types import ConfigError
from MaxText.convert import hf_families
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.tests.helpers import BASE_YML, config, overrides


class ToyDecoderLayer(LlamaDecoderLayer):
  """Llama's layer with each query and key head RMS-normalised (as Qwen 3 does)."""

  qk_norm = True


TOY = families.Family(
  "toy",
  ToyDecoderLayer,
  hf_families.llama_like("toy", "ToyForCausalLM", norms=families.QWEN3_NORMS),
  derive=lambda values: {"toy_doubled_emb_dim": 2 * values["emb_dim"]},
)


@pytest.fixture
def toy(monkeypatch):
  monkeypatch.setitem(families.FAMILIES, TOY.name, TOY)
  return TOY


def test_decoder_block_values_come_from_the_registry(toy):
  assert pyconfig.choices()["decoder_block"] is families.FAMILIES
  cfg = config("decoder_block=toy", override_model_config="true")
  assert cfg.decoder_block == "toy" and cfg.toy_doubled_emb_dim == 2 * cfg.emb_dim  # the family's derived key
  with pytest.raises(ConfigError, match="head_dim=7 is odd"):  # the default check of a family (RoPE)
    config("decoder_block=toy", "head_dim=7", override_model_config="true")


def test_a_family_adds_derived_keys_but_never_replaces_one(monkeypatch):
  greedy = dataclasses.replace(TOY, derive=lambda values: {"emb_dim": 1})
  monkeypatch.setitem(families.FAMILIES, TOY.name, greedy)
  with pytest.raises(ValueError, match=r"family toy derives \['emb_dim'\], which exist already"):
    config("decoder_block=toy", override_model_config="true")


def test_an_unknown_family_is_refused_naming_the_registered_ones():
  with pytest.raises(ConfigError, match="decoder_block='toy' is not supported; choose one of 'llama2', 'mistral'"):
    config("decoder_block=toy", override_model_config="true")
  with pytest.raises(ConfigError, match="model_type='toy' is not supported; supported: llama, mistral"):
    families.for_hf_config({"model_type": "toy"})


def test_every_family_has_its_own_hugging_face_model_type():
  with_hf = [f for f in families.FAMILIES.values() if f.hf is not None]
  assert len({f.hf.model_type for f in with_hf}) == len(with_hf) == 9
  for family in with_hf:
    assert families.for_hf_config({"model_type": family.hf.model_type}) is family


def test_a_new_family_trains_and_converts_to_and_from_hugging_face(toy, tmp_path):
  """One layer class and one registry entry: training uses the layer, export writes the family's config.json and
  tensors, import reads them back into the same parameters, bit for bit."""
  keys = ("decoder_block=toy", "steps=2", "enable_checkpointing=true", "async_checkpointing=false")
  cfg = config(*keys, f"base_output_directory={tmp_path}", override_model_config="true")
  summary = train.train(cfg, jax.devices()[:1])
  assert len(summary.losses) == 2
  items = os.path.join(checkpointing.checkpoint_dir(cfg), "2", "items")
  saved, _ = checkpointing.restore_host_params(cfg.replace(load_parameters_path=items), state.abstract_params(cfg))
  assert "query_norm" in saved["layers"]["self_attention"]  # the toy layer, not Llama's

  hf_dir = str(tmp_path / "hf")
  export = ["export", BASE_YML, *overrides(*keys, f"load_full_state_path={items}", f"hf_model_path={hf_dir}")]
  assert convert_to_hf_checkpoint.main([*export, "override_model_config=true"]) == 0
  config_json = open(os.path.join(hf_dir, "config.json"), encoding="utf-8").read()
  assert '"model_type": "toy"' in config_json and "ToyForCausalLM" in config_json

  imported = [
    "import",
    BASE_YML,
    f"hf_model_path={hf_dir}",
    f"base_output_directory={tmp_path}",
    "run_name=back",
    "jax_cache_dir=",
  ]
  assert convert_hf_checkpoint.main(imported) == 0
  ckpt = os.path.join(tmp_path, "back", "checkpoints", "0")
  back_cfg = config(f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}/items")
  assert back_cfg.decoder_block == "toy"
  back, _ = checkpointing.restore_host_params(back_cfg, state.abstract_params(back_cfg))
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, saved)
