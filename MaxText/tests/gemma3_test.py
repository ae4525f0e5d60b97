"""Gemma 3's presets, its multimodal checkpoints' text model, and the config.json variants it refuses. The family's
parity with transformers (logits, decoding, export) is tested in hf_checkpoint_test with the other families (the
`gemma3` and `gemma3_unrolled` examples of families/gemma3.py)."""

import json
import os

import jax
import numpy as np
import pytest
from flax import linen as nn

from MaxText import convert_hf_checkpoint, families, metrics
from MaxText.layers import models
from MaxText.layers.gemma3 import Gemma3DecoderLayer
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import BASE_YML, abstract_params, config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from MaxText.tests.hf_checkpoint_test import (  # noqa: E402
  assert_close,
  hf_logits,
  import_hf,
  our_config,
  our_logits,
  padded_batch,
  restore,
  save_random,
)

PRESETS = ["gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b"]


def test_every_gemma3_preset_is_counted():
  assert sorted(families.presets("gemma3")) == sorted(PRESETS)


def test_one_layer_in_six_is_global_in_the_flop_count_and_the_scan():
  """Layers 5, 11, ... attend globally, as transformers' layer_types from sliding_window_pattern=6; the traced
  (scanned) window is the unrolled one, layer by layer."""
  cfg = config("decoder_block=gemma3", "override_model_config=true", "sliding_window_size=7")
  hf_types = transformers.Gemma3TextConfig(num_hidden_layers=13).layer_types
  windows = [Gemma3DecoderLayer.sliding_window(cfg, i) for i in range(13)]
  assert windows == [0 if kind == "full_attention" else 7 for kind in hf_types]
  traced = jax.jit(jax.vmap(lambda i: Gemma3DecoderLayer.sliding_window(cfg, i)))(np.arange(13))
  assert list(np.asarray(traced)) == windows


# The published config.json files (google/gemma-3-1b-pt; the text_config of google/gemma-3-{4b,12b,27b}-pt, which names
# only what differs from Gemma3TextConfig's defaults), written out here as transformers 4.50 saved them.
_MULTIMODAL = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
_LINEAR_8 = {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024, "model_type": "gemma3_text"}
PUBLISHED_CONFIGS = {
  "gemma3-1b": {
    "architectures": ["Gemma3ForCausalLM"],
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "vocab_size": 262144,
  },
  "gemma3-4b": _MULTIMODAL
  | {"text_config": _LINEAR_8 | {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34}},
  "gemma3-12b": _MULTIMODAL
  | {
    "text_config": _LINEAR_8
    | {"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48}
    | {"num_attention_heads": 16, "num_key_value_heads": 8}
  },
  "gemma3-27b": _MULTIMODAL
  | {
    "text_config": _LINEAR_8
    | {"hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "head_dim": 128}
    | {"num_attention_heads": 32, "num_key_value_heads": 16, "query_pre_attn_scalar": 168}
  },
}


def test_published_config_json_gives_each_preset():
  """Importing each published config.json (transformers 4.x's keys; the multimodal ones through their text_config
  and Gemma3TextConfig's defaults) gives exactly the preset's model keys."""
  import yaml

  for preset, published in PUBLISHED_CONFIGS.items():
    with open(os.path.join(families.MODELS_DIR, f"{preset}.yml")) as f:
      yml = {k: v for k, v in yaml.safe_load(f).items() if k != "enable_dropout"}
    assert families.model_keys_from_hf(published) == yml, preset


@pytest.mark.parametrize(
  "preset", [pytest.param(p, marks=[] if p == "gemma3-1b" else [pytest.mark.slow]) for p in PRESETS]
)  # the 1B runs in the quick loop; the others, the same count on bigger shapes, are slow-marked beside it
def test_preset_parameter_count_equals_transformers(preset):
  """Our parameters (abstract init) are exactly those of transformers' Gemma3ForCausalLM (built on the meta device)
  from a Gemma3TextConfig of the preset's dimensions, written out here rather than by our exporter."""
  params, cfg = abstract_params(preset)
  hf_cfg = transformers.Gemma3TextConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.emb_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_decoder_layers,
    num_attention_heads=cfg.num_query_heads,
    num_key_value_heads=cfg.num_kv_heads,
    head_dim=cfg.head_dim,
    tie_word_embeddings=cfg.logits_via_embedding,
  )
  with torch.device("meta"):
    hf = transformers.Gemma3ForCausalLM(hf_cfg)
  assert metrics.count_params(params) == sum(p.numel() for p in hf.parameters())


@pytest.mark.slow  # its fast sibling: model_test's flash case for gemma2 (the same traced window, another pattern)
def test_flash_attention_equals_dot_product():
  """attention=flash (blockwise on the CPU) gives dot_product's loss and gradients for 7 Gemma 3 layers in a scan
  (local and global windows, both RoPEs), with two packed documents in a row (float32)."""
  from MaxText.tests.helpers import train_batch
  from MaxText.tests.model_test import assert_grads_close

  keys = ("decoder_block=gemma3", "override_model_config=true", "base_num_decoder_layers=7", "sliding_window_size=12")
  keys += ("rope_linear_scaling_factor=4", "local_rope_max_timescale=100", "max_target_length=48")
  reference, cfg = (
    config(*keys, "attention=dot_product"),
    config(*keys, "attention=flash", "sa_block_q=16", "sa_block_kv=16"),
  )
  tokens, segments, positions = models.init_inputs(2, 48)
  params = nn.meta.unbox(models.Transformer(cfg).init(jax.random.key(0), tokens, segments, positions))["params"]
  batch = train_batch(cfg)
  batch["inputs_segmentation"] = batch["targets_segmentation"] = np.repeat([[1] * 20 + [2] * 28], 2, axis=0)
  batch["inputs_position"] = np.repeat([np.r_[np.arange(20), np.arange(28)]], 2, axis=0).astype(np.int32)

  def loss_and_grads(c):
    model = models.Transformer(c)
    return jax.jit(jax.value_and_grad(lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True)[0]))(
      params
    )

  (loss, grads), (ref_loss, ref_grads) = loss_and_grads(cfg), loss_and_grads(reference)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
  jax.tree_util.tree_map(assert_grads_close, grads, ref_grads)


# ------------------------------------------------------------------------------------------ multimodal checkpoints
def _multimodal_model():
  """A random Gemma3ForConditionalGeneration with a tiny vision tower; its text model is the `gemma3` example's with
  Gemma3TextConfig's defaults for the heads, query_pre_attn_scalar and the local RoPE base (which the published
  config.json leaves out)."""
  text = dict(families.FAMILIES["gemma3"].hf_examples["gemma3"].config)
  del text["rope_local_base_freq"], text["query_pre_attn_scalar"], text["num_attention_heads"], text["head_dim"]
  text["num_key_value_heads"] = 4
  vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28)
  cfg = transformers.Gemma3Config(
    text_config=transformers.Gemma3TextConfig(**text),
    vision_config=transformers.SiglipVisionConfig(**vision, patch_size=14),
    mm_tokens_per_image=4,
    image_token_index=95,
    boi_token_index=93,
    eoi_token_index=94,
  )
  torch.manual_seed(0)
  model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.3)
  return model


def _sparse_text_config(folder: str) -> None:
  """Leaves in config.json's text_config only what differs from Gemma3TextConfig's defaults, as the published
  checkpoints' config.json does (google/gemma-3-4b-pt's names no heads, head_dim or vocab_size)."""
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  defaults = transformers.Gemma3TextConfig().to_dict()
  cfg["text_config"] = {k: v for k, v in cfg["text_config"].items() if k not in defaults or defaults[k] != v}
  left_out = {"num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar"}
  assert not left_out & set(cfg["text_config"]) and "hidden_size" in cfg["text_config"]
  with open(path, "w") as f:
    json.dump(cfg, f)


def _in_memory_names(folder: str) -> None:
  """Renames the tensors from the published layout (language_model.model.*, vision_tower.*, ..., which transformers
  also saves) to the modules' names in transformers 5 (model.language_model.*, model.vision_tower.*, lm_head.*)."""
  from safetensors.numpy import load_file, save_file

  renames = [("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head.")]
  renames += [("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector.")]
  for name in [n for n in os.listdir(folder) if n.endswith(".safetensors")]:
    tensors = load_file(os.path.join(folder, name))
    renamed = {}
    for key, value in tensors.items():
      old, new = next((o, n) for o, n in renames if key.startswith(o))
      renamed[new + key.removeprefix(old)] = value
    save_file(renamed, os.path.join(folder, name), metadata={"format": "pt"})


@pytest.mark.parametrize(
  "rewrite", [_sparse_text_config, pytest.param(_in_memory_names, marks=pytest.mark.slow)]
)  # the published form runs in the quick loop; the other tensor names (the same TextTower renames) are slow-marked
def test_multimodal_checkpoint_imports_its_text_model(rewrite, tmp_path):
  """A Gemma3ForConditionalGeneration folder imports as its text model (the vision tower's tensors left out): our
  logits on a padded text batch are the multimodal model's own."""
  model = _multimodal_model()
  hf_dir = str(tmp_path / "hf")
  model.save_pretrained(hf_dir)
  names = json.load(open(os.path.join(hf_dir, "config.json")))
  assert names["model_type"] == "gemma3" and names["architectures"] == ["Gemma3ForConditionalGeneration"]
  rewrite(hf_dir)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"))
  cfg = our_config(ckpt)
  assert cfg.decoder_block == "gemma3" and cfg.rope_linear_scaling_factor == 4.0 and cfg.head_dim == 256
  mesh, params = restore(cfg)
  tokens, valid = padded_batch([24, 13, 7], 90)  # below the image tokens (93 to 95)
  assert_close(our_logits(cfg, mesh, params, tokens, valid), hf_logits(model, tokens, valid), valid)


# ------------------------------------------------------------------------------------------ bad input
def _rope(cfg):
  cfg["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}


def _rope_scaling(cfg):  # transformers 4.x's keys
  del cfg["rope_parameters"]
  cfg.update(rope_theta=1e6, rope_local_base_freq=100.0, rope_scaling={"rope_type": "dynamic", "factor": 2.0})


def _local_rope(cfg):
  cfg["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}


BAD = {  # config.json edit -> the key the one-line error names
  "layer_types": (
    lambda c: c.update(layer_types=["sliding_attention", "full_attention"] * 3 + ["sliding_attention"]),
    "layer_types",
  ),
  "sliding_window_pattern": (lambda c: c.update(sliding_window_pattern=4, layer_types=None), "sliding_window_pattern=4"),
  "rope_type": (_rope, "rope_parameters rope type 'yarn'"),
  "rope_scaling": (_rope_scaling, "rope_scaling rope type 'dynamic'"),
  "local_rope_type": (_local_rope, "rope_parameters.sliding_attention rope type 'linear'"),
  "attn_logit_softcapping": (lambda c: c.update(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
  "bidirectional": (lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
}


@pytest.fixture(scope="module")
def saved_gemma3(tmp_path_factory):
  folder = str(tmp_path_factory.mktemp("gemma3") / "hf")
  save_random("gemma3", folder)
  return folder


@pytest.mark.parametrize(
  "case", [pytest.param(c, marks=[] if c == "layer_types" else [pytest.mark.slow]) for c in BAD]
)  # one case in the quick loop; the others refuse through the same path (hf_families.unsupported) and are slow-marked
def test_unsupported_config_json_exits_2_with_one_line_and_writes_nothing(case, saved_gemma3, tmp_path, capsys):
  import shutil

  folder = shutil.copytree(saved_gemma3, str(tmp_path / "hf"))
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  edit, message = BAD[case]
  edit(cfg)
  with open(path, "w") as f:
    json.dump({k: v for k, v in cfg.items() if v is not None or k != "layer_types"}, f)
  out = tmp_path / "out"
  capsys.readouterr()
  argv = ["convert", BASE_YML, f"hf_model_path={folder}", f"base_output_directory={out}", "run_name=x", "jax_cache_dir="]
  assert convert_hf_checkpoint.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
  assert not out.exists()
