"""Kimi K2 as a preset of the deepseek family (configs/models/kimi-k2-1t.yml) against its published config.json:
the importer reads that file into the preset's keys; the parameter counts, total and active, equal those of
transformers' DeepseekV3ForCausalLM built from it; the model FLOPs count the same active parameters. The family's
layers are tested in deepseek_test and hf_checkpoint_test."""

import functools
import re

import jax
import pytest
import yaml
from flax import linen as nn

from MaxText import families, metrics
from MaxText.common_types import ConfigError
from MaxText.families import MODELS_DIR
from MaxText.layers import models
from MaxText.tests.helpers import config

# moonshotai/Kimi-K2-Instruct's config.json, as published (its custom-code keys, auto_map, left out).
KIMI_K2_JSON = {
  "architectures": ["DeepseekV3ForCausalLM"],
  "model_type": "kimi_k2",
  "attention_bias": False,
  "first_k_dense_replace": 1,
  "hidden_act": "silu",
  "hidden_size": 7168,
  "intermediate_size": 18432,
  "kv_lora_rank": 512,
  "max_position_embeddings": 131072,
  "moe_intermediate_size": 2048,
  "moe_layer_freq": 1,
  "n_group": 1,
  "n_routed_experts": 384,
  "n_shared_experts": 1,
  "norm_topk_prob": True,
  "num_attention_heads": 64,
  "num_experts_per_tok": 8,
  "num_hidden_layers": 61,
  "num_key_value_heads": 64,
  "num_nextn_predict_layers": 0,
  "q_lora_rank": 1536,
  "qk_nope_head_dim": 128,
  "qk_rope_head_dim": 64,
  "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"},
  "rms_norm_eps": 1e-06,
  "rope_scaling": {
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "factor": 32.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
  },
  "rope_theta": 50000.0,
  "routed_scaling_factor": 2.827,
  "scoring_func": "sigmoid",
  "tie_word_embeddings": False,
  "topk_group": 1,
  "topk_method": "noaux_tc",
  "v_head_dim": 128,
  "vocab_size": 163840,
}
# The checkpoint a user imports: Kimi's fp8 weights dequantized to bfloat16 (as for DeepSeek-V3's release), under
# the model_type of the architecture it names (Kimi's own, kimi_k2, is custom code that transformers does not have).
DEQUANTIZED = {k: v for k, v in KIMI_K2_JSON.items() if k != "quantization_config"} | {"model_type": "deepseek_v3"}


def _preset_keys() -> dict:
  with open(f"{MODELS_DIR}/kimi-k2-1t.yml", encoding="utf-8") as f:
    return yaml.safe_load(f)


@functools.cache
def _counts():
  """(Config, total parameters, active parameters per token) of the preset, from its abstract init. Active: the
  total less the experts each token skips (num_experts - num_experts_per_tok per MoE layer)."""
  cfg = config("model_name=kimi-k2-1t", "max_target_length=8", "per_device_batch_size=1")
  shapes = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  params = nn.meta.unbox(shapes)["params"]
  total = metrics.count_params(params)
  moe_layers = cfg.num_decoder_layers - cfg.first_num_dense_layers
  skipped = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.emb_dim * cfg.moe_mlp_dim * moe_layers
  return cfg, params, total, total - skipped


def test_the_importer_reads_the_published_config_into_the_preset():
  """The dequantized checkpoint's config.json gives exactly the preset's model keys; Kimi's own config.json is
  refused in one line each for what it is: a model_type of custom code, fp8 weights."""
  keys = families.model_keys_from_hf(DEQUANTIZED)
  preset = _preset_keys()
  read = {k: v for k, v in keys.items() if k in preset}
  assert read == {k: v for k, v in preset.items() if k in keys}
  assert set(keys) <= set(preset), set(keys) - set(preset)
  with pytest.raises(ConfigError, match=re.escape("model_type='kimi_k2' is not supported")):
    families.model_keys_from_hf(KIMI_K2_JSON)
  with pytest.raises(ConfigError, match=re.escape("quantization_config (fp8) is not supported")):
    families.model_keys_from_hf(KIMI_K2_JSON | {"model_type": "deepseek_v3"})


def test_parameter_counts_equal_transformers_and_the_published_ones():
  """Ours (measured: total 1,026,408,232,448, active 32,861,500,928 with the embedding table) are "1T total, 32B
  activated" as Moonshot's model card rounds them, and exactly the counts of transformers' DeepseekV3ForCausalLM
  built on the meta device from the published config.json. There, active is the total less the share of each
  stacked expert tensor ([experts, ...]) that the experts a token skips hold; DeepSeek's routing bias is a parameter
  of ours and a buffer of transformers'."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  _, _, total, active = _counts()
  assert round(total / 1e12) == 1 and int(active / 1e9) == 32

  hf_json = {k: v for k, v in DEQUANTIZED.items() if k not in ("architectures", "model_type")}
  with torch.device("meta"):
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_json))
  experts, chosen = hf_json["n_routed_experts"], hf_json["num_experts_per_tok"]
  hf_total, hf_skipped = 0, 0
  for name, p in hf.named_parameters():
    hf_total += p.numel()
    if ".mlp.experts." in name:
      assert p.shape[0] == experts, name
      hf_skipped += p.numel() // experts * (experts - chosen)
  hf_total += sum(b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
  assert (hf_total, hf_total - hf_skipped) == (total, active)


def test_model_flops_count_six_per_active_matmul_parameter():
  """The preset's weight FLOPs per step are 6 per token per active parameter a token's matmuls use: the active
  count less the embedding table (a lookup), the norms and the routing bias."""
  cfg, params, _, active = _counts()
  flat = {jax.tree_util.keystr(p): x.size for p, x in jax.tree_util.tree_leaves_with_path(params)}
  lookups = sum(n for k, n in flat.items() if "token_embedder" in k or "scale" in k or "gate_bias" in k)
  tokens = cfg.per_device_batch_size * cfg.max_target_length
  assert metrics.training_flops_per_device(cfg).weights == 6 * tokens * (active - lookups)
