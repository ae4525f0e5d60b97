"""Qwen 2 and 2.5: Llama's layer with query, key and value biases, and Hugging Face's Qwen2 format without sliding
windows."""

from collections.abc import Mapping

from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family


def read(config_json: Mapping, keys: dict) -> dict:
  return hf_families.read_full_attention(config_json, keys, "qwen2")


write = hf_families.write_full_attention


FAMILY = Family(
  "qwen2",
  "MaxText.layers.qwen2:Qwen2DecoderLayer",
  hf_families.llama_like("qwen2", "Qwen2ForCausalLM", read=read, write=write, qkv_bias=True),
  summary="biases on the query, key and value projections",
  hf_examples={
    # 6 query heads over 2 KV heads (groups of 3), untied; scanned layers.
    "qwen2": HFExample(SMALL | {"num_attention_heads": 6, "num_key_value_heads": 2, "rope_theta": 1e6}),
    # 5 query heads over 1 KV head, tied output head (Qwen2.5-0.5B and 1.5B tie theirs); unrolled layers.
    "qwen2_tied": HFExample(
      SMALL | {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12, "tie_word_embeddings": True},
      scan_layers=False,
    ),
  },
)
