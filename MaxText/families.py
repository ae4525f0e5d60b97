"""Model families: one registered `Family` per `decoder_block` value, owning all that is particular to it.

A family owns its decoder layer class (layers/), its config checks and derived keys (pyconfig runs them), and
its Hugging Face mapping (convert/hf_families.py: config.json keys both ways, architecture, tensor layout). The
valid `decoder_block` values are the names in FAMILIES, and nowhere else.

Adding a family: a decoder layer in layers/ (a subclass of LlamaDecoderLayer that changes its hooks, or none
if Llama's own will do), one `Family(...)` entry in FAMILIES below, and presets in configs/models/.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from flax import linen as nn

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.layers.gemma import GemmaDecoderLayer
from MaxText.layers.gemma2 import Gemma2DecoderLayer
from MaxText.layers.gpt3 import Gpt3DecoderLayer
from MaxText.layers.llama import LlamaDecoderLayer
from MaxText.layers.mistral import MistralDecoderLayer
from MaxText.layers.mixtral import MixtralDecoderLayer
from MaxText.layers.qwen3 import Qwen3DecoderLayer
from MaxText.layers.qwen3_moe import Qwen3MoeDecoderLayer


def no_checks(values: Mapping[str, Any]) -> None:
  del values


def no_derived_keys(values: Mapping[str, Any]) -> dict:
  del values
  return {}


def rope_rotates_pairs(values: Mapping[str, Any]) -> None:
  if values["head_dim"] % 2:
    raise ConfigError(f"head_dim={values['head_dim']} is odd; rotary embeddings rotate pairs, use an even head_dim")


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its layer, its config checks and derived keys, its Hugging Face mapping."""

  name: str  # the decoder_block value
  layer: type[nn.Module]  # the decoder layer: x [batch, length, embed] -> (x, kv); see layers/llama.py
  hf: hf_families.HFMapping | None = None  # the Hugging Face mapping; None: no import or export
  # Raises ConfigError for typed config values (pyconfig.parse's) this family cannot run; the default suits a
  # family with rotary embeddings.
  check: Callable[[Mapping[str, Any]], None] = rope_rotates_pairs
  # Keys this family adds to the Config, from the values pyconfig.derive has computed (emb_dim, mesh, ...).
  derive: Callable[[Mapping[str, Any]], dict] = no_derived_keys
  moe: bool = False  # Its MLP is a mixture of experts (layers/moe.py): num_experts >= 2.


# ------------------------------------------------------------------------------------- Mistral
def _mistral_read(config_json: Mapping, keys: dict) -> dict:
  del keys
  return {"sliding_window_size": config_json.get("sliding_window") or 0}


def _mistral_write(cfg: Config) -> dict:
  return {"sliding_window": cfg.sliding_window_size or None}


MISTRAL_HF = hf_families.llama_like("mistral", "MistralForCausalLM", read=_mistral_read, write=_mistral_write)


# ------------------------------------------------------------------------------------- Mixtral
def _mixtral_read(config_json: Mapping, keys: dict) -> dict:
  if config_json.get("router_jitter_noise"):
    raise hf_families.unsupported(f"router_jitter_noise={config_json['router_jitter_noise']} is not supported; set it to 0")
  return _mistral_read(config_json, keys) | {
    "num_experts": config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "base_moe_mlp_dim": config_json["intermediate_size"],
  }


def _softmax_router_only(cfg: Config, family: str) -> None:
  """Mixtral's and Qwen3-MoE's formats hold a softmax router with plain top-k weights and nothing more."""
  if cfg.shared_experts or cfg.routed_scaling_factor != 1.0 or cfg.routed_score_func == "sigmoid":
    raise ConfigError(
      f"{family}'s Hugging Face format has a softmax router and no shared experts: needs shared_experts=0, "
      "routed_scaling_factor=1 and routed_score_func='' (softmax)"
    )


def _mixtral_write(cfg: Config) -> dict:
  _softmax_router_only(cfg, "Mixtral")
  if cfg.moe_mlp_dim != cfg.mlp_dim:
    raise ConfigError(
      f"Mixtral's Hugging Face format has one intermediate_size: needs moe_mlp_dim == mlp_dim (now {cfg.moe_mlp_dim} "
      f"and {cfg.mlp_dim})"
    )
  return _mistral_write(cfg) | {"num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok}


MIXTRAL_HF = hf_families.llama_like(
  "mixtral",
  "MixtralForCausalLM",
  read=_mixtral_read,
  write=_mixtral_write,
  mlp=hf_families.experts_mlp("block_sparse_moe", "w1", "w3", "w2"),
)

# ------------------------------------------------------------------------------------- Gemma
GEMMA_HF = hf_families.llama_like("gemma", "GemmaForCausalLM", gelu=True, tied_by_default=True)


# ------------------------------------------------------------------------------------- Qwen 3
def _qwen3_read(config_json: Mapping, keys: dict) -> dict:
  if config_json.get("use_sliding_window"):
    raise hf_families.unsupported("use_sliding_window=true is not supported for qwen3")
  hf_families.check_layer_types(config_json, ["full_attention"] * keys["base_num_decoder_layers"], "qwen3")
  return {}


def _qwen3_write(cfg: Config) -> dict:
  return {"use_sliding_window": False, "layer_types": ["full_attention"] * cfg.num_decoder_layers}


QWEN3_NORMS = hf_families.LLAMA_NORMS + (
  ("self_attn.q_norm", "self_attention.query_norm"),
  ("self_attn.k_norm", "self_attention.key_norm"),
)
QWEN3_HF = hf_families.llama_like("qwen3", "Qwen3ForCausalLM", norms=QWEN3_NORMS, read=_qwen3_read, write=_qwen3_write)


# ------------------------------------------------------------------------------------- Qwen3-MoE
def _qwen3_moe_read(config_json: Mapping, keys: dict) -> dict:
  if config_json.get("decoder_sparse_step", 1) != 1 or config_json.get("mlp_only_layers"):
    raise hf_families.unsupported(
      "decoder_sparse_step != 1 or mlp_only_layers is not supported for qwen3_moe: every layer must be sparse"
    )
  return _qwen3_read(config_json, keys) | {
    # The released config.json files say num_experts; transformers 5 saves it as num_local_experts.
    "num_experts": config_json.get("num_experts") or config_json["num_local_experts"],
    "num_experts_per_tok": config_json["num_experts_per_tok"],
    "base_moe_mlp_dim": config_json["moe_intermediate_size"],
    "norm_topk_prob": bool(config_json.get("norm_topk_prob", False)),
  }


def _qwen3_moe_write(cfg: Config) -> dict:
  _softmax_router_only(cfg, "Qwen3-MoE")
  return _qwen3_write(cfg) | {
    "num_experts": cfg.num_experts,
    "num_experts_per_tok": cfg.num_experts_per_tok,
    "moe_intermediate_size": cfg.moe_mlp_dim,
    "norm_topk_prob": cfg.norm_topk_prob,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
  }


QWEN3_MOE_HF = hf_families.llama_like(
  "qwen3_moe",
  "Qwen3MoeForCausalLM",
  norms=QWEN3_NORMS,
  read=_qwen3_moe_read,
  write=_qwen3_moe_write,
  mlp=hf_families.experts_mlp("mlp", "gate_proj", "up_proj", "down_proj"),
)


# ------------------------------------------------------------------------------------- Gemma 2
def _gemma2_layer_types(num_layers: int) -> list[str]:
  """Even layers attend locally (sliding window), odd ones globally (Gemma2DecoderLayer.sliding_window)."""
  return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _gemma2_read(config_json: Mapping, keys: dict) -> dict:
  hf_families.check_layer_types(config_json, _gemma2_layer_types(keys["base_num_decoder_layers"]), "gemma2")
  return {
    "sliding_window_size": config_json.get("sliding_window") or 0,
    "attn_logits_soft_cap": float(config_json.get("attn_logit_softcapping") or 0.0),
    "final_logits_soft_cap": float(config_json.get("final_logit_softcapping") or 0.0),
    "query_pre_attn_scalar": float(config_json.get("query_pre_attn_scalar") or keys["head_dim"]),
  }


def _gemma2_write(cfg: Config) -> dict:
  return {
    "sliding_window": cfg.sliding_window_size or None,
    "layer_types": _gemma2_layer_types(cfg.num_decoder_layers),
    "attn_logit_softcapping": cfg.attn_logits_soft_cap or None,
    "final_logit_softcapping": cfg.final_logits_soft_cap or None,
    "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
  }


GEMMA2_NORMS = (
  ("input_layernorm", "pre_self_attention_layer_norm"),
  ("post_attention_layernorm", "post_self_attention_norm"),
  ("pre_feedforward_layernorm", "pre_ffw_norm"),
  ("post_feedforward_layernorm", "post_ffw_norm"),
)
GEMMA2_HF = hf_families.llama_like(
  "gemma2", "Gemma2ForCausalLM", gelu=True, tied_by_default=True, norms=GEMMA2_NORMS, read=_gemma2_read, write=_gemma2_write
)


# ------------------------------------------------------------------------------------- GPT-3 (GPT-2's format)
def _gpt2_read(config_json: Mapping) -> dict:
  emb, heads = config_json["n_embd"], config_json["n_head"]
  if emb % heads:
    raise hf_families.unsupported(f"n_embd={emb} is not a multiple of n_head={heads}")
  act = config_json.get("activation_function", "gelu_new")
  if act not in hf_families.TANH_GELUS:
    raise hf_families.unsupported(f"activation_function={act!r} is not supported; only the tanh GELU (gelu_new)")
  if not config_json.get("scale_attn_weights", True) or config_json.get("scale_attn_by_inverse_layer_idx"):
    raise hf_families.unsupported("scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true is not supported")
  if config_json.get("tie_word_embeddings") is False:
    raise hf_families.unsupported("tie_word_embeddings=false is not supported for gpt2")
  return {
    "base_emb_dim": emb,
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,
    "base_mlp_dim": config_json.get("n_inner") or 4 * emb,
    "base_num_decoder_layers": config_json["n_layer"],
    "head_dim": emb // heads,
    "vocab_size": config_json["vocab_size"],
    "mlp_activations": ["gelu"],
    "normalization_layer_epsilon": float(config_json.get("layer_norm_epsilon", 1e-5)),
    "logits_via_embedding": True,
    "trainable_position_size": config_json["n_positions"],
  }


def _gpt2_write(cfg: Config) -> dict:
  return {
    "n_embd": cfg.emb_dim,
    "n_head": cfg.num_query_heads,
    "n_layer": cfg.num_decoder_layers,
    "n_inner": cfg.mlp_dim,
    "n_positions": cfg.trainable_position_size,
    "layer_norm_epsilon": cfg.normalization_layer_epsilon,
    "activation_function": "gelu_new",
    "tie_word_embeddings": True,
  }


def _gpt2_layout(cfg: Config) -> hf_families.Layout:
  heads, hd = cfg.num_query_heads, cfg.head_dim
  model = [
    hf_families.same("transformer.wte.weight", "token_embedder.embedding"),
    hf_families.same("transformer.wpe.weight", "position_embedder.embedding"),
    hf_families.same("transformer.ln_f.weight", "decoder_norm.scale"),
    hf_families.same("transformer.ln_f.bias", "decoder_norm.bias"),
  ]
  p = "transformer.h.{i}."
  qkv = ("self_attention.query", "self_attention.key", "self_attention.value")
  layer = [
    hf_families.same(p + "ln_1.weight", "pre_self_attention_layer_norm.scale"),
    hf_families.same(p + "ln_1.bias", "pre_self_attention_layer_norm.bias"),
    hf_families.fused_qkv(p + "attn.c_attn.weight", tuple(f"{n}.kernel" for n in qkv), heads, hd),
    hf_families.fused_qkv(p + "attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), heads, hd),
    hf_families.conv1d_in(p + "attn.c_proj.weight", "self_attention.out.kernel", (heads, hd)),
    hf_families.same(p + "attn.c_proj.bias", "self_attention.out.bias"),
    hf_families.same(p + "ln_2.weight", "post_self_attention_layer_norm.scale"),
    hf_families.same(p + "ln_2.bias", "post_self_attention_layer_norm.bias"),
    hf_families.same(p + "mlp.c_fc.weight", "mlp.wi_0.kernel"),
    hf_families.same(p + "mlp.c_fc.bias", "mlp.wi_0.bias"),
    hf_families.same(p + "mlp.c_proj.weight", "mlp.wo.kernel"),
    hf_families.same(p + "mlp.c_proj.bias", "mlp.wo.bias"),
  ]
  return model, layer


def _gpt2_ignored(name: str, cfg: Config) -> bool:
  """GPT-2 checkpoints also carry the attention's causal-mask buffers (`attn.bias`, `attn.masked_bias`)."""
  causal_mask = name.endswith(".attn.bias") and ".c_attn." not in name
  return causal_mask or name.endswith("attn.masked_bias") or hf_families.not_parameters(name, cfg)


GPT2_HF = hf_families.HFMapping("gpt2", "GPT2LMHeadModel", _gpt2_read, _gpt2_write, _gpt2_layout, _gpt2_ignored)


# ------------------------------------------------------------------------------------- the registry
FAMILIES: dict[str, Family] = {
  family.name: family
  for family in (
    # Llama 2 and 3 (and 3.1 with rope_type=llama3.1).
    Family("llama2", LlamaDecoderLayer, hf_families.llama_like("llama", "LlamaForCausalLM")),
    Family("mistral", MistralDecoderLayer, MISTRAL_HF),
    Family("mixtral", MixtralDecoderLayer, MIXTRAL_HF, moe=True),
    Family("gemma", GemmaDecoderLayer, GEMMA_HF),
    Family("gemma2", Gemma2DecoderLayer, GEMMA2_HF),
    Family("qwen3", Qwen3DecoderLayer, QWEN3_HF),
    Family("qwen3_moe", Qwen3MoeDecoderLayer, QWEN3_MOE_HF, moe=True),
    Family("gpt3", Gpt3DecoderLayer, GPT2_HF, check=no_checks),  # No RoPE: learned positions (trainable_position_size).
  )
}


def get(decoder_block: str) -> Family:
  try:
    return FAMILIES[decoder_block]
  except KeyError:
    raise ConfigError(
      f"decoder_block={decoder_block!r} is not supported; choose one of {', '.join(map(repr, FAMILIES))}"
    ) from None


def for_hf_config(config_json: Mapping) -> Family:
  """The family whose Hugging Face model_type a config.json names; ConfigError if none has it."""
  model_type = config_json.get("model_type")
  with_hf = [f for f in FAMILIES.values() if f.hf is not None]
  for family in with_hf:
    if family.hf.model_type == model_type:
      return family
  supported = ", ".join(f.hf.model_type for f in with_hf)
  raise hf_families.unsupported(f"model_type={model_type!r} is not supported; supported: {supported}")


def model_keys_from_hf(config_json: Mapping) -> dict:
  """Our model keys (decoder_block included) from a Hugging Face config.json; ConfigError if unsupported."""
  family = for_hf_config(config_json)
  return hf_families.model_keys(family.hf, family.name, config_json)


def hf_mapping(config: Config) -> hf_families.HFMapping:
  """The Hugging Face mapping of the config's family; ConfigError if it has none."""
  family = get(config.decoder_block)
  if family.hf is None:
    raise ConfigError(f"decoder_block={config.decoder_block} has no Hugging Face mapping; it cannot be exported")
  return family.hf
