"""Qwen 3 (dense): Llama's layer with QK-norm, and Hugging Face's Qwen3 format without sliding windows."""

from collections.abc import Mapping

from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family


def read(config_json: Mapping, keys: dict) -> dict:
  return hf_families.read_full_attention(config_json, keys, "qwen3")


write = hf_families.write_full_attention


NORMS = hf_families.LLAMA_NORMS + (
  ("self_attn.q_norm", "self_attention.query_norm"),
  ("self_attn.k_norm", "self_attention.key_norm"),
)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0}

FAMILY = Family(
  "qwen3",
  "MaxText.layers.qwen3:Qwen3DecoderLayer",
  hf_families.llama_like("qwen3", "Qwen3ForCausalLM", norms=NORMS, read=read, write=write),
  summary="RMSNorm of each query and key head (QK-norm)",
  hf_examples={
    # QK-norm, heads x head_dim != hidden, tied; unrolled layers.
    "qwen3": HFExample(
      SMALL | {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 10, "tie_word_embeddings": True},
      scan_layers=False,
    ),
    # YaRN RoPE scaling 4x over 16 original positions (the test rows reach 32).
    "qwen3_yarn": HFExample(
      SMALL | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rope_scaling": YARN}
    ),
  },
)
