"""Qwen 2.5's presets against the published models: parameter counts equal to the checkpoints' and to the transformers
model of the same dimensions, and biases on the query, key and value projections only. The family's parity with
transformers (logits, decoding, export) is tested in hf_checkpoint_test with the other families."""

import pytest

from MaxText import families, metrics
from MaxText.tests.helpers import abstract_params

# The published bfloat16 checkpoints' parameters: metadata.total_size of Qwen/Qwen2.5-*'s model.safetensors.index.json
# (or the one file's size) halved. The model cards round differently (32B's says 32.5B).
PUBLISHED = {
  "qwen2.5-0.5b": 988_065_536 // 2,
  "qwen2.5-1.5b": 3_087_428_608 // 2,
  "qwen2.5-7b": 15_231_233_024 // 2,
  "qwen2.5-14b": 29_540_067_328 // 2,
  "qwen2.5-32b": 65_527_752_704 // 2,
  "qwen2.5-72b": 145_412_407_296 // 2,
}


def test_every_qwen2_preset_has_a_published_count():
  assert sorted(families.presets("qwen2")) == sorted(PUBLISHED)


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_count_equals_the_checkpoint_and_transformers(preset):
  """Our parameters (abstract init) are the published checkpoint's, and exactly those of transformers'
  Qwen2ForCausalLM (built on the meta device) from a Qwen2Config of the preset's dimensions, written out here rather
  than by our exporter."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  params, cfg = abstract_params(preset)
  total = metrics.count_params(params)
  assert total == PUBLISHED[preset]

  assert cfg.head_dim * cfg.num_query_heads == cfg.emb_dim  # Qwen2Config's head_dim is hidden_size // heads
  hf_cfg = transformers.Qwen2Config(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.emb_dim,
    intermediate_size=cfg.mlp_dim,
    num_hidden_layers=cfg.num_decoder_layers,
    num_attention_heads=cfg.num_query_heads,
    num_key_value_heads=cfg.num_kv_heads,
    tie_word_embeddings=cfg.logits_via_embedding,
  )
  with torch.device("meta"):
    hf = transformers.Qwen2ForCausalLM(hf_cfg)
  assert sum(p.numel() for p in hf.parameters()) == total


def test_biases_are_on_the_query_key_and_value_projections_only():
  params, _ = abstract_params("qwen2.5-0.5b")
  attention = params["layers"]["self_attention"]
  assert {name for name, p in attention.items() if "bias" in p} == {"query", "key", "value"}
  assert not any("bias" in p for p in params["layers"]["mlp"].values())
