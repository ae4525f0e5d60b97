"""The llama4 family beyond its Hugging Face parity (hf_checkpoint_test runs its examples: logits, greedy decoding
and export against transformers): the published config.json files read into the presets, whose parameter counts
equal those of transformers' Llama4ForCausalLM built from them; interleaved dense and MoE layers scanned by periods
against the same layers unrolled, the FLOPs of chunked attention against a count of the mask, the published
multimodal checkpoints' text model, and the config.json layer patterns refused in one line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import convert_hf_checkpoint, families, metrics
from MaxText.common_types import ConfigError
from MaxText.layers import decoders, embeddings, models
from MaxText.layers.attention_masks import Tokens
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import BASE_YML, abstract_params, config, train_batch

# Published sizes in billions (total, active): Meta's model cards. Scout's 109B total counts its vision encoder too,
# so its text model's total is checked against transformers only.
PUBLISHED = {"llama4-17b-16e": (None, "17"), "llama4-17b-128e": ("400", "17")}

# The text_config of the published config.json files (meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E;
# multimodal, Llama4ForConditionalGeneration, tie_word_embeddings false at the top), written out here; their token
# ids, dtype, dropout, router loss and cache keys are left out. Unsure: (1) whether no_rope_layers and moe_layers are
# in the files (absent, or no_rope_layers [], transformers derives every 4th layer NoPE and every
# interleave_moe_layer_step-th MoE; test_published_config_json_gives_each_preset reads each form alike); (2) Scout's
# RoPE scaling and max_position_embeddings, which an earlier revision of its file gave as factor 8,
# high_freq_factor 4 and 262144: neither has parameters, so the counts do not depend on them (the keys test and the
# RoPE frequencies below take the current file's). Scout's attn_temperature_tuning is 4 as published: transformers
# 4.51 read it as true; 5.23's strict config refuses the int (even from_pretrained), so the count builds transformers'
# model with bool(4); it scales the NoPE layers' queries and holds no parameters (Maverick's: 4 or true, unsure; either
# reads as true).
_TEXT = {"model_type": "llama4_text", "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 8192}
_TEXT |= {"intermediate_size_mlp": 16384, "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8}
_TEXT |= {"head_dim": 128, "num_experts_per_tok": 1, "vocab_size": 202048, "rms_norm_eps": 1e-05, "rope_theta": 500000.0}
_TEXT |= {"attention_bias": False, "attention_chunk_size": 8192, "attn_scale": 0.1, "floor_scale": 8192}
_MULTIMODAL = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "tie_word_embeddings": False}
_SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}
_SCOUT_ROPE |= {"original_max_position_embeddings": 8192}
PUBLISHED_CONFIGS = {
  "llama4-17b-16e": _MULTIMODAL
  | {
    "text_config": _TEXT
    | {"num_local_experts": 16, "interleave_moe_layer_step": 1, "use_qk_norm": True, "attn_temperature_tuning": 4}
    | {"max_position_embeddings": 10485760, "rope_scaling": _SCOUT_ROPE}
  },
  "llama4-17b-128e": _MULTIMODAL
  | {
    "text_config": _TEXT
    | {"num_local_experts": 128, "interleave_moe_layer_step": 2, "use_qk_norm": False, "attn_temperature_tuning": True}
    | {"max_position_embeddings": 1048576, "rope_scaling": None}
  },
}

# A small interleaved model with every option: MoE in every 2nd of 4 layers, NoPE every 2nd, chunks of 5, QK norm,
# temperature rising every 4 positions.
TINY_LLAMA4 = (
  "decoder_block=llama4",
  "override_model_config=true",
  "base_num_decoder_layers=4",
  "num_experts=4",
  "num_experts_per_tok=1",
  "shared_experts=1",
  "routed_score_func=sigmoid",
  "base_moe_mlp_dim=24",
  "interleave_moe_layer_step=2",
  "nope_layer_interval=2",
  "chunk_attn_window_size=5",
  "use_qk_norm=true",
  "temperature_tuning=true",
  "temperature_tuning_floor_scale=4",
  "load_balance_loss_weight=0.01",
  "max_target_length=16",
)


def test_every_llama4_preset_has_a_published_count():
  assert sorted(families.presets("llama4")) == sorted(PUBLISHED) == sorted(PUBLISHED_CONFIGS)


def test_published_config_json_gives_each_preset():
  """Importing each published config.json (through its text_config) gives exactly the preset's model keys: those
  the preset file names, and base.yml's values for the routing and temperature keys it leaves to base.yml. The
  same with the layer lists written out (no_rope_layers [] or transformers' derived lists, moe_layers too)."""
  import yaml

  with open(BASE_YML, encoding="utf-8") as f:
    base = yaml.safe_load(f)
  for preset, published in PUBLISHED_CONFIGS.items():
    with open(f"{families.MODELS_DIR}/{preset}.yml", encoding="utf-8") as f:
      yml = {k: v for k, v in yaml.safe_load(f).items() if k != "enable_dropout"}  # a training key, not the model's
    text = published["text_config"]
    derived = _hf_text_config(text)
    variants = [text, text | {"no_rope_layers": []}]
    variants.append(text | {"no_rope_layers": derived.no_rope_layers, "moe_layers": derived.moe_layers})
    for variant in variants:
      keys = families.model_keys_from_hf(published | {"text_config": variant})
      assert keys == yml | {k: base[k] for k in keys.keys() - yml.keys()}, preset


def _hf_text_config(text: dict):
  """transformers' Llama4TextConfig of a published text_config. attn_temperature_tuning: 4 in Scout's file, which
  transformers 4.51 read as true and 5.23 refuses as not a bool; given as bool (it holds no parameters)."""
  transformers = pytest.importorskip("transformers")
  keys = {k: v for k, v in text.items() if k != "model_type"}
  return transformers.Llama4TextConfig(**keys | {"attn_temperature_tuning": bool(text["attn_temperature_tuning"])})


@pytest.mark.parametrize(
  "preset",
  [
    "llama4-17b-128e",
    # Its fast sibling: the same test of llama4-17b-128e (a second 48-layer init, and Scout's RoPE scaling).
    pytest.param("llama4-17b-16e", marks=pytest.mark.slow),
  ],
)
def test_preset_parameter_counts_equal_transformers(preset):
  """Our parameters (abstract init), all and active (less the experts each token skips), are exactly those of
  transformers' Llama4ForCausalLM built on the meta device from the published config.json's text_config, there
  active less the skipped experts' share of each stacked expert tensor ([experts, ...]); the active ones round to
  the published figures; the RoPE frequencies are transformers' of the published file."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  params, cfg = abstract_params(preset)
  total = metrics.count_params(params)
  moe_layers = cfg.num_decoder_layers // cfg.interleave_moe_layer_step
  active = total - (cfg.num_experts - 1) * 3 * cfg.emb_dim * cfg.moe_mlp_dim * moe_layers
  for count, published in zip((total, active), PUBLISHED[preset], strict=True):
    if published is not None:
      assert abs(count / 1e9 - float(published)) < 1.0, (preset, count, published)

  text = PUBLISHED_CONFIGS[preset]["text_config"]
  hf_cfg = _hf_text_config(text)
  with torch.device("meta"):
    hf = transformers.Llama4ForCausalLM(hf_cfg)
  experts, chosen = text["num_local_experts"], text["num_experts_per_tok"]
  hf_total, hf_skipped = 0, 0
  for name, p in hf.named_parameters():
    hf_total += p.numel()
    if ".feed_forward.experts." in name:
      assert p.shape[0] == experts, name
      hf_skipped += p.numel() // experts * (experts - chosen)
  assert (hf_total, hf_total - hf_skipped) == (total, active)
  if text["rope_scaling"] is not None:  # Scout's Llama 3 scaling, by transformers' own function (no values on meta)
    inv_freq = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")[0]
    np.testing.assert_allclose(embeddings.rope_frequencies(cfg, cfg.head_dim), inv_freq.numpy(), rtol=1e-6)


def _loss_and_grads(cfg, params, batch):
  model = models.Transformer(cfg)
  loss = lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True)  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def test_interleaved_layers_scanned_by_periods_equal_unrolled():
  """MoE every 2nd layer: the scanned stack holds periods (layer_0 dense, layer_1 MoE, stacked over 2 periods);
  its loss (with the load-balancing loss) and gradients equal those of the unrolled periods layers_0 and layers_1,
  and param_path finds each layer's parameters in both layouts."""
  cfg = config(*TINY_LLAMA4)
  params = models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, cfg.max_target_length))
  params = nn.meta.unbox(params)["params"]
  assert set(params["layers"]) == {"layer_0", "layer_1"}
  assert "wi_0" in params["layers"]["layer_0"]["mlp"] and "gate" in params["layers"]["layer_1"]["mlp"]
  batch = train_batch(cfg)
  (loss, aux), grads = _loss_and_grads(cfg, params, batch)
  assert aux["moe_lb_loss"] > 0
  unrolled_cfg = config(*TINY_LLAMA4, "scan_layers=false")
  unrolled = {k: v for k, v in params.items() if k != "layers"}
  for j in range(2):
    unrolled[f"layers_{j}"] = jax.tree_util.tree_map(lambda a, j=j: a[j], params["layers"])
  (loss_u, _), grads_u = _loss_and_grads(unrolled_cfg, unrolled, batch)
  np.testing.assert_allclose(loss_u, loss, rtol=1e-6)
  for i in range(cfg.num_decoder_layers):
    path = "self_attention.query.kernel"
    (scanned_at, j), (unrolled_at, none) = (decoders.param_path(c, path, i) for c in (cfg, unrolled_cfg))
    assert (
      none is None
      and scanned_at == f"layers.layer_{i % 2}.{path}"
      and unrolled_at == f"layers_{i // 2}.layer_{i % 2}.{path}"
    )
    g, gu = grads, grads_u
    for key in scanned_at.split("."):
      g = g[key]
    for key in unrolled_at.split("."):
      gu = gu[key]
    np.testing.assert_allclose(g[j], gu, rtol=1e-4, atol=1e-6 * np.abs(gu).max(), err_msg=f"layer {i}")


def _mask_pairs(length: int, chunk: int) -> float:
  """The (query, key) pairs a causal mask within chunks lets through, counted from the mask itself, with the
  diagonal counted half (MaxText's convention, llama.causal_pairs)."""
  ids = jnp.arange(length)
  tokens = Tokens(jnp.ones((1, length), jnp.int32), ids[None], ids)
  return float(np.sum(np.asarray(tokens.mask(tokens, 0, chunk)))) - length / 2


def test_flops_count_the_chunks_the_nope_layers_and_the_active_experts():
  """Attention FLOPs: per layer 4 * heads * head_dim per pair of the mask (chunks of 5 in the RoPE layers, all
  earlier keys in the NoPE ones), counted from the mask; weight FLOPs: 6 per token per parameter a token's matmuls
  use (all but the embedding table, the norms and the 3 of 4 experts a token skips in each MoE layer), counted
  from the initialised model."""
  cfg = config(*TINY_LLAMA4, "per_device_batch_size=2")
  length, tokens = cfg.max_target_length, 2 * cfg.max_target_length
  flops = metrics.training_flops_per_device(cfg)
  pairs = sum(_mask_pairs(length, 0 if (i + 1) % 2 == 0 else 5) for i in range(cfg.num_decoder_layers))
  assert pairs < cfg.num_decoder_layers * length * length / 2  # the chunks count fewer pairs than full layers
  assert flops.attention == pytest.approx(3 * tokens / length * 4 * cfg.num_query_heads * cfg.head_dim * pairs)
  params = models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, length))
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(nn.meta.unbox(params)["params"])}
  used = sum(x.size for k, x in flat.items() if "token_embedder" not in k and "scale" not in k)
  skipped = (cfg.num_experts - 1) * 3 * cfg.emb_dim * cfg.moe_mlp_dim * (cfg.num_decoder_layers // 2)
  assert flops.weights == 6 * tokens * (used - skipped)


def test_multimodal_checkpoint_imports_its_text_model(tmp_path):
  """A Llama4ForConditionalGeneration folder (the published checkpoints' form: text_config, language_model.*
  tensors beside a vision tower) imports as its text model: our logits equal its language model's."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from MaxText.tests import hf_checkpoint_test as hf_test

  text = dict(families.get("llama4").hf_examples["llama4"].config)
  vision = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
  vision |= {"vision_output_dim": 16, "image_size": 28, "patch_size": 14, "projector_input_dim": 16}
  vision |= {"projector_output_dim": 16}
  hf_cfg = transformers.Llama4Config(text_config=text, vision_config=vision)
  torch.manual_seed(0)
  model = transformers.Llama4ForConditionalGeneration(hf_cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  model.save_pretrained(tmp_path / "hf")
  ckpt = hf_test.import_hf(str(tmp_path / "hf"), str(tmp_path / "out"))
  cfg = hf_test.our_config(ckpt)
  mesh, params = hf_test.restore(cfg)
  tokens, valid = hf_test.padded_batch([24, 13, 7], cfg.vocab_size)
  theirs = hf_test.hf_logits(model.language_model, tokens, valid)
  hf_test.assert_close(hf_test.our_logits(cfg, mesh, params, tokens, valid), theirs, valid)


# config.json variants we cannot run: (keys changed in a small Llama4ForCausalLM config.json, what the line names).
BAD_CONFIGS = {
  "moe_not_every_kth": ({"moe_layers": [0, 2, 3]}, "moe_layers=[0, 2, 3]"),
  "moe_step_not_dividing": ({"moe_layers": [2]}, "moe_layers=[2]"),
  "nope_irregular": ({"no_rope_layers": [1, 0, 0, 1]}, "no_rope_layers=[1, 0, 0, 1]"),
  "top_2": ({"num_experts_per_tok": 2}, "num_experts_per_tok=2"),
  "layer_types": ({"layer_types": ["full_attention"] * 4}, "layer_types="),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_unsupported_layer_patterns_exit_2_with_one_line_naming_the_key(case, tmp_path, capsys):
  keys, message = BAD_CONFIGS[case]
  example = families.get("llama4").hf_examples["llama4"].config
  hf = {"model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "hidden_act": "silu"} | dict(example)
  hf |= {"moe_layers": [1, 3], "no_rope_layers": [1, 0, 1, 0]} | keys
  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(hf))
  out = tmp_path / "out"
  argv = ["convert", BASE_YML, f"hf_model_path={folder}", f"base_output_directory={out}", "run_name=x", "jax_cache_dir="]
  capsys.readouterr()
  assert convert_hf_checkpoint.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
  assert not out.exists()


@pytest.mark.parametrize(
  ("args", "message"),
  [
    (("interleave_moe_layer_step=3",), "interleave_moe_layer_step=3 must be >= 1 and divide base_num_decoder_layers=4"),
    (("ici_pipeline_parallelism=2",), "interleave_moe_layer_step=2 with pipeline parallelism is not supported"),
    (("routed_score_func=softmax",), "routed_score_func=softmax: Llama 4's mixture of experts needs"),
    (("sliding_window_size=8",), "sliding_window_size=8 has no effect for llama4"),
  ],
)
def test_llama4_config_mistakes_are_config_errors(args, message):
  with pytest.raises(ConfigError, match=message):
    config(*TINY_LLAMA4, *args, num_devices=2 if "ici_pipeline_parallelism=2" in args else 1)
