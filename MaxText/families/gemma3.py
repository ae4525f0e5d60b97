"""Gemma 3 (text): Gemma 2's layer with QK-norm, five local layers to one global one and a RoPE for each kind; Hugging
Face's Gemma3ForCausalLM (gemma3_text) both ways, and the text model of Gemma3ForConditionalGeneration (gemma3: the
4B, 12B and 27B checkpoints) on import."""

import dataclasses
from collections.abc import Mapping
from typing import Any

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family, rope_rotates_pairs

# transformers' Gemma3TextConfig defaults, which its config.json may leave out: the multimodal checkpoints' text_config
# names only what differs from them (the 4B's has no head_dim, heads or vocab_size).
TEXT_DEFAULTS = {
  "vocab_size": 262_208,
  "hidden_size": 2304,
  "intermediate_size": 9216,
  "num_hidden_layers": 26,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "rms_norm_eps": 1e-6,
  "tie_word_embeddings": True,
  "query_pre_attn_scalar": 256,
  "sliding_window": 4096,
  "rope_theta": 1_000_000.0,
  "rope_local_base_freq": 10_000.0,
}
ROPE_KEYS = ("rope_scaling", "rope_parameters")
GLOBAL_EVERY = 6  # one global layer in six: transformers' sliding_window_pattern


def is_global(layer_index):
  """Whether layer `layer_index` (an int, or a traced index inside a scan) attends globally: the last of every six."""
  return (layer_index + 1) % GLOBAL_EVERY == 0


def local_rope_theta(config) -> float:
  """The local layers' RoPE theta: local_rope_max_timescale, or rope_max_timescale where it is -1."""
  return config.rope_max_timescale if config.local_rope_max_timescale < 0 else config.local_rope_max_timescale


def layer_types(num_layers: int) -> list[str]:
  """Five sliding-window layers, then a global one (Gemma3DecoderLayer.sliding_window), as transformers names them."""
  return ["full_attention" if is_global(i) else "sliding_attention" for i in range(num_layers)]


def _rope_type(params: Mapping) -> str:
  return params.get("rope_type", params.get("type", "default"))


def read_rope(hf: Mapping) -> dict:
  """The two RoPEs from config.json: transformers 4.x's rope_theta, rope_local_base_freq and rope_scaling (which
  scales the global layers only), or 5.x's rope_parameters by layer type."""
  params = hf.get("rope_parameters") or {}
  by_kind = "full_attention" in params or "sliding_attention" in params
  key = "rope_parameters" if by_kind else "rope_scaling"
  full = (params.get("full_attention") or {}) if by_kind else (hf.get("rope_scaling") or params)
  local = (params.get("sliding_attention") or {}) if by_kind else {}
  if _rope_type(local) != "default":
    raise hf_families.unsupported(
      f"rope_parameters.sliding_attention rope type {_rope_type(local)!r} is not supported; gemma3's local layers "
      "use default RoPE"
    )
  if _rope_type(full) not in ("default", "linear"):
    raise hf_families.unsupported(
      f"{key} rope type {_rope_type(full)!r} is not supported for gemma3; supported: default, linear"
    )
  return {
    "rope_max_timescale": float(full.get("rope_theta") or hf["rope_theta"]),
    "local_rope_max_timescale": float(local.get("rope_theta") or hf["rope_local_base_freq"]),
    "rope_linear_scaling_factor": float(full["factor"]) if _rope_type(full) == "linear" else 1.0,
  }


def read(config_json: Mapping, keys: dict) -> dict:
  """Gemma 3's own keys; what transformers' Gemma3ForCausalLM would compute differently from us is refused."""
  if config_json.get("use_bidirectional_attention"):
    raise hf_families.unsupported("use_bidirectional_attention=true is not supported; gemma3 is imported as a causal LM")
  pattern = config_json.get("sliding_window_pattern")
  if pattern is not None and pattern != GLOBAL_EVERY:
    raise hf_families.unsupported(
      f"sliding_window_pattern={pattern} is not supported; gemma3 has five local layers to one global ({GLOBAL_EVERY})"
    )
  hf_families.check_layer_types(config_json, layer_types(keys["base_num_decoder_layers"]), "gemma3")
  if config_json.get("attn_logit_softcapping") is not None:  # transformers' Gemma 3 attention leaves it out
    raise hf_families.unsupported(
      f"attn_logit_softcapping={config_json['attn_logit_softcapping']} is not supported; Gemma 3 has no attention soft cap"
    )
  return {
    "sliding_window_size": config_json.get("sliding_window") or 0,
    "final_logits_soft_cap": float(config_json.get("final_logit_softcapping") or 0.0),
    "query_pre_attn_scalar": float(config_json["query_pre_attn_scalar"]),
  }


def write(cfg: Config) -> dict:
  if cfg.attn_logits_soft_cap:
    raise ConfigError(
      f"attn_logits_soft_cap={cfg.attn_logits_soft_cap}: Gemma 3's Hugging Face format has no attention soft cap "
      "(transformers ignores attn_logit_softcapping); export with attn_logits_soft_cap=0"
    )
  factor = cfg.rope_linear_scaling_factor
  return {
    "sliding_window": cfg.sliding_window_size or None,
    "sliding_window_pattern": GLOBAL_EVERY,
    "layer_types": layer_types(cfg.num_decoder_layers),
    "attn_logit_softcapping": None,
    "final_logit_softcapping": cfg.final_logits_soft_cap or None,
    "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
    "rope_theta": cfg.rope_max_timescale,
    "rope_local_base_freq": local_rope_theta(cfg),
    "rope_scaling": {"rope_type": "linear", "factor": factor} if factor != 1.0 else None,
  }


def check(values: Mapping[str, Any]) -> None:
  rope_rotates_pairs(values)
  if values["rope_type"] != "default":
    raise ConfigError(
      f"rope_type={values['rope_type']!r} is not supported for decoder_block=gemma3; its global layers' scaling is "
      "rope_linear_scaling_factor (set rope_type=default)"
    )
  if values["rope_linear_scaling_factor"] <= 0:
    raise ConfigError(f"rope_linear_scaling_factor={values['rope_linear_scaling_factor']} must be positive (1 is off)")


NORMS = (
  ("input_layernorm", "pre_self_attention_layer_norm"),
  ("post_attention_layernorm", "post_self_attention_norm"),
  ("pre_feedforward_layernorm", "pre_ffw_norm"),
  ("post_feedforward_layernorm", "post_ffw_norm"),
  ("self_attn.q_norm", "self_attention.query_norm"),
  ("self_attn.k_norm", "self_attention.key_norm"),
)

_TEXT = hf_families.llama_like(
  "gemma3_text", "Gemma3ForCausalLM", gelu=True, tied_by_default=True, norms=NORMS, read=read, write=write
)


def read_config(config_json: Mapping) -> dict:
  """Llama's keys and Gemma 3's (read) from config.json with Gemma3TextConfig's defaults filled in, the two RoPEs
  read here (llama_like reads one RoPE for all layers)."""
  hf = TEXT_DEFAULTS | dict(config_json)
  rope = read_rope(hf)
  return _TEXT.read_config({k: v for k, v in hf.items() if k not in ROPE_KEYS}) | rope


# Gemma3ForConditionalGeneration: the published checkpoints store the text model under language_model.model.* (tied,
# no lm_head); transformers 5 saves it under model.language_model.*, its head as lm_head.*.
TOWER = hf_families.TextTower(
  "gemma3",
  "Gemma3ForConditionalGeneration",
  renames=(
    ("model.", "language_model.model."),
    ("model.", "model.language_model."),
    ("lm_head.", "language_model.lm_head."),
  ),
  other_towers=("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector."),
)

FAMILY = Family(
  "gemma3",
  "MaxText.layers.gemma3:Gemma3DecoderLayer",
  dataclasses.replace(_TEXT, read_config=read_config, text_tower=TOWER),
  check=check,
  summary=(
    "Gemma 2's norms and `query_pre_attn_scalar` with QK-norm, five local (`sliding_window_size`) layers to one "
    "global, `local_rope_max_timescale` and `rope_linear_scaling_factor`"
  ),
  hf_examples={
    # 6 query heads over 2 KV heads (groups of 3); 7 layers with a window of 5 (layer 5 global, the rest local); the
    # local and global RoPE bases far apart, the global one scaled linearly by 4; query_pre_attn_scalar != head_dim.
    "gemma3": HFExample(
      SMALL
      | {"num_hidden_layers": 7, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 12, "sliding_window": 5}
      | {"rope_theta": 1e6, "rope_local_base_freq": 100.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
      | {"query_pre_attn_scalar": 20}
    ),
    # 5 query heads over 1 KV head (transformers wants hidden_size a multiple of the heads), untied, soft-capped
    # output logits, no RoPE scaling, 8 layers; unrolled layers.
    "gemma3_unrolled": HFExample(
      SMALL
      | {"hidden_size": 60, "num_hidden_layers": 8, "sliding_window": 5}
      | {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 16}
      | {"tie_word_embeddings": False, "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 12}
      | {"rope_theta": 5000.0, "rope_local_base_freq": 50.0},
      scan_layers=False,
    ),
  },
)
