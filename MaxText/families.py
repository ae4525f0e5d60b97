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
from MaxText.layers.deepseek import DeepSeekDenseLayer, DeepSeekMoeLayer
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
  # The layer of the first first_num_dense_layers layers (DeepSeek's dense ones); None: every layer is `layer`.
  dense_layer: type[nn.Module] | None = None
  mla: bool = False  # Its attention is multi-head latent attention (attention_type=mla).


@dataclasses.dataclass(frozen=True)
class Stack:
  """Consecutive decoder layers of one class. Their parameters are `name` (scanned: stacked on axis 0) or
  `{name}_{j}` for the stack's j-th layer (unrolled); MaxText's names: `layers`, or DeepSeek's `dense_layers`
  and `moe_layers`."""

  name: str
  layer: type[nn.Module]
  start: int  # the model's index of the stack's first layer
  count: int


def layer_stacks(config: Config) -> list[Stack]:
  """The decoder's layer stacks, in order: one `layers` stack, or `dense_layers` then `moe_layers` for a family
  with a dense_layer (empty stacks left out)."""
  family, n = get(config.decoder_block), config.num_decoder_layers
  if family.dense_layer is None:
    return [Stack("layers", family.layer, 0, n)]
  first = config.first_num_dense_layers
  stacks = [Stack("dense_layers", family.dense_layer, 0, first), Stack("moe_layers", family.layer, first, n - first)]
  return [stack for stack in stacks if stack.count]


def param_path(config: Config, path: str, layer: int | None) -> tuple[str, int | None]:
  """Where one of our parameters is: `path` of the model (layer None), or decoder layer `layer`'s parameter
  `path` (relative to the layer): its dotted path in the model's params, and the index into its axis 0 when the
  layers are scanned (None when unrolled, and for the model's own)."""
  if layer is None:
    return path, None
  for stack in layer_stacks(config):
    if stack.start <= layer < stack.start + stack.count:
      j = layer - stack.start
      return (f"{stack.name}.{path}", j) if config.scan_layers else (f"{stack.name}_{j}.{path}", None)
  raise IndexError(f"layer {layer} is not among the {config.num_decoder_layers} decoder layers")


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


# ------------------------------------------------------------------------------------- DeepSeek-V3
def _deepseek_check(values: Mapping[str, Any]) -> None:
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


def _deepseek_rope_read(config_json: Mapping) -> dict:
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


def _deepseek_read(config_json: Mapping) -> dict:
  if config_json.get("quantization_config"):
    method = config_json["quantization_config"].get("quant_method", "?")
    raise hf_families.unsupported(
      f"quantization_config ({method}) is not supported: the weights are quantized (DeepSeek-V3's release is fp8); "
      "dequantize them to bfloat16 first"
    )
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
  } | _deepseek_rope_read(config_json)


def _deepseek_write(cfg: Config) -> dict:
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


def _deepseek_layout(cfg: Config) -> hf_families.Layout:
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


def _deepseek_ignored(name: str, cfg: Config) -> bool:
  """DeepSeek-V3's checkpoints also hold its multi-token-prediction module as layers past num_hidden_layers
  (transformers ignores them too)."""
  if name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_decoder_layers:
    return True
  return hf_families.not_parameters(name, cfg)


DEEPSEEK_HF = hf_families.HFMapping(
  "deepseek_v3", "DeepseekV3ForCausalLM", _deepseek_read, _deepseek_write, _deepseek_layout, _deepseek_ignored
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
    # DeepSeek-V3 (and models of its architecture): MLA, first_num_dense_layers dense layers, then MoE layers.
    Family(
      "deepseek", DeepSeekMoeLayer, DEEPSEEK_HF, check=_deepseek_check, moe=True, dense_layer=DeepSeekDenseLayer, mla=True
    ),
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
