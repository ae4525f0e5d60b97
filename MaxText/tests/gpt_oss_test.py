"""gpt-oss beyond its Hugging Face parity (hf_checkpoint_test runs the family's hf_examples against transformers):
its mixture of experts (router bias, expert biases, clamped SwiGLU) against transformers' GptOssMLP on every path and
under expert x fsdp x tensor parallelism, MXFP4 dequantization against transformers' own and the import of an MXFP4
checkpoint, the presets' parameter counts, and the one-line refusals of what cannot be imported or exported."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import checkpointing, convert_hf_checkpoint, families, metrics, sharding
from MaxText import state as state_lib
from MaxText.common_types import ConfigError
from MaxText.convert import mxfp4
from MaxText.convert.hf_families import SMALL
from MaxText.convert.streaming import HFTensors
from MaxText.layers import models, moe
from MaxText.tests.helpers import BASE_YML, config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# The tiny model (helpers.TINY: 32 wide, float32, exact matmuls) with gpt-oss's MoE: 4 experts 40 wide, top-2, a
# router bias, and a SwiGLU limit of 1 that the random activations below cross on both sides.
OSS_MOE = ("decoder_block=gpt_oss", "override_model_config=true", "num_experts=4", "num_experts_per_tok=2",
           "base_moe_mlp_dim=40", "mlp_activations=['sigmoid','linear']", "mlp_activations_limit=1.0",
           "routed_bias=true")  # fmt: skip


def _hf_mlp_and_our_params(cfg, seed=0):
  """transformers' GptOssMLP of cfg's sizes with random weights (std 0.2), and the same weights as our MoeBlock's
  parameters: gate_up_proj [experts, embed, 2 * moe_mlp] alternates gate and up columns."""
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

  hf_cfg = transformers.GptOssConfig(
    hidden_size=cfg.emb_dim, intermediate_size=cfg.moe_mlp_dim, num_local_experts=cfg.num_experts,
    num_experts_per_tok=cfg.num_experts_per_tok, swiglu_limit=cfg.mlp_activations_limit,
  )  # fmt: skip
  torch.manual_seed(seed)
  hf = GptOssMLP(hf_cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0.0, 0.2)
  t = {name: p.detach().numpy() for name, p in hf.named_parameters()}
  gate_up, gate_up_bias = t["experts.gate_up_proj"], t["experts.gate_up_proj_bias"]
  params = {
    "gate": {"kernel": t["router.weight"].T, "bias": t["router.bias"]},
    "wi_0": gate_up[..., 0::2], "wi_1": gate_up[..., 1::2],
    "wi_0_bias": gate_up_bias[:, 0::2], "wi_1_bias": gate_up_bias[:, 1::2],
    "wo": t["experts.down_proj"], "wo_bias": t["experts.down_proj_bias"],
  }  # fmt: skip
  return hf, jax.tree_util.tree_map(jnp.asarray, params)


def _block_output_and_grads(block, params, x):
  fn = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(block.apply({"params": p}, x))), (0, 1)))
  return block.apply({"params": params}, x), fn(params, x)


def test_experts_with_biases_equal_transformers_on_every_path():
  """Dropless (grouped matmuls over sorted rows), dense (every expert) and capacity (too large to drop): the output
  of transformers' GptOssMLP on the same weights (float32, 1e-5 of the largest), and the same gradients of the input
  and every weight, biases included (1e-4: sums of a few hundred products in another order)."""
  x = np.random.default_rng(0).normal(size=(2, 64, 32)).astype(np.float32)
  results = {}
  for path in ("sparse_matmul=true", "sparse_matmul=false", "capacity_factor=100.0"):
    cfg = config(*OSS_MOE, path)
    hf, params = _hf_mlp_and_our_params(cfg)
    with torch.no_grad():
      want = hf(torch.from_numpy(x))[0].numpy()
    out, results[path] = _block_output_and_grads(moe.MoeBlock(cfg, renormalize=True, use_bias=True), params, x)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5 * np.abs(want).max(), err_msg=path)
    clamped = np.asarray(jnp.einsum("bse,nem->bsnm", x, params["wi_0"]) + params["wi_0_bias"]) > 1.0
    assert 0.05 < clamped.mean() < 0.5, "the test needs the limit to clamp some, not most, gates"
  (want_value, want_grads), *others = results.values()
  for value, grads in others:
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(want_grads), strict=True):
      scale = np.abs(np.asarray(w)).max()
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.mesh
def test_expert_biases_under_expert_fsdp_and_tensor_parallelism_equal_one_device():
  """8 experts over 2 expert shards x fsdp 2 x tensor 2: each received row takes its own expert's bias, and the
  output projection's bias is added once, not once per moe_mlp shard; outputs and gradients as without a mesh."""
  keys = (*OSS_MOE, "num_experts=8")
  one = config(*keys)
  _, params = _hf_mlp_and_our_params(one)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 64, 32)).astype(np.float32))
  want = _block_output_and_grads(moe.MoeBlock(one, renormalize=True, use_bias=True), params, x)
  mesh_keys = ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
  cfg = config(*keys, *mesh_keys, num_devices=8)
  mesh = sharding.create_mesh(cfg, jax.devices()[:8])
  with jax.set_mesh(mesh):
    got = _block_output_and_grads(moe.MoeBlock(cfg, mesh, renormalize=True, use_bias=True), params, x)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


# ------------------------------------------------------------------------------------------------ MXFP4
def test_mxfp4_dequantization_equals_transformers_bit_for_bit(tmp_path):
  """Random blocks (every byte) and scales (every exponent but 255, which the OCP MX spec makes NaN) dequantize to
  the bfloat16 bits of transformers' convert_moe_packed_tensors; HFTensors lists the pair under its name, with the
  weight's shape, and its rows (experts) are those of the whole."""
  from safetensors.numpy import save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 10, 4, 16), dtype=np.uint8)
  scales = rng.integers(0, 255, (3, 10, 4), dtype=np.uint8)
  scales.flat[:255] = np.arange(255)  # every exponent present
  ours = mxfp4.dequantize(blocks, scales)
  theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
  assert ours.shape == tuple(theirs.shape) == (3, 128, 10)
  np.testing.assert_array_equal(ours.view(np.uint16), theirs.view(torch.int16).numpy().view(np.uint16))
  assert np.isnan(mxfp4.dequantize(blocks[:1], np.full((1, 10, 4), 255, np.uint8)).astype(np.float32)).all()

  save_file({"w_blocks": blocks, "w_scales": scales, "b": np.ones(3, np.float32)}, str(tmp_path / "model.safetensors"))
  tensors = HFTensors(str(tmp_path))
  assert sorted(tensors.files) == ["b", "w"] and tensors.shapes["w"] == (3, 128, 10)
  np.testing.assert_array_equal(tensors.load("w").view(np.uint16), ours.view(np.uint16))
  np.testing.assert_array_equal(tensors.load("w", slice(1, 3)).view(np.uint16), ours[1:3].view(np.uint16))


# A gpt-oss whose experts' inputs (64 and 32 wide) split into MXFP4's 32-value blocks.
MXFP4_MODEL = SMALL | {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}
MXFP4_MODEL |= {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}
QUANTIZED = ("gate_up_proj", "down_proj")


def _quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """MXFP4 of an experts' weight as transformers keeps it, [experts, in, out] -> (blocks, scales) as published:
  each block's exponent puts its largest magnitude in [4, 8), values rounded to the nearest E2M1 (6 at most)."""
  w = np.swapaxes(w, -1, -2).astype(np.float32)
  groups = w.reshape(*w.shape[:-1], -1, 32)  # [experts, out, in / 32, 32]
  amax = np.max(np.abs(groups), axis=-1)
  exponent = np.clip(np.floor(np.log2(np.maximum(amax, 2.0**-120))) - 2, -127, 127).astype(np.int32)
  scaled = groups / np.exp2(exponent)[..., None]
  codes = np.argmin(np.abs(scaled[..., None] - mxfp4.FP4_VALUES), axis=-1).astype(np.uint8)
  return codes[..., 0::2] | (codes[..., 1::2] << 4), (exponent + mxfp4.SCALE_BIAS).astype(np.uint8)


@pytest.fixture(scope="module")
def mxfp4_folders(tmp_path_factory):
  """(an MXFP4 checkpoint of a random gpt-oss, its experts quantized here and stored under the published names
  with an mxfp4 quantization_config; the same checkpoint with those experts dequantized by transformers, bf16)."""
  from safetensors.torch import save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors

  root = tmp_path_factory.mktemp("mxfp4")
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("gpt_oss", **MXFP4_MODEL))
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  packed, plain = str(root / "mxfp4"), str(root / "bf16")
  model.save_pretrained(plain)
  shutil.copytree(plain, packed)
  state = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
  quantized, dequantized = {}, {}
  for name, w in state.items():
    if not name.endswith(QUANTIZED):
      quantized[name] = dequantized[name] = w
      continue
    blocks, scales = (torch.from_numpy(np.ascontiguousarray(a)) for a in _quantize(w.numpy()))
    quantized |= {f"{name}_blocks": blocks, f"{name}_scales": scales}
    dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
  save_file(quantized, os.path.join(packed, "model.safetensors"), metadata={"format": "pt"})
  save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
  quantization = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
  _edit_config(packed, quantization_config=quantization)
  return packed, plain


def _edit_config(folder, **changes):
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    hf = json.load(f)
  with open(path, "w") as f:
    json.dump(hf | changes, f)


def _import(folder, out, run_name="imported", *extra) -> int:
  argv = ["convert", BASE_YML, f"hf_model_path={folder}", f"base_output_directory={out}", f"run_name={run_name}"]
  return convert_hf_checkpoint.main([*argv, "jax_cache_dir=", *extra])


def _imported_params(out, run_name):
  ckpt = os.path.join(out, run_name, "checkpoints", "0")
  cfg = config(f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}/items")
  return cfg, checkpointing.restore_host_params(cfg, state_lib.abstract_params(cfg))[0]


def test_an_mxfp4_checkpoint_imports_as_its_dequantized_weights(mxfp4_folders, tmp_path):
  """The MXFP4 folder (blocks and scales, quantization_config mxfp4) and the folder of transformers' dequantized
  bfloat16 experts import to the same parameters, bit for bit, and the same model keys."""
  packed, plain = mxfp4_folders
  assert _import(packed, tmp_path, "packed") == 0 and _import(plain, tmp_path, "plain") == 0
  (cfg_a, a), (cfg_b, b) = _imported_params(tmp_path, "packed"), _imported_params(tmp_path, "plain")
  assert cfg_a.decoder_block == cfg_b.decoder_block == "gpt_oss" and cfg_a.mlp_activations_limit == 7.0
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
  assert np.abs(a["layers"]["mlp"]["wi_1"]).max() > 0  # the experts were read, not zeros


def _drop_tensor(folder, name):
  from safetensors.torch import load_file, save_file

  path = os.path.join(folder, "model.safetensors")
  tensors = load_file(path)
  del tensors[name]
  save_file(tensors, path, metadata={"format": "pt"})


EXPERTS = "model.layers.1.mlp.experts."
BAD = {
  "missing_scales": (
    lambda d: _drop_tensor(d, EXPERTS + "down_proj_scales"),
    f"tensor {EXPERTS}down_proj_blocks is MXFP4 but {EXPERTS}down_proj_scales is missing",
  ),
  "missing_blocks": (
    lambda d: _drop_tensor(d, EXPERTS + "gate_up_proj_blocks"),
    f"tensor {EXPERTS}gate_up_proj_scales is MXFP4 but {EXPERTS}gate_up_proj_blocks is missing",
  ),
  "fp8": (
    lambda d: _edit_config(d, quantization_config={"quant_method": "fp8"}),
    "quantization_config (fp8) is not supported for gpt_oss",
  ),
  "swiglu_alpha": (lambda d: _edit_config(d, swiglu_alpha=1.5), "swiglu_alpha=1.5 is not supported"),
  "layer_types": (lambda d: _edit_config(d, layer_types=["full_attention"] * 3), "differ from gpt_oss's pattern"),
  "no_attention_bias": (lambda d: _edit_config(d, attention_bias=False), "attention_bias=false is not supported"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gpt_oss_checkpoint_exits_2_with_one_line_and_writes_nothing(case, mxfp4_folders, tmp_path, capsys):
  folder = str(tmp_path / "hf")
  shutil.copytree(mxfp4_folders[0], folder)
  damage, message = BAD[case]
  damage(folder)
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
  assert not out.exists()


def _set_block(folder, name, expert, row, scale, byte):
  """MXFP4 tensor `name`: the first 32-value block of `row` of `expert` gets the E8M0 `scale` and every value the
  byte's two E2M1 codes."""
  from safetensors.torch import load_file, save_file

  path = os.path.join(folder, "model.safetensors")
  tensors = load_file(path)
  tensors[name + "_scales"][expert, row, 0] = scale
  tensors[name + "_blocks"][expert, row, 0, :] = byte
  save_file(tensors, path, metadata={"format": "pt"})


def test_mxfp4_scales_making_nan_or_infinity_are_refused_naming_the_tensor(mxfp4_folders, tmp_path, capsys):
  """A scale of 255 is E8M0's NaN (OCP MX v1.0; transformers would compute 2**128 from it); 254 times E2M1's 6
  (byte 0x77) is 1.5 * 2**129, infinite in bfloat16 as in transformers: 32 values each, refused in one line naming
  the tensor, its blocks and scales, the count and the NaN scales, nothing written; hf_allow_non_finite_weights
  imports them. A scale of 254 whose values stay in range (0.5 * 2**127, byte 0x11) is a valid one and imports."""
  name = EXPERTS + "gate_up_proj"
  folder = str(tmp_path / "hf")
  shutil.copytree(mxfp4_folders[0], folder)
  _set_block(folder, name, expert=1, row=3, scale=255, byte=0x21)
  _set_block(folder, name, expert=2, row=5, scale=254, byte=0x77)
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out) == 2
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.strip() and not line.startswith("tensors:")]
  assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
  assert (
    f"tensor {name} (MXFP4: {name}_blocks, {name}_scales) dequantizes to 64 NaN or infinite values (of " in lines[0]
    and "1 scales of 255, E8M0's NaN" in lines[0]
  ), lines
  assert not out.exists()
  assert _import(folder, out, "imported", "hf_allow_non_finite_weights=true") == 0
  _, params = _imported_params(out, "imported")
  wi = np.concatenate([np.asarray(params["layers"]["mlp"][k], np.float32) for k in ("wi_0", "wi_1")])
  assert np.isnan(wi).sum() == 32 and np.isinf(wi).sum() == 32

  valid = str(tmp_path / "valid")
  shutil.copytree(mxfp4_folders[0], valid)
  _set_block(valid, name, expert=2, row=5, scale=254, byte=0x11)
  assert _import(valid, tmp_path / "valid_out") == 0


def test_what_the_format_or_the_layer_cannot_hold_is_refused():
  """Export needs gpt-oss's router bias and clamped SwiGLU; a SwiGLU limit needs the activations it clamps."""
  cfg = config(*OSS_MOE, "routed_bias=false")
  with pytest.raises(ConfigError, match="has a router bias and the clamped SwiGLU"):
    families.hf_mapping(cfg).write_config(cfg)
  with pytest.raises(ConfigError, match=r"mlp_activations_limit=7.0 is gpt-oss's clamped SwiGLU.*\['silu', 'linear'\]"):
    config(*OSS_MOE, "mlp_activations=['silu','linear']", "mlp_activations_limit=7.0")
  # Another family would train a clamped SwiGLU that its format (here Llama's hidden_act=silu) cannot hold.
  with pytest.raises(ConfigError, match="mlp_activations_limit=7.0 is gpt-oss's clamped SwiGLU, which decoder_block=llama2"):
    config("override_model_config=true", "mlp_activations=['sigmoid','linear']", "mlp_activations_limit=7.0")
  # The sinks cannot run on cuDNN: refused when the config is read, before any device work (the kernel refuses the
  # same when traced; attention_kernels_test).
  with pytest.raises(ConfigError, match="attention=cudnn_flash_te: cuDNN fused attention has no attention sinks"):
    config(*OSS_MOE, "attention=cudnn_flash_te", "hardware=gpu")


# ------------------------------------------------------------------------------------------------ presets
# The model card's figures (arXiv:2508.10925), in billions: all parameters, and those active per token
# counted without the embedding table (a lookup).
PUBLISHED = {"gpt-oss-20b": ("20.91", "3.61"), "gpt-oss-120b": ("116.83", "5.13")}


# openai/gpt-oss-20b's and gpt-oss-120b's config.json as published (transformers 4.55's keys), written out here.
def _published_config(layers: int, experts: int) -> dict:
  hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0}
  hf |= {"eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4}
  hf |= {"head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880, "initializer_range": 0.02}
  hf |= {"initial_context_length": 4096, "max_position_embeddings": 131072, "sliding_window": 128, "swiglu_limit": 7.0}
  hf |= {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}
  hf |= {"num_attention_heads": 64, "num_key_value_heads": 8, "num_hidden_layers": layers, "num_local_experts": experts}
  hf |= {"output_router_logits": False, "router_aux_loss_coef": 0.9, "rms_norm_eps": 1e-05, "rope_theta": 150000}
  hf |= {"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}}
  hf["rope_scaling"]["original_max_position_embeddings"] = 4096
  not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
  hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": not_converted}
  return hf | {"tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}


PUBLISHED_CONFIGS = {"gpt-oss-20b": _published_config(24, 32), "gpt-oss-120b": _published_config(36, 128)}


def test_every_gpt_oss_preset_has_a_published_count():
  assert sorted(families.presets("gpt_oss")) == sorted(PUBLISHED) == sorted(PUBLISHED_CONFIGS)


def test_published_config_json_gives_each_preset():
  """Importing each published config.json (MXFP4, as published) gives exactly the preset's model keys (YaRN 32 from
  4096 positions, theta 150000, beta 32 and 1, no truncation, the window of 128, the SwiGLU limit of 7): those the
  preset file names, and base.yml's values for those it leaves to base.yml."""
  import yaml

  with open(BASE_YML, encoding="utf-8") as f:
    base = yaml.safe_load(f)
  for preset, published in PUBLISHED_CONFIGS.items():
    with open(os.path.join(families.MODELS_DIR, f"{preset}.yml"), encoding="utf-8") as f:
      yml = {k: v for k, v in yaml.safe_load(f).items() if k != "enable_dropout"}  # a training key, not the model's
    keys = families.model_keys_from_hf(published)
    assert keys == yml | {k: base[k] for k in keys.keys() - yml.keys()}, preset


@pytest.mark.parametrize(
  "preset",
  ["gpt-oss-20b", pytest.param("gpt-oss-120b", marks=pytest.mark.slow)],  # 120b: 20b is its fast sibling
)
def test_preset_parameter_counts_equal_transformers_and_the_model_card(preset):
  """Our parameters (abstract init), all and active (less the num_experts - num_experts_per_tok experts a token
  skips, biases included, in every layer), equal those of transformers' GptOssForCausalLM built on the meta device
  from the published config.json, counted from its modules; and the model card's rounded figures."""
  cfg = config(f"model_name={preset}", "max_target_length=8", "per_device_batch_size=1")
  shapes = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  params = nn.meta.unbox(shapes)["params"]
  total = metrics.count_params(params)
  skipped_share = (cfg.num_experts - cfg.num_experts_per_tok) / cfg.num_experts
  expert_names = ("wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")
  experts = sum(metrics.count_params(params["layers"]["mlp"][n]) for n in expert_names)
  active = total - experts * skipped_share

  published = PUBLISHED_CONFIGS[preset]
  with torch.device("meta"):
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**published))
  hf_total = sum(p.numel() for p in hf.parameters())
  hf_experts = sum(p.numel() for layer in hf.model.layers for p in layer.mlp.experts.parameters())
  hf_share = (published["num_local_experts"] - published["num_experts_per_tok"]) / published["num_local_experts"]
  assert (total, active) == (hf_total, hf_total - hf_experts * hf_share)

  embedding = metrics.count_params(params["token_embedder"])
  for count, figure in zip((total, active - embedding), PUBLISHED[preset], strict=True):
    assert abs(count / 1e9 - float(figure)) <= 0.005, (preset, count, figure)
