"""Gemma 2: sandwich norms, soft-capped logits, query_pre_attn_scalar, and local (even) / global (odd) layers."""

from collections.abc import Mapping

from MaxText.common_types import Config
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family


def layer_types(num_layers: int) -> list[str]:
  """Even layers attend locally (sliding window), odd ones globally (Gemma2DecoderLayer.sliding_window)."""
  return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def read(config_json: Mapping, keys: dict) -> dict:
  hf_families.check_layer_types(config_json, layer_types(keys["base_num_decoder_layers"]), "gemma2")
  return {
    "sliding_window_size": config_json.get("sliding_window") or 0,
    "attn_logits_soft_cap": float(config_json.get("attn_logit_softcapping") or 0.0),
    "final_logits_soft_cap": float(config_json.get("final_logit_softcapping") or 0.0),
    "query_pre_attn_scalar": float(config_json.get("query_pre_attn_scalar") or keys["head_dim"]),
  }


def write(cfg: Config) -> dict:
  return {
    "sliding_window": cfg.sliding_window_size or None,
    "layer_types": layer_types(cfg.num_decoder_layers),
    "attn_logit_softcapping": cfg.attn_logits_soft_cap or None,
    "final_logit_softcapping": cfg.final_logits_soft_cap or None,
    "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
  }


NORMS = (
  ("input_layernorm", "pre_self_attention_layer_norm"),
  ("post_attention_layernorm", "post_self_attention_norm"),
  ("pre_feedforward_layernorm", "pre_ffw_norm"),
  ("post_feedforward_layernorm", "post_ffw_norm"),
)

FAMILY = Family(
  "gemma2",
  "MaxText.layers.gemma2:Gemma2DecoderLayer",
  hf_families.llama_like(
    "gemma2", "Gemma2ForCausalLM", gelu=True, tied_by_default=True, norms=NORMS, read=read, write=write
  ),
  summary=(
    "norms before and after attention and MLP, `attn_logits_soft_cap`, `final_logits_soft_cap`, "
    "`query_pre_attn_scalar`, local (even) and global (odd) layers"
  ),
  hf_examples={
    # Local/global layers, soft-capping, query_pre_attn_scalar != head_dim.
    "gemma2": HFExample(
      SMALL
      | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "sliding_window": 5}
      | {"query_pre_attn_scalar": 20, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}
    ),
  },
)
