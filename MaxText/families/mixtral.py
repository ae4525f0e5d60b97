"""Mixtral: Mistral's layer with a mixture of experts (top-k renormalised) for the MLP."""

from collections.abc import Mapping

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, HFExample
from MaxText.families import Family, mistral


def read(config_json: Mapping, keys: dict) -> dict:
  if config_json.get("router_jitter_noise"):
    raise hf_families.unsupported(f"router_jitter_noise={config_json['router_jitter_noise']} is not supported; set it to 0")
  return mistral.read(config_json, keys) | {
    "num_experts": config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "base_moe_mlp_dim": config_json["intermediate_size"],
  }


def write(cfg: Config) -> dict:
  hf_families.softmax_router_only(cfg, "Mixtral")
  if cfg.moe_mlp_dim != cfg.mlp_dim:
    raise ConfigError(
      f"Mixtral's Hugging Face format has one intermediate_size: needs moe_mlp_dim == mlp_dim (now {cfg.moe_mlp_dim} "
      f"and {cfg.mlp_dim})"
    )
  return mistral.write(cfg) | {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok}


FAMILY = Family(
  "mixtral",
  "MaxText.layers.mixtral:MixtralDecoderLayer",
  hf_families.llama_like(
    "mixtral",
    "MixtralForCausalLM",
    read=read,
    write=write,
    mlp=hf_families.experts_mlp("block_sparse_moe", "w1", "w3", "w2"),
  ),
  summary="Mistral's layer with a mixture of experts for the MLP (top-k renormalised)",
  hf_examples={
    # 4 experts, top-2 (renormalised), sliding window 5.
    "mixtral": HFExample(
      SMALL
      | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12}
      | {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}
    ),
  },
  moe=True,
)
