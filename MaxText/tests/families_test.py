"""The family registry: the only source of decoder_block values, found by listing MaxText/families/; a new family is
its layer class and its family entry, and no list anywhere names it.

The throwaway family below (Llama's layer with Qwen 3's QK-norm, a sliding window in every third layer, a pattern no
real family has, and a derived key of its own) is registered for a test as a family module's FAMILY is
(`families.register`), and goes where a real family goes: config, training, decoding, FLOPs, Hugging Face's format
and back.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import checkpointing, convert_hf_checkpoint, convert_to_hf_checkpoint, families, metrics, sharding, state, train
from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.families import mistral, qwen3
from MaxText.inference import engine as engine_lib
from MaxText.layers import decoders, models
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, overrides


class ToyDecoderLayer(LlamaDecoderLayer):
  """Llama's layer with each query and key head RMS-normalised (as Qwen 3 does), windowed in layers 0, 3, 6, ..."""

  qk_norm = True

  @classmethod
  def sliding_window(cls, config: Config, layer_index):
    if isinstance(layer_index, int):
      return config.sliding_window_size if layer_index % 3 == 0 else 0
    return jnp.where(jnp.asarray(layer_index) % 3 == 0, config.sliding_window_size, 0)


TOY = families.Family(
  "toy",
  ToyDecoderLayer,
  hf_families.llama_like("toy", "ToyForCausalLM", norms=qwen3.NORMS, read=mistral.read, write=mistral.write),
  derive=lambda values: {"toy_doubled_emb_dim": 2 * values["emb_dim"]},
)
# Four layers (windowed: 0 and 3), a window shorter than the prompts.
TOY_KEYS = ("decoder_block=toy", "override_model_config=true", "base_num_decoder_layers=4", "sliding_window_size=5")


@pytest.fixture
def toy():
  families.register(TOY)
  yield TOY
  families.unregister(TOY.name)


def _family_modules() -> list[str]:
  """The family modules, read from the folder (not through the registry)."""
  folder = os.path.join(REPO_ROOT, "MaxText", "families")
  return sorted(f.removesuffix(".py") for f in os.listdir(folder) if f.endswith(".py") and f != "__init__.py")


def test_the_registry_is_the_family_modules():
  """Every module of MaxText/families/ is a registered family of its name, and nothing else is registered; the
  layers find each one's layer class through it."""
  assert list(families.FAMILIES) == _family_modules()
  for name, family in families.FAMILIES.items():
    assert decoders.layer(name) is family.layer_class and issubclass(family.layer_class, LlamaDecoderLayer)


@pytest.mark.parametrize("name", sorted(families.FAMILIES))
def test_a_familys_traits_are_its_layers(name):
  """The traits pyconfig checks without importing the layers are those of the layer class the family names."""
  family = families.get(name)
  layer = family.layer_class
  traits = ("attention_type", "moe", "clamped_swiglu", "router_logit_bias", "attention_sinks")
  assert {t: getattr(family, t) for t in traits} == {t: getattr(layer, t) for t in traits}
  assert family.dense_layers == (layer.dense_layer is not None)


def test_the_registry_imports_neither_jax_nor_flax():
  """The families are below the layers: listing them, and every family module, imports neither (pyconfig reads them)."""
  import subprocess
  import sys

  code = "import sys, MaxText.families; print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "[]", out.stdout


def test_registering_a_family_is_undone_by_unregistering_it(toy):
  assert families.get("toy") is toy and decoders.layer("toy") is ToyDecoderLayer
  with pytest.raises(ValueError, match="a family named 'toy' is registered already"):
    families.register(toy)
  families.unregister("toy")
  assert "toy" not in families.FAMILIES
  with pytest.raises(ConfigError, match="decoder_block='toy' is not supported"):
    decoders.layer("toy")
  families.register(toy)  # for the fixture to remove


def test_decoder_block_values_come_from_the_registry(toy):
  from MaxText import pyconfig

  assert pyconfig.choices()["decoder_block"] is families.FAMILIES
  cfg = config(*TOY_KEYS)
  assert cfg.decoder_block == "toy" and cfg.toy_doubled_emb_dim == 2 * cfg.emb_dim  # the family's derived key
  with pytest.raises(ConfigError, match="head_dim=7 is odd"):  # the default check of a family (RoPE)
    config(*TOY_KEYS, "head_dim=7")


def test_a_family_adds_derived_keys_but_never_replaces_one():
  families.register(dataclasses.replace(TOY, derive=lambda values: {"emb_dim": 1}))
  try:
    with pytest.raises(ValueError, match=r"family toy derives \['emb_dim'\], which exist already"):
      config(*TOY_KEYS)
  finally:
    families.unregister("toy")


def test_an_unknown_family_is_refused_naming_the_registered_ones():
  named = ", ".join(repr(name) for name in _family_modules())
  with pytest.raises(ConfigError, match=f"decoder_block='toy' is not supported; choose one of {named}$"):
    config(*TOY_KEYS)
  with pytest.raises(ConfigError, match="model_type='toy' is not supported; supported: ") as refused:
    families.for_hf_config({"model_type": "toy"})
  assert all(f.hf.model_type in str(refused.value) for f in families.FAMILIES.values() if f.hf is not None)


def test_every_family_has_its_own_hugging_face_model_type():
  with_hf = [f for f in families.FAMILIES.values() if f.hf is not None]
  assert len({f.hf.model_type for f in with_hf}) == len(with_hf)
  for family in with_hf:
    assert families.for_hf_config({"model_type": family.hf.model_type}) is family


def test_readme_table_is_the_registry_s():
  """The families table of the Model families guide (docs/guides/models.md) is summary_table()'s output, whole: a
  registered family missing from it, or a row that is not the registry's, fails (the guide's "Adding a model family"
  says to paste the new row)."""
  readme = open(os.path.join(REPO_ROOT, "docs", "guides", "models.md"), encoding="utf-8").read()
  assert families.summary_table() in readme


def test_a_new_family_trains_and_converts_to_and_from_hugging_face(toy, tmp_path):
  """Training uses the layer, export writes the family's config.json and tensors, import reads them back into the
  same parameters, bit for bit, and the same config (the window included)."""
  keys = (*TOY_KEYS, "steps=2", "enable_checkpointing=true", "async_checkpointing=false")
  cfg = config(*keys, f"base_output_directory={tmp_path}")
  summary = train.train(cfg, jax.devices()[:1])
  assert len(summary.losses) == 2 and np.isfinite(summary.losses).all()
  items = os.path.join(checkpointing.checkpoint_dir(cfg), "2", "items")
  saved, _ = checkpointing.restore_host_params(cfg.replace(load_parameters_path=items), state.abstract_params(cfg))
  assert "query_norm" in saved["layers"]["self_attention"]  # the toy layer, not Llama's

  hf_dir = str(tmp_path / "hf")
  export = ["export", BASE_YML, *overrides(*keys, f"load_full_state_path={items}", f"hf_model_path={hf_dir}")]
  assert convert_to_hf_checkpoint.main(export) == 0
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
  assert back_cfg.decoder_block == "toy" and back_cfg.sliding_window_size == 5 and back_cfg.num_decoder_layers == 4
  back, _ = checkpointing.restore_host_params(back_cfg, state.abstract_params(back_cfg))
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, saved)


def _greedy_by_full_forward(model, params, prompt, n):
  """Greedy decoding by the whole uncached forward pass at each step (right-padded to one width)."""
  seq, width = list(prompt), len(prompt) + n
  forward = jax.jit(lambda t, s: model.apply({"params": params}, t, s, jnp.arange(width)[None]))
  for _ in range(n):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(seq)] = seq
    logits = np.asarray(forward(tokens, (np.arange(width) < len(seq)).astype(np.int32)[None]))
    seq.append(int(np.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt) :]


@pytest.mark.parametrize("scan", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_a_new_family_decodes_as_its_uncached_forward(toy, scan):
  """The engine's paged KV cache (prefill, then cached steps in the compiled loop) gives the tokens of greedy
  decoding by the full forward pass, with the toy's windows (shorter than the prompts) in layers 0 and 3, scanned
  (traced windows) or unrolled (static ones)."""
  keys = (f"scan_layers={scan}", "max_target_length=24", "max_prefill_predict_length=16", "per_device_batch_size=1")
  cfg = config(*TOY_KEYS, *keys)
  model = models.Transformer(cfg)
  params = nn.meta.unbox(model.init({"params": jax.random.key(3)}, *models.init_inputs(1, cfg.max_target_length)))["params"]
  engine = engine_lib.Engine(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), params)
  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(1, cfg.vocab_size, n)) for n in (11, 7)]
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  results = engine.generate([engine_lib.Request(prompt, n) for prompt in prompts])
  for prompt, got in zip(prompts, results, strict=True):
    assert got.tokens == _greedy_by_full_forward(model, params, prompt, n)


def _allowed_pairs(length: int, window: int) -> int:
  """(query, key) pairs a causal, windowed mask allows, counted one by one."""
  return sum(1 for q in range(length) for k in range(q + 1) if window <= 0 or q - k < window)


def test_a_new_family_is_counted_by_flops(toy):
  """The toy's attention FLOPs: for each layer, 4 * heads * head_dim per (query, key) pair its mask allows (window 5
  in layers 0 and 3, causal in 1 and 2), the diagonal counted half as MaxText counts causal attention, times 3 for
  forward and backward; its weights cost what Llama's of the same shape do."""
  cfg = config(*TOY_KEYS)
  length, h, d = cfg.max_target_length, cfg.num_query_heads, cfg.head_dim
  windows = [5, 0, 0, 5]
  pairs = sum(_allowed_pairs(length, w) - length / 2 for w in windows)
  sequences = cfg.per_device_batch_size * cfg.gradient_accumulation_steps
  flops = metrics.training_flops_per_device(cfg)
  assert flops.attention == 3 * sequences * 4 * h * d * pairs
  llama = config("override_model_config=true", "base_num_decoder_layers=4")
  assert flops.weights == metrics.training_flops_per_device(llama).weights
