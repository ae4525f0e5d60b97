"""Qwen3-MoE: Qwen 3's layer (QK-norm) with a mixture of experts in every layer (norm_topk_prob)."""

from collections.abc import Mapping

from MaxText.common_types import Config
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family, qwen3


def read(config_json: Mapping, keys: dict) -> dict:
  if config_json.get("decoder_sparse_step", 1) != 1 or config_json.get("mlp_only_layers"):
    raise hf_families.unsupported(
      "decoder_sparse_step != 1 or mlp_only_layers is not supported for qwen3_moe: every layer must be sparse"
    )
  return qwen3.read(config_json, keys) | {
    # The released config.json files say num_experts; transformers 5 saves it as num_local_experts.
    "num_experts": config_json.get("num_experts") or config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "base_moe_mlp_dim": config_json["moe_intermediate_size"],
    "norm_topk_prob": bool(config_json.get("norm_topk_prob", False)),
  }


def write(cfg: Config) -> dict:
  hf_families.softmax_router_only(cfg, "Qwen3-MoE")
  return qwen3.write(cfg) | {
    "num_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    "moe_intermediate_size": cfg.moe_mlp_dim,
    "norm_topk_prob": cfg.norm_topk_prob,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
  }


FAMILY = Family(
  "qwen3_moe",
  "MaxText.layers.qwen3_moe:Qwen3MoeDecoderLayer",
  hf_families.llama_like(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    norms=qwen3.NORMS,
    read=read,
    write=write,
    mlp=hf_families.experts_mlp("mlp", "gate_proj", "up_proj", "down_proj"),
  ),
  summary="Qwen 3's layer with a mixture of experts for the MLP (`norm_topk_prob`)",
  hf_examples={
    # QK-norm, 6 experts of 40, top-3 not renormalised (norm_topk_prob=false); unrolled layers.
    "qwen3_moe": HFExample(
      SMALL
      | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10, "num_experts": 6}
      | {"num_experts_per_tok": 3, "moe_intermediate_size": 40, "norm_topk_prob": False},
      scan_layers=False,
    ),
  },
  moe=True,
)
