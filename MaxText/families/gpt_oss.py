"""gpt-oss: biased attention projections with a learned sink per head, local (even) and global (odd) layers, YaRN,
and in every layer a mixture of experts with a router bias, expert biases and the clamped SwiGLU; Hugging Face's
GptOss format, whose published checkpoints store the experts' weights in MXFP4 (dequantized exactly on import,
convert/mxfp4.py) and whose bfloat16 ones are read as they are."""

import dataclasses
from collections.abc import Mapping

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample, bias, interleaved, linear, same
from MaxText.families import Family
from MaxText.sections.layers import CLAMPED_SWIGLU, SWIGLU_ALPHA

QUANTIZATIONS = ("mxfp4",)  # config.json's quantization_config.quant_method values the importer dequantizes


def layer_types(num_layers: int) -> list[str]:
  """Even layers attend locally (sliding window), odd ones globally (GptOssDecoderLayer.sliding_window)."""
  return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def read(config_json: Mapping, keys: dict) -> dict:
  alpha = config_json.get("swiglu_alpha", SWIGLU_ALPHA)
  if alpha != SWIGLU_ALPHA:
    raise hf_families.unsupported(f"swiglu_alpha={alpha} is not supported; gpt-oss's clamped SwiGLU has {SWIGLU_ALPHA}")
  limit = config_json.get("swiglu_limit", 7.0)
  if not isinstance(limit, int | float) or limit <= 0:
    raise hf_families.unsupported(f"swiglu_limit={limit} is not supported; the clamped SwiGLU needs a positive limit")
  hf_families.check_layer_types(config_json, layer_types(keys["base_num_decoder_layers"]), "gpt_oss")
  return {
    "sliding_window_size": config_json.get("sliding_window") or 0,
    "num_experts": config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "base_moe_mlp_dim": config_json["intermediate_size"],
    "mlp_activations": list(CLAMPED_SWIGLU),
    "mlp_activations_limit": float(limit),
    "routed_bias": True,
  }


def write(cfg: Config) -> dict:
  hf_families.softmax_router_only(cfg, "gpt-oss")
  if not cfg.routed_bias or tuple(cfg.mlp_activations) != CLAMPED_SWIGLU or cfg.mlp_activations_limit <= 0:
    raise ConfigError(
      "gpt-oss's Hugging Face format has a router bias and the clamped SwiGLU: needs routed_bias=true, "
      f"mlp_activations={list(CLAMPED_SWIGLU)} and mlp_activations_limit > 0"
    )
  keys = {
    "num_local_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    "intermediate_size": cfg.moe_mlp_dim,  # the experts' (gpt-oss has no dense MLP)
    "swiglu_limit": cfg.mlp_activations_limit,
    "sliding_window": cfg.sliding_window_size or None,
    "layer_types": layer_types(cfg.num_decoder_layers),
    "attention_bias": True,
  }
  if cfg.rope_type == "yarn":  # the context YaRN extends to, as the published config.json says (131072)
    keys["max_position_embeddings"] = int(cfg.original_max_position_embeddings * cfg.rope_factor)
  return keys


def experts(cfg: Config, p: str) -> list[hf_families.Group]:
  """The router (weight and bias) and the experts, stored fused: gate_up_proj [experts, embed, 2 * moe_mlp] with the
  gate and up columns alternating, and its bias; down_proj [experts, moe_mlp, embed] (our wo's layout) and its bias."""
  n, e = cfg.num_experts, p + "mlp.experts."
  return [
    linear(p + "mlp.router.weight", "mlp.gate.kernel", (n,)),
    bias(p + "mlp.router.bias", "mlp.gate.bias", (n,)),
    interleaved(e + "gate_up_proj", ("mlp.wi_0", "mlp.wi_1")),
    interleaved(e + "gate_up_proj_bias", ("mlp.wi_0_bias", "mlp.wi_1_bias")),
    same(e + "down_proj", "mlp.wo"),
    same(e + "down_proj_bias", "mlp.wo_bias"),
  ]


LLAMA_LIKE = hf_families.llama_like("gpt_oss", "GptOssForCausalLM", read=read, write=write, mlp=experts, qkv_bias=True)


def read_config(config_json: Mapping) -> dict:
  """Llama's keys and the above; config.json's attention_bias (true: biases on q, k, v and o) is the layer's."""
  if not config_json.get("attention_bias", True):
    raise hf_families.unsupported("attention_bias=false is not supported for gpt_oss: its attention projections have biases")
  return LLAMA_LIKE.read_config({k: v for k, v in config_json.items() if k != "attention_bias"})


def layout(cfg: Config) -> hf_families.Layout:
  """Llama's tensors with the query, key and value biases, the experts, the output projection's bias and the sinks."""
  model, layer = LLAMA_LIKE.layout(cfg)
  p = "model.layers.{i}."
  extra = [bias(p + "self_attn.o_proj.bias", "self_attention.out.bias", (cfg.emb_dim,))]
  return model, [*layer, *extra, same(p + "self_attn.sinks", "self_attention.sinks")]


# YaRN extending 64 positions 4 times (the second example's).
YARN_64 = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}

FAMILY = Family(
  "gpt_oss",
  "MaxText.layers.gpt_oss:GptOssDecoderLayer",
  dataclasses.replace(LLAMA_LIKE, read_config=read_config, layout=layout, quantizations=QUANTIZATIONS),
  summary=(
    "biases on every attention projection, attention sinks, local (even) and global (odd) layers, a mixture of "
    "experts with router and expert biases and the clamped SwiGLU (`mlp_activations_limit`); MXFP4 import"
  ),
  hf_examples={
    # 6 query heads over 2 KV heads (groups of 3), window 5, 4 experts top-2 (40 wide), a SwiGLU limit of 1 that
    # clamps some of the random model's activations; YaRN as published (factor 32, unrounded ramp); scanned layers.
    "gpt_oss": HFExample(
      SMALL
      | {"intermediate_size": 40, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}
      | {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5, "swiglu_limit": 1.0}
    ),
    # 5 query heads over 1 KV head, window 3, 6 experts top-3, the published limit 7; YaRN from 64 positions with a
    # rounded ramp (truncate); unrolled layers, saved in shards.
    "gpt_oss_mqa": HFExample(
      SMALL
      | {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12, "sliding_window": 3}
      | {"num_local_experts": 6, "num_experts_per_tok": 3}
      | {"rope_parameters": {**YARN_64, "truncate": True}},
      scan_layers=False,
      max_shard_size="100KB",
    ),
  },
  moe=True,
  clamped_swiglu=True,
  router_logit_bias=True,
  attention_sinks=True,
)
