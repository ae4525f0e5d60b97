"""Hugging Face checkpoints of every family against transformers itself, on small random models (float32, CPU).

Each example of each family (its module's hf_examples, found through the registry): a random transformers model is
saved, imported with convert_hf_checkpoint.py, and our logits on a padded batch match transformers' (max |difference|
<= 1e-4 x max |logit|); greedy decoding matches `generate(do_sample=False)` token for token; exporting gives back the
original safetensors bit for bit, and the exported folder loads in transformers with the same logits.
"""

import json
import os

import jax
import numpy as np
import pytest

from MaxText import checkpointing, convert_hf_checkpoint, convert_to_hf_checkpoint, families, sharding
from MaxText import state as state_lib
from MaxText.inference import engine as engine_lib
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# Every family's small random transformers models (its module's hf_examples), by example name.
EXAMPLES = {name: (family, ex) for family in families.FAMILIES.values() for name, ex in family.hf_examples.items()}


def test_every_family_with_a_hugging_face_mapping_has_its_examples():
  """A family that converts to and from Hugging Face's format is tested against transformers: it gives at least one
  example, and example names are unique across families (save_random finds one by its name alone)."""
  named = [name for family in families.FAMILIES.values() for name in family.hf_examples]
  assert len(named) == len(set(named))
  assert all(family.hf_examples for family in families.FAMILIES.values() if family.hf is not None)


def hf_model(name: str):
  """The random transformers model of example `name` (a family's hf_examples): its model_type's config class with
  the example's keys, and that model type's causal LM."""
  family, example = EXAMPLES[name]
  cfg = transformers.AutoConfig.for_model(family.hf.model_type, **example.config)
  return transformers.AutoModelForCausalLM.from_config(cfg)


def save_random(name: str, folder: str, max_shard_size: str | None = None):
  """Example `name`'s model with random weights, saved to `folder` in transformers' format."""
  torch.manual_seed(0)
  model = hf_model(name).eval()
  with torch.no_grad():
    for p in model.parameters():  # norms and biases random too, so every tensor's mapping is tested
      p.normal_(0.0, 0.3)
    for buffer_name, b in model.named_buffers():  # DeepSeek's routing bias is a buffer
      if buffer_name.endswith("e_score_correction_bias"):
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


# Each family's first example runs in the quick loop; its further variants (another RoPE, layout) are slow-marked.
FIRST_EXAMPLES = {next(iter(family.hf_examples)) for family in families.FAMILIES.values() if family.hf_examples}


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=[] if n in FIRST_EXAMPLES else [pytest.mark.slow]) for n in sorted(EXAMPLES)]
)
def test_import_matches_transformers_and_export_round_trips(name, tmp_path):
  example = EXAMPLES[name][1]
  scan = "true" if example.scan_layers else "false"  # the examples between them cover both layouts
  hf_dir = str(tmp_path / "hf")
  model = save_random(name, hf_dir, max_shard_size=example.max_shard_size)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"), scan)

  cfg = our_config(ckpt, scan=scan)
  mesh, params = restore(cfg)
  tokens, valid = padded_batch([24, 13, 7], cfg.vocab_size)
  theirs = hf_logits(model, tokens, valid)
  assert_close(our_logits(cfg, mesh, params, tokens, valid), theirs, valid)

  # Greedy decoding (the engine: paged KV cache, compiled loop) against transformers' generate, per prompt.
  engine = engine_lib.Engine(cfg, mesh, params)
  prompts = [tokens[1, :13], tokens[2, :7]]
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  ours = engine.generate([engine_lib.Request(tuple(int(t) for t in p), n) for p in prompts])
  for prompt, got in zip(prompts, ours, strict=True):
    with torch.no_grad():
      want = model.generate(torch.from_numpy(prompt[None]).long(), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    np.testing.assert_array_equal(got.tokens, want[0, len(prompt) :].numpy())

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


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_quantized_config_json_is_refused_unless_the_family_dequantizes_it(name):
  """Every family's config.json with a quantization_config its importer cannot dequantize (bitsandbytes 4-bit here;
  Llama 4 Maverick's FP8 release, DeepSeek-V3's fp8) is refused in one line naming it; the methods a family lists
  (gpt-oss's mxfp4) are read."""
  from MaxText.common_types import ConfigError

  family, example = EXAMPLES[name]
  hf = transformers.AutoConfig.for_model(family.hf.model_type, **example.config).to_dict()
  hf.pop("quantization_config", None)
  families.model_keys_from_hf(hf)
  with pytest.raises(
    ConfigError, match=rf"quantization_config \(bitsandbytes\) is not supported for {family.hf.model_type}"
  ):
    families.model_keys_from_hf(hf | {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
  for method in family.hf.quantizations:
    assert families.model_keys_from_hf(
      hf | {"quantization_config": {"quant_method": method}}
    ) == families.model_keys_from_hf(hf)
