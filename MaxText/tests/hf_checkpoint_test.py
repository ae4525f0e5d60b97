"""Hugging Face checkpoints of every family against transformers itself, on small random models (float32, CPU).

Each family: a random transformers model is saved, imported with convert_hf_checkpoint.py, and our logits on a
padded batch match transformers' (max |difference| <= 1e-4 x max |logit|); greedy decoding matches
`generate(do_sample=False)` token for token; exporting gives back the original safetensors bit for bit, and
the exported folder loads in transformers with the same logits.
"""

import json
import os

import jax
import numpy as np
import pytest

from MaxText import checkpointing, convert_hf_checkpoint, convert_to_hf_checkpoint, sharding
from MaxText import state as state_lib
from MaxText.inference import decoding
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def hf_model(family: str):
  """A random transformers model of `family`: GQA or MQA with odd group sizes, tied and untied heads."""
  t = transformers
  if family == "llama":  # Llama 3.1 RoPE scaling, 6 query heads over 2 KV heads, untied
    rope = LLAMA3_ROPE | {"original_max_position_embeddings": 16, "rope_theta": 5000.0}
    cfg = t.LlamaConfig(**COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_scaling=rope)
    return t.LlamaForCausalLM(cfg)
  if family == "mistral":  # sliding window 5 (shorter than the test sequences), 3 heads over 1 KV head
    cfg = t.MistralConfig(**COMMON, num_attention_heads=3, num_key_value_heads=1, head_dim=16, sliding_window=5)
    return t.MistralForCausalLM(cfg)
  if family == "qwen3":  # QK-norm, heads x head_dim != hidden, tied
    cfg = t.Qwen3Config(**COMMON, num_attention_heads=6, num_key_value_heads=3, head_dim=10, tie_word_embeddings=True)
    return t.Qwen3ForCausalLM(cfg)
  if family == "qwen3_yarn":  # YaRN RoPE scaling 4x over 16 original positions (the test rows reach 32)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0}
    cfg = t.Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_scaling=rope)
    return t.Qwen3ForCausalLM(cfg)
  if family == "gemma":  # multi-query attention, tied
    return t.GemmaForCausalLM(t.GemmaConfig(**COMMON, num_attention_heads=3, num_key_value_heads=1, head_dim=16))
  if family == "gemma2":  # local/global layers, soft-capping, query_pre_attn_scalar != head_dim
    cfg = t.Gemma2Config(
      **COMMON,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=12,
      sliding_window=5,
      query_pre_attn_scalar=20,
      attn_logit_softcapping=5.0,
      final_logit_softcapping=3.0,
    )
    return t.Gemma2ForCausalLM(cfg)
  if family == "mixtral":  # 4 experts, top-2 (renormalised), sliding window 5
    cfg = t.MixtralConfig(
      **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=2,
      sliding_window=5,
    )  # fmt: skip
    return t.MixtralForCausalLM(cfg)
  if family == "qwen3_moe":  # QK-norm, 6 experts of 40, top-3 not renormalised (norm_topk_prob=false)
    cfg = t.Qwen3MoeConfig(
      **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=10, num_experts=6, num_experts_per_tok=3,
      moe_intermediate_size=40, norm_topk_prob=False,
    )  # fmt: skip
    return t.Qwen3MoeForCausalLM(cfg)
  if family in ("deepseek", "deepseek_plain"):
    # MLA over 1 dense then 2 MoE layers: 8 experts in 4 groups, top-2 from the best 2 groups, a shared expert.
    # deepseek: compressed queries, interleaved RoPE, YaRN 4x over 16 positions with its softmax temperature
    # (mscale 0.8); deepseek_plain: queries projected directly, rotate-half RoPE without scaling.
    plain = family == "deepseek_plain"
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0}
    rope |= {"mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 2.0}
    cfg = t.DeepseekV3Config(
      **COMMON, num_attention_heads=3, num_key_value_heads=3, moe_intermediate_size=24, first_k_dense_replace=1,
      n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
      q_lora_rank=None if plain else 24, kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=14,
      rope_interleave=not plain, rope_parameters={"rope_type": "default", "rope_theta": 5000.0} if plain else rope,
    )  # fmt: skip
    return t.DeepseekV3ForCausalLM(cfg)
  if family == "gpt2":  # 3 heads, learned positions, biases
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=96, n_embd=36, n_layer=3, n_head=3, n_positions=64))
  raise ValueError(family)


def save_random(family: str, folder: str, max_shard_size: str | None = None):
  torch.manual_seed(0)
  model = hf_model(family).eval()
  with torch.no_grad():
    for p in model.parameters():  # norms and biases random too, so every tensor's mapping is tested
      p.normal_(0.0, 0.3)
    for name, b in model.named_buffers():  # DeepSeek's routing bias is a buffer
      if name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.3)
  model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


def import_hf(folder: str, out: str, scan: str = "true") -> str:
  argv = [
    "convert",
    BASE_YML,
    f"hf_model_path={folder}",
    f"base_output_directory={out}",
    "run_name=imported",
    "jax_cache_dir=",
  ]
  assert convert_hf_checkpoint.main([*argv, f"scan_layers={scan}"]) == 0
  return os.path.join(out, "imported", "checkpoints", "0")


def our_config(ckpt: str, *extra, scan="true"):
  return config(
    f"model_name={os.path.join(ckpt, 'model.yml')}",
    f"load_parameters_path={os.path.join(ckpt, 'items')}",
    f"scan_layers={scan}",
    "max_target_length=32",
    "max_prefill_predict_length=16",
    "per_device_batch_size=2",
    *extra,
  )


def restore(cfg):
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  abstract, _ = state_lib.params_layout(models.Transformer(cfg, mesh), cfg, mesh)
  return mesh, checkpointing.restore_params(cfg, abstract)[0]


def padded_batch(lengths, vocab, width=24, seed=1):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), width), np.int32)
  for row, n in enumerate(lengths):
    tokens[row, :n] = rng.integers(1, vocab, n)
  valid = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  return tokens, valid


def our_logits(cfg, mesh, params, tokens, valid):
  model = models.Transformer(cfg, mesh)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(jax.jit(model.apply)({"params": params}, tokens, valid, positions))


def hf_logits(model, tokens, valid):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(valid).long())
  return out.logits.float().numpy()


def assert_close(ours, theirs, valid):
  """max |ours - theirs| over real tokens <= 1e-4 x max |theirs|."""
  mask = valid.astype(bool)
  err = np.max(np.abs(ours[mask] - theirs[mask])) / np.max(np.abs(theirs[mask]))
  assert err <= 1e-4, f"relative logit difference {err:.2e}"


FAMILIES = [
  "llama", "mistral", "mixtral", "qwen3", "qwen3_yarn", "qwen3_moe", "deepseek", "deepseek_plain", "gemma", "gemma2", "gpt2"
]  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_transformers_and_export_round_trips(family, tmp_path):
  scan = "false" if family in ("qwen3", "qwen3_moe", "deepseek_plain", "gpt2") else "true"  # both layouts are covered
  hf_dir = str(tmp_path / "hf")
  model = save_random(family, hf_dir, max_shard_size="40KB" if family == "llama" else None)  # llama: sharded
  ckpt = import_hf(hf_dir, str(tmp_path / "out"), scan)

  cfg = our_config(ckpt, scan=scan)
  mesh, params = restore(cfg)
  tokens, valid = padded_batch([24, 13, 7], cfg.vocab_size)
  theirs = hf_logits(model, tokens, valid)
  assert_close(our_logits(cfg, mesh, params, tokens, valid), theirs, valid)

  # Greedy decoding (KV cache, compiled loop) against transformers' generate, per prompt.
  dec = decoding.Decoder(cfg, mesh)
  prompts = [tokens[1, :13], tokens[2, :7]]
  ours = dec.decode(params, prompts)
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  for prompt, got in zip(prompts, ours, strict=True):
    with torch.no_grad():
      want = model.generate(torch.from_numpy(prompt[None]).long(), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    np.testing.assert_array_equal(got, want[0, len(prompt) :].numpy())

  # Export: the original tensors bit for bit, and transformers loads the folder with the same logits.
  out = str(tmp_path / "exported")
  argv = ["export", BASE_YML, *_keys(cfg), f"hf_model_path={out}", "hf_max_shard_size_mb=1"]
  assert convert_to_hf_checkpoint.main(argv) == 0
  assert_same_tensors(hf_dir, out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_array_equal(hf_logits(reloaded, tokens, valid)[valid.astype(bool)], theirs[valid.astype(bool)])


def _keys(cfg):
  return [f"{k}={getattr(cfg, k)}" for k in ("model_name", "load_parameters_path", "scan_layers")] + [
    "run_name=export",
    "jax_cache_dir=",
  ]


def read_safetensors(folder):
  from safetensors.numpy import load_file

  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


def assert_same_tensors(original, exported):
  a, b = read_safetensors(original), read_safetensors(exported)
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
  """A bfloat16 checkpoint imported with weight_dtype=bfloat16 exports to the same bytes; into float32 (exact)
  it gives the same logits."""
  hf_dir = str(tmp_path / "hf")
  model = save_random("gemma2", hf_dir)
  model.to(torch.bfloat16).save_pretrained(hf_dir)
  out = str(tmp_path / "out")
  argv = ["convert", BASE_YML, f"hf_model_path={hf_dir}", f"base_output_directory={out}", "run_name=bf16", "jax_cache_dir="]
  assert convert_hf_checkpoint.main([*argv, "weight_dtype=bfloat16"]) == 0
  ckpt = os.path.join(out, "bf16", "checkpoints", "0")
  cfg = our_config(ckpt, "weight_dtype=bfloat16")
  exported = str(tmp_path / "exported")
  assert convert_to_hf_checkpoint.main(["export", BASE_YML, *_keys(cfg), f"hf_model_path={exported}"]) == 0
  assert_same_tensors(hf_dir, exported)
  assert json.load(open(os.path.join(exported, "config.json")))["torch_dtype"] == "bfloat16"


def test_config_json_of_transformers_4_and_5_give_the_same_keys():
  """rope_theta + rope_scaling (4.x) and rope_parameters (5.x) read alike; layer_types must fit the family."""
  from MaxText import families
  from MaxText.common_types import ConfigError

  base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96)
  base |= dict(vocab_size=100, hidden_act="silu")
  rope = LLAMA3_ROPE | {"original_max_position_embeddings": 8192}
  v4 = families.model_keys_from_hf(base | {"rope_theta": 500000.0, "rope_scaling": rope})
  v5 = families.model_keys_from_hf(base | {"rope_parameters": rope | {"rope_theta": 500000.0}})
  assert v4 == v5 and v4["rope_type"] == "llama3.1" and v4["rope_max_timescale"] == 500000.0
  with pytest.raises(ConfigError, match="rope type 'dynamic'"):
    families.model_keys_from_hf(base | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
  deepseek_yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}
  with pytest.raises(ConfigError, match="mscale_all_dim is not supported"):
    families.model_keys_from_hf(base | {"rope_scaling": deepseek_yarn})
  gemma2 = dict(base, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", head_dim=16)
  with pytest.raises(ConfigError, match="layer_types"):
    families.model_keys_from_hf(gemma2 | {"layer_types": ["full_attention", "sliding_attention"]})


def test_imported_params_keep_their_values(tmp_path):
  """The stored params are exactly the transformers tensors, rearranged (query of layer 1, the embedding)."""
  hf_dir = str(tmp_path / "hf")
  model = save_random("llama", hf_dir)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"))
  _, params = restore(our_config(ckpt))
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  q = sd["model.layers.1.self_attn.q_proj.weight"]  # [heads * head_dim, embed]
  np.testing.assert_array_equal(np.asarray(params["layers"]["self_attention"]["query"]["kernel"][1]), q.T.reshape(48, 6, 8))
  np.testing.assert_array_equal(np.asarray(params["token_embedder"]["embedding"]), sd["model.embed_tokens.weight"])
