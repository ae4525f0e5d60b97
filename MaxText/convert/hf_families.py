"""Hugging Face <-> MaxText for each model family: the config.json keys and the tensor layout.

`model_keys(hf_config)` reads a `config.json` (as transformers 4.x or 5.x writes it) into our model keys;
`hf_config(config, dtype)` writes one back. `layout(config)` lists, for the whole model and for one decoder
layer, which Hugging Face tensors make which of our parameters: a `Group` of HF names and our paths, with
the two pure functions between them. The functions only transpose, reshape, slice and concatenate, so a
round trip gives back the same bits.

Hugging Face stores a linear layer as W [out, in] (y = x W^T); we store kernels [in, *out] with heads split
out (query [embed, heads, head_dim], out [heads, head_dim, embed]). GPT-2 stores Conv1D weights [in, out]
and fuses query, key and value into one c_attn. Both use RoPE's "rotate half" pairing, as we do, so no
permutation of the query and key rows is needed.
"""

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from MaxText.pyconfig import Config, ConfigError

# model_type in config.json -> our decoder_block.
FAMILIES = {"llama": "llama2", "mistral": "mistral", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gpt2": "gpt3"}
ARCHITECTURES = {
  "llama2": "LlamaForCausalLM",
  "mistral": "MistralForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
  "gemma": "GemmaForCausalLM",
  "gemma2": "Gemma2ForCausalLM",
  "gpt3": "GPT2LMHeadModel",
}
MODEL_TYPES = {block: model_type for model_type, block in FAMILIES.items()}
# GELU with the tanh approximation under its Hugging Face names (our "gelu" is jax.nn.gelu, approximate=True).
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def _unsupported(what: str) -> ConfigError:
  return ConfigError(f"config.json: {what}")


def _rope(hf: Mapping) -> dict:
  """RoPE keys from rope_theta + rope_scaling (transformers 4.x) or rope_parameters (5.x)."""
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  if "full_attention" in params:  # 5.x may key the parameters by layer type
    params = params["full_attention"]
  theta = hf.get("rope_theta") or params.get("rope_theta") or 10000.0
  kind = params.get("rope_type", params.get("type", "default"))
  keys = {"rope_max_timescale": float(theta)}
  if kind == "llama3":
    return keys | {
      "rope_type": "llama3.1",
      "rope_scaling_factor": float(params["factor"]),
      "rope_low_freq_factor": float(params["low_freq_factor"]),
      "rope_high_freq_factor": float(params["high_freq_factor"]),
      "rope_original_max_position": int(params["original_max_position_embeddings"]),
    }
  if kind != "default":
    raise _unsupported(f"rope type {kind!r} is not supported; supported: default and llama3")
  return keys


def _layer_types(hf: Mapping, expected: list[str], family: str) -> None:
  types = hf.get("layer_types")
  if types is not None and list(types) != expected:
    raise _unsupported(f"layer_types={types} differ from {family}'s pattern; this variant is not supported")


def model_keys(hf: Mapping) -> dict:
  """Our model keys (a configs/models yml) from a Hugging Face config.json; ConfigError if unsupported."""
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise _unsupported(f"model_type={model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
  block = FAMILIES[model_type]
  archs = hf.get("architectures") or [ARCHITECTURES[block]]
  if archs[0] != ARCHITECTURES[block]:
    raise _unsupported(f"architecture {archs[0]} is not supported; a causal LM ({ARCHITECTURES[block]}) is needed")
  if block == "gpt3":
    return _gpt2_keys(hf)

  emb, heads = hf["hidden_size"], hf["num_attention_heads"]
  layers = hf["num_hidden_layers"]
  keys = {
    "decoder_block": block,
    "base_emb_dim": emb,
    "base_num_query_heads": heads,
    "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
    "base_mlp_dim": hf["intermediate_size"],
    "base_num_decoder_layers": layers,
    "head_dim": hf.get("head_dim") or emb // heads,
    "vocab_size": hf["vocab_size"],
    "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
    "logits_via_embedding": bool(hf.get("tie_word_embeddings", block in ("gemma", "gemma2"))),
  } | _rope(hf)
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise _unsupported("attention_bias/mlp_bias=true is not supported for this family")

  act = hf.get("hidden_activation") or hf.get("hidden_act")
  if block in ("gemma", "gemma2"):
    if act not in TANH_GELUS:
      raise _unsupported(f"hidden activation {act!r} is not supported; Gemma uses gelu_pytorch_tanh")
    keys["mlp_activations"] = ["gelu", "linear"]
  else:
    if act != "silu":
      raise _unsupported(f"hidden_act={act!r} is not supported for {model_type}; only silu (SwiGLU)")
    keys["mlp_activations"] = ["silu", "linear"]

  window = hf.get("sliding_window") or 0
  if block == "mistral":
    keys["sliding_window_size"] = window
  elif block == "qwen3":
    if hf.get("use_sliding_window"):
      raise _unsupported("use_sliding_window=true is not supported for qwen3")
    _layer_types(hf, ["full_attention"] * layers, "qwen3")
  elif block == "gemma2":
    _layer_types(hf, ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)], "gemma2")
    keys |= {
      "sliding_window_size": window,
      "attn_logits_soft_cap": float(hf.get("attn_logit_softcapping") or 0.0),
      "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0.0),
      "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar") or keys["head_dim"]),
    }
  return keys


def _gpt2_keys(hf: Mapping) -> dict:
  emb, heads = hf["n_embd"], hf["n_head"]
  if emb % heads:
    raise _unsupported(f"n_embd={emb} is not a multiple of n_head={heads}")
  act = hf.get("activation_function", "gelu_new")
  if act not in TANH_GELUS:
    raise _unsupported(f"activation_function={act!r} is not supported; only the tanh GELU (gelu_new)")
  if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
    raise _unsupported("scale_attn_weights=false or scale_attn_by_inverse_layer_idx=true is not supported")
  if hf.get("tie_word_embeddings") is False:
    raise _unsupported("tie_word_embeddings=false is not supported for gpt2")
  return {
    "decoder_block": "gpt3",
    "base_emb_dim": emb,
    "base_num_query_heads": heads,
    "base_num_kv_heads": heads,
    "base_mlp_dim": hf.get("n_inner") or 4 * emb,
    "base_num_decoder_layers": hf["n_layer"],
    "head_dim": emb // heads,
    "vocab_size": hf["vocab_size"],
    "mlp_activations": ["gelu"],
    "normalization_layer_epsilon": float(hf.get("layer_norm_epsilon", 1e-5)),
    "logits_via_embedding": True,
    "trainable_position_size": hf["n_positions"],
  }


def hf_config(cfg: Config, dtype: str, bos_id: int | None = None, eos_id: int | None = None) -> dict:
  """A config.json for transformers from our config (the inverse of model_keys); the dtype goes under both
  transformers 4.x's key (torch_dtype) and 5.x's (dtype)."""
  block = cfg.decoder_block
  if block not in MODEL_TYPES:
    raise ConfigError(f"decoder_block={block} has no Hugging Face export")
  common = {"architectures": [ARCHITECTURES[block]], "model_type": MODEL_TYPES[block], "torch_dtype": dtype, "dtype": dtype}
  common |= {"bos_token_id": bos_id, "eos_token_id": eos_id, "vocab_size": cfg.vocab_size}
  if block == "gpt3":
    return common | {
      "n_embd": cfg.emb_dim,
      "n_head": cfg.num_query_heads,
      "n_layer": cfg.num_decoder_layers,
      "n_inner": cfg.mlp_dim,
      "n_positions": cfg.trainable_position_size,
      "layer_norm_epsilon": cfg.normalization_layer_epsilon,
      "activation_function": "gelu_new",
      "tie_word_embeddings": True,
    }
  rope_scaling = None
  if cfg.rope_type == "llama3.1":
    rope_scaling = {
      "rope_type": "llama3",
      "factor": cfg.rope_scaling_factor,
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
      "original_max_position_embeddings": cfg.rope_original_max_position,
    }
  out = common | {
    "hidden_size": cfg.emb_dim,
    "intermediate_size": cfg.mlp_dim,
    "num_attention_heads": cfg.num_query_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "num_hidden_layers": cfg.num_decoder_layers,
    "head_dim": cfg.head_dim,
    "rms_norm_eps": cfg.normalization_layer_epsilon,
    "rope_theta": cfg.rope_max_timescale,
    "rope_scaling": rope_scaling,
    "tie_word_embeddings": cfg.logits_via_embedding,
    "max_position_embeddings": max(cfg.max_target_length, cfg.rope_original_max_position),
    "attention_bias": False,
  }
  if block in ("gemma", "gemma2"):
    out |= {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
  else:
    out |= {"hidden_act": "silu"}
  window = cfg.sliding_window_size or None
  if block == "mistral":
    out["sliding_window"] = window
  if block == "qwen3":
    out |= {"use_sliding_window": False, "layer_types": ["full_attention"] * cfg.num_decoder_layers}
  if block == "gemma2":
    out |= {
      "sliding_window": window,
      "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg.num_decoder_layers)],
      "attn_logit_softcapping": cfg.attn_logits_soft_cap or None,
      "final_logit_softcapping": cfg.final_logits_soft_cap or None,
      "query_pre_attn_scalar": int(cfg.query_pre_attn_scalar or cfg.head_dim),
    }
  return out


# ------------------------------------------------------------------------------------- tensor layout
@dataclasses.dataclass(frozen=True)
class Group:
  """Hugging Face tensors `hf` <-> our parameters `ours` (dotted paths). In a per-layer group, `{i}` in the
  HF names is the layer index and our paths are relative to the layer."""

  hf: tuple[str, ...]
  ours: tuple[str, ...]
  to_ours: Callable[..., tuple]
  to_hf: Callable[..., tuple]
  # For one HF tensor -> one of ours: the axis of ours that HF's rows (axis 0) become, when to_ours of a block
  # of rows gives that block of ours (so a big tensor can be converted a block of rows at a time).
  row_axis: int | None = None


def same(hf: str, ours: str) -> Group:
  return Group((hf,), (ours,), lambda w: (w,), lambda w: (w,), row_axis=0)


def linear(hf: str, ours: str, out_shape: tuple[int, ...]) -> Group:
  """torch Linear W [prod(out_shape), in] <-> our kernel [in, *out_shape]."""
  return Group(
    (hf,),
    (ours,),
    lambda w: (w.T.reshape(w.shape[1], *out_shape[:-1], -1),),
    lambda k: (k.reshape(k.shape[0], -1).T,),
    row_axis=1 if len(out_shape) == 1 else None,
  )


def linear_in(hf: str, ours: str, in_shape: tuple[int, ...]) -> Group:
  """torch Linear W [out, prod(in_shape)] <-> our kernel [*in_shape, out] (the attention output)."""
  return Group(
    (hf,),
    (ours,),
    lambda w: (w.T.reshape(*in_shape, w.shape[0]),),
    lambda k: (k.reshape(-1, k.shape[-1]).T,),
  )


def conv1d_in(hf: str, ours: str, in_shape: tuple[int, ...]) -> Group:
  """GPT-2 Conv1D W [prod(in_shape), out] <-> our kernel [*in_shape, out]: the same elements, reshaped."""
  return Group(
    (hf,),
    (ours,),
    lambda w: (w.reshape(*in_shape, w.shape[-1]),),
    lambda k: (k.reshape(-1, k.shape[-1]),),
  )


def fused_qkv(hf: str, ours: tuple[str, str, str], heads: int, head_dim: int) -> Group:
  """GPT-2's c_attn: [in, 3 * heads * head_dim] weight or [3 * heads * head_dim] bias <-> query, key, value."""

  def split(w):
    parts = np.split(w, 3, axis=-1)
    return tuple(p.reshape(*w.shape[:-1], heads, head_dim) for p in parts)

  def join(q, k, v):
    flat = [x.reshape(*x.shape[:-2], heads * head_dim) for x in (q, k, v)]
    return (_concatenate(flat),)

  return Group((hf,), ours, split, join)


def _concatenate(arrays):
  if all(isinstance(a, np.ndarray) for a in arrays):
    return np.concatenate(arrays, axis=-1)
  import jax.numpy as jnp  # abstract shapes (jax.eval_shape) go through jax

  return jnp.concatenate(arrays, axis=-1)


def layout(cfg: Config) -> tuple[list[Group], list[Group]]:
  """(model-level groups, per-layer groups) of a family."""
  if cfg.decoder_block == "gpt3":
    return _gpt2_layout(cfg)
  heads, kv, hd = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
  model = [same("model.embed_tokens.weight", "token_embedder.embedding"), same("model.norm.weight", "decoder_norm.scale")]
  if not cfg.logits_via_embedding:
    model.append(linear("lm_head.weight", "logits_dense.kernel", (cfg.vocab_size,)))
  p = "model.layers.{i}."
  layer = [
    same(p + "input_layernorm.weight", "pre_self_attention_layer_norm.scale"),
    linear(p + "self_attn.q_proj.weight", "self_attention.query.kernel", (heads, hd)),
    linear(p + "self_attn.k_proj.weight", "self_attention.key.kernel", (kv, hd)),
    linear(p + "self_attn.v_proj.weight", "self_attention.value.kernel", (kv, hd)),
    linear_in(p + "self_attn.o_proj.weight", "self_attention.out.kernel", (heads, hd)),
    linear(p + "mlp.gate_proj.weight", "mlp.wi_0.kernel", (cfg.mlp_dim,)),
    linear(p + "mlp.up_proj.weight", "mlp.wi_1.kernel", (cfg.mlp_dim,)),
    linear_in(p + "mlp.down_proj.weight", "mlp.wo.kernel", (cfg.mlp_dim,)),
  ]
  if cfg.decoder_block == "gemma2":
    layer += [
      same(p + "post_attention_layernorm.weight", "post_self_attention_norm.scale"),
      same(p + "pre_feedforward_layernorm.weight", "pre_ffw_norm.scale"),
      same(p + "post_feedforward_layernorm.weight", "post_ffw_norm.scale"),
    ]
  else:
    layer.append(same(p + "post_attention_layernorm.weight", "post_self_attention_layer_norm.scale"))
  if cfg.decoder_block == "qwen3":
    layer += [
      same(p + "self_attn.q_norm.weight", "self_attention.query_norm.scale"),
      same(p + "self_attn.k_norm.weight", "self_attention.key_norm.scale"),
    ]
  return model, layer


def _gpt2_layout(cfg: Config) -> tuple[list[Group], list[Group]]:
  heads, hd = cfg.num_query_heads, cfg.head_dim
  model = [
    same("transformer.wte.weight", "token_embedder.embedding"),
    same("transformer.wpe.weight", "position_embedder.embedding"),
    same("transformer.ln_f.weight", "decoder_norm.scale"),
    same("transformer.ln_f.bias", "decoder_norm.bias"),
  ]
  p = "transformer.h.{i}."
  qkv = ("self_attention.query", "self_attention.key", "self_attention.value")
  layer = [
    same(p + "ln_1.weight", "pre_self_attention_layer_norm.scale"),
    same(p + "ln_1.bias", "pre_self_attention_layer_norm.bias"),
    fused_qkv(p + "attn.c_attn.weight", tuple(f"{n}.kernel" for n in qkv), heads, hd),
    fused_qkv(p + "attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), heads, hd),
    conv1d_in(p + "attn.c_proj.weight", "self_attention.out.kernel", (heads, hd)),
    same(p + "attn.c_proj.bias", "self_attention.out.bias"),
    same(p + "ln_2.weight", "post_self_attention_layer_norm.scale"),
    same(p + "ln_2.bias", "post_self_attention_layer_norm.bias"),
    same(p + "mlp.c_fc.weight", "mlp.wi_0.kernel"),
    same(p + "mlp.c_fc.bias", "mlp.wi_0.bias"),
    same(p + "mlp.c_proj.weight", "mlp.wo.kernel"),
    same(p + "mlp.c_proj.bias", "mlp.wo.bias"),
  ]
  return model, layer


def ignored(name: str, cfg: Config) -> bool:
  """Tensors some checkpoints carry that are not parameters: GPT-2's causal-mask buffers, rotary caches, and
  a tied output head saved anyway."""
  if cfg.decoder_block == "gpt3" and name.endswith(".attn.bias") and ".c_attn." not in name:
    return True
  if name == "lm_head.weight" and cfg.logits_via_embedding:
    return True
  return name.endswith(("attn.masked_bias", "rotary_emb.inv_freq"))
