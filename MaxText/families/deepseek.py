"""DeepSeek-V3 (and models of its architecture): MLA, first_num_dense_layers dense layers, then MoE layers, and
Hugging Face's DeepseekV3 format (its own config.json keys and tensor names)."""

from collections.abc import Mapping
from typing import Any

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family


def check(values: Mapping[str, Any]) -> None:
  if values["qk_rope_head_dim"] % 2:
    raise ConfigError(
      f"qk_rope_head_dim={values['qk_rope_head_dim']} is odd; rotary embeddings rotate pairs, use an even one"
    )
  _positive = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
  for key in _positive:
    if values[key] <= 0:
      raise ConfigError(f"{key}={values[key]} must be positive for multi-head latent attention")
  if values["q_lora_rank"] < 0:
    raise ConfigError(f"q_lora_rank={values['q_lora_rank']} must be >= 0 (0: queries projected directly)")
  # What Attention honours and MLA does not have: refused rather than ignored.
  unused = {"sliding_window_size": 0, "attn_logits_soft_cap": 0.0, "query_pre_attn_scalar": 0.0, "fused_qkv": False}
  unused["rope_attention_scaling"] = False  # MLA puts YaRN's temperature on the softmax scale instead
  for key, off in unused.items():
    if values[key] != off:
      raise ConfigError(
        f"{key}={values[key]} has no effect with attention_type=mla (decoder_block=deepseek); set it to {off}"
      )


def read_rope(config_json: Mapping) -> dict:
  """RoPE keys of a DeepSeek config.json: its YaRN puts mscale_all_dim's temperature squared on the softmax scale
  (attention_mla.softmax_scale) and, with mscale == mscale_all_dim, leaves the rotated queries and keys unscaled."""
  params = config_json.get("rope_parameters") or config_json.get("rope_scaling") or {}
  kind = params.get("rope_type", params.get("type", "default"))
  theta = config_json.get("rope_theta") or params.get("rope_theta") or 10000.0
  max_positions = int(config_json.get("max_position_embeddings") or 4096)
  keys = {
    "rope_max_timescale": float(theta),
    "rope_interleave": bool(config_json.get("rope_interleave", True)),
    "max_position_embeddings": max_positions,
  }
  if kind == "default":
    return keys
  if kind != "yarn":
    raise hf_families.unsupported(f"rope type {kind!r} is not supported for deepseek; supported: default and yarn")
  original = int(params.get("original_max_position_embeddings") or 4096)
  mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
  if params.get("attention_factor") is not None or not all_dim or mscale != all_dim or max_positions <= original:
    raise hf_families.unsupported(
      f"yarn with mscale={mscale}, mscale_all_dim={all_dim}, attention_factor={params.get('attention_factor')} and "
      f"max_position_embeddings={max_positions} is not supported for deepseek: it needs mscale == mscale_all_dim "
      "(nonzero), no attention_factor and max_position_embeddings > original_max_position_embeddings (DeepSeek-V3's)"
    )
  return keys | {
    "rope_type": "yarn",
    "rope_factor": float(params["factor"]),
    "original_max_position_embeddings": original,
    "beta_fast": float(params.get("beta_fast") or 32.0),
    "beta_slow": float(params.get("beta_slow") or 1.0),
    "mscale": float(all_dim),
    "rope_truncate": bool(params.get("truncate", True)),
    "rope_attention_scaling": False,
  }


def read(config_json: Mapping) -> dict:
  if config_json.get("attention_bias"):
    raise hf_families.unsupported("attention_bias=true is not supported for deepseek")
  if config_json.get("hidden_act", "silu") != "silu" or config_json.get("topk_method", "noaux_tc") != "noaux_tc":
    raise hf_families.unsupported("deepseek needs hidden_act=silu and topk_method=noaux_tc (DeepSeek-V3's routing)")
  if config_json.get("scoring_func", "sigmoid") != "sigmoid" or config_json.get("moe_layer_freq", 1) != 1:
    raise hf_families.unsupported("deepseek needs scoring_func=sigmoid and moe_layer_freq=1 (DeepSeek-V3's)")
  heads = config_json["num_attention_heads"]
  return {
    "base_emb_dim": config_json["hidden_size"],
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,  # MLA's keys and values have every head
    "base_mlp_dim": config_json["intermediate_size"],
    "base_moe_mlp_dim": config_json["moe_intermediate_size"],
    "base_num_decoder_layers": config_json["num_hidden_layers"],
    "first_num_dense_layers": config_json.get("first_k_dense_replace", 3),
    "vocab_size": config_json["vocab_size"],
    "mlp_activations": ["silu", "linear"],
    "normalization_layer_epsilon": float(config_json.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(config_json.get("tie_word_embeddings", False)),
    "num_experts": config_json.get("n_routed_experts") or config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "shared_experts": config_json.get("n_shared_experts") or 0,
    "routed_scaling_factor": float(config_json.get("routed_scaling_factor", 1.0)),
    "routed_score_func": "sigmoid",
    "routed_bias": True,
    "n_routing_groups": config_json.get("n_group") or 1,
    "topk_routing_group": config_json.get("topk_group") or 1,
    "norm_topk_prob": bool(config_json.get("norm_topk_prob", True)),
    "attention_type": "mla",
    "q_lora_rank": config_json.get("q_lora_rank") or 0,
    "kv_lora_rank": config_json["kv_lora_rank"],
    "qk_nope_head_dim": config_json["qk_nope_head_dim"],
    "qk_rope_head_dim": config_json["qk_rope_head_dim"],
    "v_head_dim": config_json["v_head_dim"],
  } | read_rope(config_json)


def write(cfg: Config) -> dict:
  if cfg.routed_score_func != "sigmoid" or not cfg.routed_bias or cfg.shared_experts < 1:
    raise ConfigError(
      "DeepSeek-V3's Hugging Face format has sigmoid routing with a bias and shared experts: needs "
      "routed_score_func=sigmoid, routed_bias=true and shared_experts >= 1"
    )
  if list(cfg.mlp_activations) != ["silu", "linear"]:
    raise ConfigError(f"mlp_activations={list(cfg.mlp_activations)}: DeepSeek-V3's format is SwiGLU, ['silu','linear']")
  if cfg.rope_type not in ("default", "yarn") or (cfg.rope_type == "yarn" and cfg.rope_attention_scaling):
    raise ConfigError(
      f"rope_type={cfg.rope_type} (rope_attention_scaling={cfg.rope_attention_scaling}) has no DeepSeek-V3 form"
    )
  rope = None
  if cfg.rope_type == "yarn":
    rope = hf_families.yarn_scaling(cfg) | {"mscale_all_dim": cfg.mscale}  # the softmax's temperature (MLA)
    if cfg.max_position_embeddings <= cfg.original_max_position_embeddings:
      raise ConfigError(
        f"max_position_embeddings={cfg.max_position_embeddings} <= original_max_position_embeddings: our MLA then "
        "leaves the softmax unscaled, which DeepSeek-V3's format cannot say; raise max_position_embeddings"
      )
  groups = max(cfg.n_routing_groups, 1)
  return {
    "hidden_size": cfg.emb_dim,
    "intermediate_size": cfg.mlp_dim,
    "moe_intermediate_size": cfg.moe_mlp_dim,
    "num_hidden_layers": cfg.num_decoder_layers,
    "num_attention_heads": cfg.num_query_heads,
    "num_key_value_heads": cfg.num_query_heads,
    "first_k_dense_replace": cfg.first_num_dense_layers,
    "n_routed_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    "n_shared_experts": cfg.shared_experts,
    "routed_scaling_factor": cfg.routed_scaling_factor,
    "n_group": groups,
    "topk_group": cfg.topk_routing_group if cfg.n_routing_groups > 0 else groups,
    "norm_topk_prob": cfg.norm_topk_prob,
    "q_lora_rank": cfg.q_lora_rank or None,
    "kv_lora_rank": cfg.kv_lora_rank,
    "qk_nope_head_dim": cfg.qk_nope_head_dim,
    "qk_rope_head_dim": cfg.qk_rope_head_dim,
    "v_head_dim": cfg.v_head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.normalization_layer_epsilon,
    "tie_word_embeddings": cfg.logits_via_embedding,
    "max_position_embeddings": cfg.max_position_embeddings,
    "rope_theta": cfg.rope_max_timescale,
    "rope_scaling": rope,
    "rope_interleave": cfg.rope_interleave,
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
  }


def layout(cfg: Config) -> hf_families.Layout:
  heads, nope, rope, v_dim = cfg.num_query_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  same, linear = hf_families.same, hf_families.linear
  model = [same("model.embed_tokens.weight", "token_embedder.embedding"), same("model.norm.weight", "decoder_norm.scale")]
  if not cfg.logits_via_embedding:
    model.append(linear("lm_head.weight", "logits_dense.kernel", (cfg.vocab_size,)))
  p = "model.layers.{i}."
  a = p + "self_attn."
  if cfg.q_lora_rank == 0:
    query = [linear(a + "q_proj.weight", "self_attention.query.kernel", (heads, nope + rope))]
  else:
    query = [
      linear(a + "q_a_proj.weight", "self_attention.wq_a.kernel", (cfg.q_lora_rank,)),
      same(a + "q_a_layernorm.weight", "self_attention.q_norm.scale"),
      linear(a + "q_b_proj.weight", "self_attention.wq_b.kernel", (heads, nope + rope)),
    ]
  common = [
    same(p + "input_layernorm.weight", "pre_self_attention_layer_norm.scale"),
    *query,
    linear(a + "kv_a_proj_with_mqa.weight", "self_attention.wkv_a.kernel", (cfg.kv_lora_rank + rope,)),
    same(a + "kv_a_layernorm.weight", "self_attention.kv_norm.scale"),
    linear(a + "kv_b_proj.weight", "self_attention.wkv_b.kernel", (heads, nope + v_dim)),
    hf_families.linear_in(a + "o_proj.weight", "self_attention.out.kernel", (heads, v_dim)),
    same(p + "post_attention_layernorm.weight", "post_self_attention_layer_norm.scale"),
  ]
  dense = common + hf_families.dense_mlp(cfg, p)
  shared = cfg.shared_experts * cfg.moe_mlp_dim
  moe = common + [
    *hf_families.experts_mlp("mlp", "gate_proj", "up_proj", "down_proj")(cfg, p),
    same(p + "mlp.gate.e_score_correction_bias", "mlp.gate_bias"),
    linear(p + "mlp.shared_experts.gate_proj.weight", "mlp.shared.wi_0.kernel", (shared,)),
    linear(p + "mlp.shared_experts.up_proj.weight", "mlp.shared.wi_1.kernel", (shared,)),
    hf_families.linear_in(p + "mlp.shared_experts.down_proj.weight", "mlp.shared.wo.kernel", (shared,)),
  ]
  return model, lambda i: dense if i < cfg.first_num_dense_layers else moe


def ignored(name: str, cfg: Config) -> bool:
  """DeepSeek-V3's checkpoints also hold its multi-token-prediction module as layers past num_hidden_layers
  (transformers ignores them too)."""
  if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_decoder_layers:
    return True
  return hf_families.not_parameters(name, cfg)


# MLA over 1 dense then 2 MoE layers: 8 experts in 4 groups, top-2 from the best 2 groups, a shared expert.
_EXAMPLE = SMALL | {"num_attention_heads": 3, "num_key_value_heads": 3, "moe_intermediate_size": 24}
_EXAMPLE |= {"first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2}
_EXAMPLE |= {"n_shared_experts": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "qk_nope_head_dim": 10}
_EXAMPLE |= {"qk_rope_head_dim": 6, "v_head_dim": 14}
_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5000.0}
_YARN |= {"mscale": 0.8, "mscale_all_dim": 0.8, "beta_fast": 8.0, "beta_slow": 2.0}

FAMILY = Family(
  "deepseek",
  "MaxText.layers.deepseek:DeepSeekMoeLayer",
  hf_families.HFMapping("deepseek_v3", "DeepseekV3ForCausalLM", read, write, layout, ignored),
  check=check,
  summary=(
    "multi-head latent attention (`attention_type=mla`), `first_num_dense_layers` dense layers then MoE layers "
    "with DeepSeek-V3's routing"
  ),
  hf_examples={
    # Compressed queries, interleaved RoPE, YaRN 4x over 16 positions with its softmax temperature (mscale 0.8).
    "deepseek": HFExample(_EXAMPLE | {"q_lora_rank": 24, "rope_interleave": True, "rope_parameters": _YARN}),
    # Queries projected directly, rotate-half RoPE without scaling; unrolled layers.
    "deepseek_plain": HFExample(
      _EXAMPLE
      | {"q_lora_rank": None, "rope_interleave": False, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}},
      scan_layers=False,
    ),
  },
  attention_type="mla",
  moe=True,
  dense_layers=True,
)
