"""Mistral: Llama's layer with sliding-window attention in every layer (sliding_window_size <-> sliding_window)."""

from collections.abc import Mapping

from MaxText.common_types import Config
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family


def read(config_json: Mapping, keys: dict) -> dict:
  del keys
  return {"sliding_window_size": config_json.get("sliding_window") or 0}


def write(cfg: Config) -> dict:
  return {"sliding_window": cfg.sliding_window_size or None}


FAMILY = Family(
  "mistral",
  "MaxText.layers.mistral:MistralDecoderLayer",
  hf_families.llama_like("mistral", "MistralForCausalLM", read=read, write=write),
  summary="sliding-window attention in every layer (`sliding_window_size`)",
  hf_examples={
    # A sliding window of 5 (shorter than the test sequences), 3 heads over 1 KV head.
    "mistral": HFExample(SMALL | {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16, "sliding_window": 5}),
  },
)
