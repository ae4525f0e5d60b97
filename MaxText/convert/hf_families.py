"""The Hugging Face checkpoint format: how a family's config.json and tensors map to our keys and parameters.

Each family (its module in MaxText/families/) owns an `HFMapping`: its model_type and architecture, `read_config`
(config.json -> our model keys), `write_config` (our config -> config.json) and `layout` (which Hugging Face
tensors make which of our parameters, for the whole model and for one decoder layer: a `Group` of HF names and
our paths, with the two pure functions between them). The functions only transpose, reshape, slice and
concatenate, so a round trip gives back the same bits. `llama_like` builds the mapping of the families that
share Llama's tensor names; a family only names what it adds.

Hugging Face stores a linear layer as W [out, in] (y = x W^T); we store kernels [in, *out] with heads split
out (query [embed, heads, head_dim], out [heads, head_dim, embed]). GPT-2 stores Conv1D weights [in, out]
and fuses query, key and value into one c_attn. Both use RoPE's "rotate half" pairing, as we do, so no
permutation of the query and key rows is needed.
"""

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from MaxText.common_types import Config, ConfigError

# GELU with the tanh approximation under its Hugging Face names (our "gelu" is jax.nn.gelu, approximate=True).
TANH_GELUS = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")


def unsupported(what: str) -> ConfigError:
  return ConfigError(f"config.json: {what}")


# ------------------------------------------------------------------------------------- config.json's fields
@dataclasses.dataclass(frozen=True)
class Kind:
  """What a config.json field must hold: `what` says it in the error, `accepts` checks a value; `nullable`: null
  is allowed too (the families read it as absent)."""

  what: str
  accepts: Callable[[Any], bool]
  nullable: bool = True

  def required(self) -> "Kind":
    """The same kind without null: a family reads the field's value itself (float(...), range(...))."""
    return dataclasses.replace(self, nullable=False)


def _integer(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


FLOAT32_MAX = 3.4028234663852886e38


def _number(v) -> bool:
  """A JSON number within float32's range, where the model computes with it (Python's json reads NaN and Infinity,
  and 1e999 as infinity; 1e308 would be one in float32)."""
  return (_integer(v) or (isinstance(v, float) and math.isfinite(v))) and abs(v) <= FLOAT32_MAX


# Sizes and counts below 2**31 (what an int32 index reaches); no model has more layers, heads or experts than 2**16.
SIZE = Kind("a positive integer below 2**31", lambda v: _integer(v) and 0 < v < 2**31)
MANY = Kind("a positive integer up to 65536", lambda v: _integer(v) and 0 < v <= 2**16)
COUNT = Kind("an integer from 0 below 2**31", lambda v: _integer(v) and 0 <= v < 2**31)
NUMBER = Kind("a finite number (float32's range)", _number)
POSITIVE = Kind("a positive finite number (float32's range)", lambda v: _number(v) and v > 0)
# true or false; an integer reads as its truth, as transformers 4.x read Llama 4 Scout's published
# "attn_temperature_tuning": 4. A string ("false") is refused: bool("false") would be true.
FLAG = Kind("true or false", lambda v: isinstance(v, bool) or _integer(v))
TEXT = Kind("a string", lambda v: isinstance(v, str))
TEXTS = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
INDICES = Kind("a list of integers from 0", lambda v: isinstance(v, list) and all(COUNT.accepts(x) for x in v))
OBJECT = Kind("an object", lambda v: isinstance(v, dict))

# Every field of a config.json (its top level, or a multimodal one's text_config) that a family reads, with what it
# must hold; a field left out here is read by no family. required(): some family uses the value as it is, so null is
# refused. Checked before any family reads config.json (check_fields), so a wrong type is one line naming the field,
# never a TypeError in a family's read; tests/import_fuzz_test.py mutates every field of every family's examples.
FIELDS: dict[str, Kind] = {
  "model_type": TEXT,
  "architectures": TEXTS,
  "quantization_config": OBJECT,
  "text_config": OBJECT,
  # Llama's, and most families'
  "hidden_size": SIZE.required(),
  "num_attention_heads": MANY.required(),
  "num_key_value_heads": MANY,
  "intermediate_size": SIZE.required(),
  "num_hidden_layers": MANY.required(),
  "head_dim": SIZE,
  "vocab_size": SIZE.required(),
  "rms_norm_eps": POSITIVE.required(),
  "tie_word_embeddings": FLAG,
  "attention_bias": FLAG,
  "mlp_bias": FLAG,
  "hidden_act": TEXT,
  "hidden_activation": TEXT,
  "max_position_embeddings": SIZE.required(),
  "rope_theta": POSITIVE.required(),
  "rope_scaling": OBJECT,
  "rope_parameters": OBJECT,
  "layer_types": TEXTS,
  "use_sliding_window": FLAG,
  "sliding_window": COUNT,
  # Gemma 2 and 3
  "attn_logit_softcapping": NUMBER,
  "final_logit_softcapping": NUMBER,
  "query_pre_attn_scalar": POSITIVE.required(),
  "sliding_window_pattern": SIZE,
  "use_bidirectional_attention": FLAG,
  "rope_local_base_freq": POSITIVE.required(),
  # mixtures of experts
  "num_local_experts": MANY.required(),
  "num_experts": MANY,
  "num_experts_per_tok": MANY.required(),
  "moe_intermediate_size": SIZE.required(),
  "norm_topk_prob": FLAG,
  "decoder_sparse_step": COUNT,
  "mlp_only_layers": INDICES,
  "router_jitter_noise": NUMBER,
  # gpt-oss
  "swiglu_alpha": NUMBER,
  "swiglu_limit": NUMBER,
  # Llama 4
  "intermediate_size_mlp": SIZE.required(),
  "interleave_moe_layer_step": MANY.required(),
  "moe_layers": INDICES,
  "no_rope_layers": INDICES,
  "no_rope_layer_interval": MANY.required(),
  "attention_chunk_size": COUNT,
  "use_qk_norm": FLAG,
  "attn_temperature_tuning": FLAG,
  "floor_scale": SIZE.required(),
  "attn_scale": NUMBER.required(),
  # GPT-2
  "n_embd": SIZE.required(),
  "n_head": MANY.required(),
  "n_layer": MANY.required(),
  "n_inner": SIZE,
  "n_positions": SIZE.required(),
  "layer_norm_epsilon": POSITIVE.required(),
  "activation_function": TEXT,
  "scale_attn_weights": FLAG,
  "scale_attn_by_inverse_layer_idx": FLAG,
  # DeepSeek-V3
  "topk_method": TEXT,
  "scoring_func": TEXT,
  "moe_layer_freq": COUNT,
  "first_k_dense_replace": COUNT.required(),
  "n_routed_experts": MANY,
  "n_shared_experts": COUNT,
  "routed_scaling_factor": POSITIVE.required(),
  "n_group": MANY,
  "topk_group": MANY,
  "q_lora_rank": COUNT,
  "kv_lora_rank": SIZE.required(),
  "qk_nope_head_dim": SIZE.required(),
  "qk_rope_head_dim": SIZE.required(),
  "v_head_dim": SIZE.required(),
  "rope_interleave": FLAG,
}

# The fields of a RoPE object (rope_scaling, rope_parameters, and 5.x's rope_parameters by layer type).
ROPE_FIELDS: dict[str, Kind] = {
  "rope_type": TEXT,
  "type": TEXT,
  "rope_theta": POSITIVE.required(),
  "factor": POSITIVE.required(),
  "low_freq_factor": POSITIVE.required(),
  "high_freq_factor": POSITIVE.required(),
  "original_max_position_embeddings": SIZE.required(),
  "attention_factor": NUMBER,
  "beta_fast": NUMBER,
  "beta_slow": NUMBER,
  "mscale": NUMBER,
  "mscale_all_dim": NUMBER,
  "truncate": FLAG,
  "full_attention": OBJECT,
  "sliding_attention": OBJECT,
}
QUANTIZATION_FIELDS: dict[str, Kind] = {"quant_method": TEXT}


def _shown(value) -> str:
  """A field's value for an error line: a scalar as JSON (cut), a container by its kind alone (it may nest deep)."""
  if isinstance(value, dict | list):
    return f"a JSON {'object' if isinstance(value, dict) else 'list'}"
  text = json.dumps(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _check(values: Mapping, fields: Mapping[str, Kind], where: str) -> None:
  for key, kind in fields.items():
    if key not in values:
      continue
    value = values[key]
    if value is None and kind.nullable:
      continue
    if value is None or not kind.accepts(value):
      raise unsupported(f"{where}{key} is {_shown(value)}; it must be {kind.what}{' or null' if kind.nullable else ''}")


def check_fields(config_json: Mapping) -> None:
  """ConfigError, naming the field, for a config.json field (FIELDS) holding what no family can read: a string where
  a number belongs, a list where an object does, NaN, a negative size. Fields no family reads are not looked at."""
  for where, values in (("", config_json), ("text_config.", config_json.get("text_config"))):
    if not isinstance(values, Mapping):
      continue
    _check(values, FIELDS, where)
    for key in ("rope_scaling", "rope_parameters"):
      rope = values.get(key)
      if isinstance(rope, Mapping):
        _check(rope, ROPE_FIELDS, f"{where}{key}.")
        for layer_type in ("full_attention", "sliding_attention"):
          if isinstance(rope.get(layer_type), Mapping):
            _check(rope[layer_type], ROPE_FIELDS, f"{where}{key}.{layer_type}.")
    if isinstance(values.get("quantization_config"), Mapping):
      _check(values["quantization_config"], QUANTIZATION_FIELDS, f"{where}quantization_config.")


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
  # For a linear layer: rank -> the groups of its LoRA adapter in PEFT's format (convert/peft.py), lora_A and
  # lora_B <-> our lora_a and lora_b, converted as the kernel's inputs and outputs are.
  adapter: Callable[[int], tuple["Group", "Group"]] | None = None


def same(hf: str, ours: str) -> Group:
  return Group((hf,), (ours,), lambda w: (w,), lambda w: (w,), row_axis=0)


def _peft_names(hf: str, ours: str) -> tuple[str, str, str, str]:
  """(lora_A, lora_B, lora_a, lora_b) names beside a kernel's: PEFT's lora_A [r, in] and lora_B [out, r] weights."""
  module, ours_module = hf.removesuffix(".weight"), ours.removesuffix(".kernel")
  return f"{module}.lora_A.weight", f"{module}.lora_B.weight", f"{ours_module}.lora_a", f"{ours_module}.lora_b"


def linear(hf: str, ours: str, out_shape: tuple[int, ...], adapter: bool = True) -> Group:
  """torch Linear W [prod(out_shape), in] <-> our kernel [in, *out_shape]."""

  def lora(rank):
    a_hf, b_hf, a, b = _peft_names(hf, ours)
    return linear(a_hf, a, (rank,), adapter=False), linear(b_hf, b, out_shape, adapter=False)

  return Group(
    (hf,),
    (ours,),
    lambda w: (w.T.reshape(w.shape[1], *out_shape[:-1], -1),),
    lambda k: (k.reshape(k.shape[0], -1).T,),
    row_axis=1 if len(out_shape) == 1 else None,
    adapter=lora if adapter else None,
  )


def bias(hf: str, ours: str, out_shape: tuple[int, ...]) -> Group:
  """torch Linear bias b [prod(out_shape)] <-> our bias [*out_shape] (a projection's, with heads split out)."""
  return Group((hf,), (ours,), lambda b: (b.reshape(out_shape),), lambda b: (b.reshape(-1),))


def linear_in(hf: str, ours: str, in_shape: tuple[int, ...]) -> Group:
  """torch Linear W [out, prod(in_shape)] <-> our kernel [*in_shape, out] (the attention output)."""

  def lora(rank):
    a_hf, b_hf, a, b = _peft_names(hf, ours)
    return linear_in(a_hf, a, in_shape), linear(b_hf, b, (-1,), adapter=False)

  return Group(
    (hf,),
    (ours,),
    lambda w: (w.T.reshape(*in_shape, w.shape[0]),),
    lambda k: (k.reshape(-1, k.shape[-1]).T,),
    adapter=lora,
  )


def conv1d_in(hf: str, ours: str, in_shape: tuple[int, ...]) -> Group:
  """GPT-2 Conv1D W [prod(in_shape), out] <-> our kernel [*in_shape, out]: the same elements, reshaped."""
  return Group(
    (hf,),
    (ours,),
    lambda w: (w.reshape(*in_shape, w.shape[-1]),),
    lambda k: (k.reshape(-1, k.shape[-1]),),
  )


def stacked_linear(hf: Sequence[str], ours: str) -> Group:
  """One torch Linear W_j [out, in] per expert j <-> our expert kernel [experts, in, out]."""
  return Group(
    tuple(hf), (ours,), lambda *ws: (np.stack([w.T for w in ws]),), lambda k: tuple(k[j].T for j in range(len(hf)))
  )


def interleaved(hf: str, ours: tuple[str, str]) -> Group:
  """A fused tensor [..., 2 * n] whose last axis alternates two of ours [..., n] (gpt-oss's experts' gate_up_proj
  and its bias: gate at the even columns, up at the odd ones) <-> those two."""

  def join(a, b):
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
      return (np.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1),)
    import jax.numpy as jnp  # abstract shapes (jax.eval_shape) go through jax

    return (jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], -1),)

  return Group((hf,), tuple(ours), lambda w: (w[..., 0::2], w[..., 1::2]), join)


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


# (model-level groups, per-layer groups): the same groups for every layer, or a function of the layer index for a
# family whose layers differ (DeepSeek's dense and MoE layers); it returns the same Group objects for layers alike.
Layout = tuple[list[Group], list[Group] | Callable[[int], list[Group]]]


def layer_groups(groups: list[Group] | Callable[[int], list[Group]], layer: int) -> list[Group]:
  """The per-layer groups of a Layout for decoder layer `layer`."""
  return groups(layer) if callable(groups) else groups


def not_parameters(name: str, cfg: Config) -> bool:
  """Tensors some checkpoints carry that are not parameters: rotary caches, and a tied output head saved anyway."""
  if name == "lm_head.weight" and cfg.logits_via_embedding:
    return True
  return name.endswith("rotary_emb.inv_freq")


@dataclasses.dataclass(frozen=True)
class TextTower:
  """Where a multimodal checkpoint (a ...ForConditionalGeneration) keeps a family's text model, for import only
  (export writes the family's causal LM): its config.json's model_type and architecture, the key holding the text
  model's config.json, and how the text model's tensor names are stored.

  `renames` are (text model's prefix, stored prefix) pairs, tried in order: ("model.", "language_model.model.")
  finds model.norm.weight stored as language_model.model.norm.weight. `other_towers` are the stored prefixes of the
  tensors that are not the text model's (the vision tower, the projector): left out of the import, not refused.
  """

  model_type: str  # the multimodal config.json's model_type ("gemma3", "llama4")
  architecture: str  # its architectures[0] ("Gemma3ForConditionalGeneration")
  renames: tuple[tuple[str, str], ...]
  other_towers: tuple[str, ...]
  config_key: str = "text_config"

  def text_config(self, mapping: "HFMapping", hf: Mapping) -> dict:
    """The text model's config.json from the multimodal one: its `config_key`, as the family's causal LM."""
    archs = hf.get("architectures") or [self.architecture]
    if archs[0] != self.architecture:
      raise unsupported(f"architecture {archs[0]} is not supported; {self.architecture} or {mapping.architecture} is")
    text = hf.get(self.config_key)
    if not isinstance(text, Mapping):
      raise unsupported(f"no {self.config_key!r}, which a {self.model_type} model needs; is this its own config.json?")
    return dict(text) | {"model_type": mapping.model_type, "architectures": [mapping.architecture]}

  def stored_names(self, name: str) -> list[str]:
    """The names the text model's tensor `name` may be stored under, in the order tried."""
    return [stored + name.removeprefix(text) for text, stored in self.renames if name.startswith(text)]

  def text_name(self, stored: str) -> str | None:
    """The text model's name of a stored tensor; None for another tower's."""
    if stored.startswith(self.other_towers):
      return None
    for text, prefix in self.renames:
      if stored.startswith(prefix):
        return text + stored.removeprefix(prefix)
    return stored


@dataclasses.dataclass(frozen=True)
class HFMapping:
  """How one family's checkpoints look in Hugging Face's format."""

  model_type: str  # config.json's model_type
  architecture: str  # config.json's architectures[0]: the causal LM class of transformers
  read_config: Callable[[Mapping], dict]  # config.json -> our model keys (a configs/models yml, decoder_block aside)
  write_config: Callable[[Config], dict]  # our config -> config.json's keys (the common ones aside, see hf_config)
  layout: Callable[[Config], Layout]
  ignored: Callable[[str, Config], bool] = not_parameters  # tensors of a checkpoint that are not parameters
  text_tower: TextTower | None = None  # the multimodal checkpoints holding this family's text model (import only)
  # config.json's quantization_config.quant_method values whose tensors the importer dequantizes (gpt-oss's mxfp4,
  # convert/mxfp4.py); any other quantized checkpoint is refused (check_quantization).
  quantizations: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class HFExample:
  """A small random model of a family in transformers, for the parity tests (tests/hf_checkpoint_test.py): the
  keyword arguments of transformers' config class for the family's model_type, and how the test stores it."""

  config: Mapping[str, Any]
  scan_layers: bool = True  # imported scanned or unrolled: the families between them cover both layouts
  max_shard_size: str | None = None  # saved in shards of this size (transformers' max_shard_size), or in one file


# The sizes most examples share: small enough for a CPU test, the layers and the sequences longer than one.
SMALL = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3}
SMALL |= {"max_position_embeddings": 128}


def check_quantization(mapping: HFMapping, hf: Mapping) -> None:
  """A quantized checkpoint (config.json's quantization_config, e.g. DeepSeek-V3's and Kimi K2's fp8, Llama 4
  Maverick's FP8 release, bitsandbytes 4-bit) imports only where the family's importer dequantizes its method."""
  quantization = hf.get("quantization_config")
  if not quantization:
    return
  method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) else quantization
  if method not in mapping.quantizations:
    itself = f" (the importer dequantizes {', '.join(mapping.quantizations)} itself)" if mapping.quantizations else ""
    raise unsupported(
      f"quantization_config ({method}) is not supported for {mapping.model_type}: its quantized weights cannot be "
      f"read; dequantize them to bfloat16 first{itself}"
    )


def model_keys(mapping: HFMapping, decoder_block: str, hf: Mapping) -> dict:
  """Our model keys from a config.json of `mapping`'s model_type; ConfigError where the variant is unsupported."""
  archs = hf.get("architectures") or [mapping.architecture]
  if archs[0] != mapping.architecture:
    raise unsupported(f"architecture {archs[0]} is not supported; a causal LM ({mapping.architecture}) is needed")
  check_quantization(mapping, hf)
  try:
    keys = mapping.read_config(hf)
  except KeyError as e:
    needs = f"no {e.args[0]!r}, which a {mapping.model_type} model needs"
    raise unsupported(f"{needs}; is this the model's own config.json?") from None
  return {"decoder_block": decoder_block} | keys


def hf_config(mapping: HFMapping, cfg: Config, dtype: str, bos_id: int | None = None, eos_id: int | None = None) -> dict:
  """A config.json for transformers from our config (the inverse of model_keys); the dtype goes under both
  transformers 4.x's key (torch_dtype) and 5.x's (dtype)."""
  common = {"architectures": [mapping.architecture], "model_type": mapping.model_type, "torch_dtype": dtype}
  common |= {"dtype": dtype, "bos_token_id": bos_id, "eos_token_id": eos_id, "vocab_size": cfg.vocab_size}
  return common | mapping.write_config(cfg)


# ------------------------------------------------------------------------------------- Llama-like families
def read_rope(hf: Mapping) -> dict:
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
  if kind == "yarn":
    if params.get("attention_factor") is not None or params.get("mscale_all_dim"):
      raise unsupported("yarn with attention_factor or mscale_all_dim is not supported for this family")
    return keys | {
      "rope_type": "yarn",
      "rope_factor": float(params["factor"]),
      "original_max_position_embeddings": int(
        params.get("original_max_position_embeddings") or hf["max_position_embeddings"]
      ),
      "beta_fast": float(params.get("beta_fast") or 32.0),
      "beta_slow": float(params.get("beta_slow") or 1.0),
      "mscale": float(params.get("mscale") or 1.0),
      "rope_truncate": bool(params.get("truncate", True)),
      "rope_attention_scaling": True,  # transformers multiplies cos and sin by the temperature
    }
  if kind != "default":
    raise unsupported(f"rope type {kind!r} is not supported; supported: default, llama3 and yarn")
  return keys


def max_positions(cfg: Config) -> int:
  """config.json's max_position_embeddings: the longest sequence the model is for, which servers (vLLM's
  max_model_len) and tools read as its limit. An imported model keeps its source's (hf_max_position_embeddings, set
  in model.yml by the importer: fine-tuning it here on shorter rows takes nothing from what it was made for); a
  model whose RoPE is scaled (YaRN, Llama 3.1's) serves the length the scaling extends its original one to; any other
  model made here, the length it was trained at (max_target_length): writing more (8192 for a 256-token model, as
  the export once did) promises positions it never saw."""
  if cfg.hf_max_position_embeddings > 0:
    return cfg.hf_max_position_embeddings
  if cfg.rope_type == "yarn":
    return int(cfg.original_max_position_embeddings * cfg.rope_factor)
  if cfg.rope_type == "llama3.1":
    return int(cfg.rope_original_max_position * cfg.rope_scaling_factor)
  return cfg.max_target_length


def yarn_scaling(cfg: Config) -> dict:
  """config.json's rope_scaling for rope_type=yarn (our keys under transformers' names)."""
  return {
    "rope_type": "yarn",
    "factor": cfg.rope_factor,
    "original_max_position_embeddings": cfg.original_max_position_embeddings,
    "beta_fast": cfg.beta_fast,
    "beta_slow": cfg.beta_slow,
    "mscale": cfg.mscale,
    "truncate": cfg.rope_truncate,
  }


def write_rope(cfg: Config) -> dict:
  scaling = None
  if cfg.rope_type == "llama3.1":
    scaling = {
      "rope_type": "llama3",
      "factor": cfg.rope_scaling_factor,
      "low_freq_factor": cfg.rope_low_freq_factor,
      "high_freq_factor": cfg.rope_high_freq_factor,
      "original_max_position_embeddings": cfg.rope_original_max_position,
    }
  if cfg.rope_type == "yarn":
    scaling = yarn_scaling(cfg)
    if not cfg.rope_attention_scaling:
      scaling["attention_factor"] = 1.0
  return {"rope_theta": cfg.rope_max_timescale, "rope_scaling": scaling}


def softmax_router_only(cfg: Config, family: str) -> None:
  """Mixtral's and Qwen3-MoE's formats hold a softmax router with plain top-k weights and nothing more."""
  if cfg.shared_experts or cfg.routed_scaling_factor != 1.0 or cfg.routed_score_func == "sigmoid":
    raise ConfigError(
      f"{family}'s Hugging Face format has a softmax router and no shared experts: needs shared_experts=0, "
      "routed_scaling_factor=1 and routed_score_func='' (softmax)"
    )


def check_layer_types(hf: Mapping, expected: list[str], family: str) -> None:
  """config.json's per-layer attention kinds (transformers' layer_types), where given, must be the family's."""
  types = hf.get("layer_types")
  if types is not None and list(types) != expected:
    raise unsupported(f"layer_types={types} differ from {family}'s pattern; this variant is not supported")


def read_full_attention(config_json: Mapping, keys: dict, family: str) -> dict:
  """Qwen's config.json (Qwen 2 and 3) always names a sliding window; it applies only with use_sliding_window=true,
  which the published checkpoints leave false: refused, as is a layer_types that is not full attention throughout."""
  if config_json.get("use_sliding_window"):
    raise unsupported(f"use_sliding_window=true is not supported for {family}")
  check_layer_types(config_json, ["full_attention"] * keys["base_num_decoder_layers"], family)
  return {}


def write_full_attention(cfg: Config) -> dict:
  """The config.json keys that say every layer attends to the whole sequence (read_full_attention's)."""
  return {"use_sliding_window": False, "layer_types": ["full_attention"] * cfg.num_decoder_layers}


# Llama's per-layer norms: (Hugging Face module, our module), each a `.weight` <-> `.scale`; the first is the one
# before attention.
LLAMA_NORMS = (
  ("input_layernorm", "pre_self_attention_layer_norm"),
  ("post_attention_layernorm", "post_self_attention_layer_norm"),
)


def dense_mlp(cfg: Config, p: str) -> list[Group]:
  """Llama's SwiGLU MLP under layer prefix p."""
  return [
    linear(p + "mlp.gate_proj.weight", "mlp.wi_0.kernel", (cfg.mlp_dim,)),
    linear(p + "mlp.up_proj.weight", "mlp.wi_1.kernel", (cfg.mlp_dim,)),
    linear_in(p + "mlp.down_proj.weight", "mlp.wo.kernel", (cfg.mlp_dim,)),
  ]


def experts_mlp(module: str, gate: str, up: str, down: str) -> Callable[[Config, str], list[Group]]:
  """A mixture of experts (layers/moe.py) stored as `{module}.gate` (the router) and `{module}.experts.{j}.{gate,
  up, down}` projections per expert, as Mixtral (block_sparse_moe, w1 w3 w2) and Qwen3-MoE (mlp, gate_proj
  up_proj down_proj) do."""

  def groups(cfg: Config, p: str) -> list[Group]:
    experts = [f"{p}{module}.experts.{j}." for j in range(cfg.num_experts)]
    return [
      linear(f"{p}{module}.gate.weight", "mlp.gate.kernel", (cfg.num_experts,)),
      stacked_linear([e + f"{gate}.weight" for e in experts], "mlp.wi_0"),
      stacked_linear([e + f"{up}.weight" for e in experts], "mlp.wi_1"),
      stacked_linear([e + f"{down}.weight" for e in experts], "mlp.wo"),
    ]

  return groups


def qkv_biases(p: str, heads: int, kv_heads: int, head_dim: int) -> list[Group]:
  """The query, key and value projections' biases under layer prefix p."""
  return [
    bias(p + "self_attn.q_proj.bias", "self_attention.query.bias", (heads, head_dim)),
    bias(p + "self_attn.k_proj.bias", "self_attention.key.bias", (kv_heads, head_dim)),
    bias(p + "self_attn.v_proj.bias", "self_attention.value.bias", (kv_heads, head_dim)),
  ]


def llama_like(  # noqa: PLR0913 (keyword-only family options, each defaulted and named at the call)
  model_type: str,
  architecture: str,
  *,
  gelu: bool = False,
  tied_by_default: bool = False,
  norms: Sequence[tuple[str, str]] = LLAMA_NORMS,
  read: Callable[[Mapping, dict], dict] = lambda hf, keys: {},
  write: Callable[[Config], dict] = lambda cfg: {},
  mlp: Callable[[Config, str], list[Group]] = dense_mlp,
  qkv_bias: bool = False,
) -> HFMapping:
  """The mapping of a family with Llama's tensor names and config.json keys.

  gelu: the MLP is GeGLU (hidden_act gelu_pytorch_tanh) rather than SwiGLU. tied_by_default: a config.json without
  tie_word_embeddings ties the output head (Gemma). norms: the per-layer norm scales, Llama's unless the family
  has others. read(hf, keys) and write(cfg): the family's own config.json keys, beyond Llama's. mlp(cfg, prefix):
  the per-layer MLP tensors (Llama's dense one, or experts_mlp's). qkv_bias: q_proj, k_proj and v_proj carry biases
  (Qwen 2, whose config.json has no key for them; the layer's `qkv_bias` trait).
  """

  def read_config(hf: Mapping) -> dict:
    emb, heads = hf["hidden_size"], hf["num_attention_heads"]
    keys = {
      "base_emb_dim": emb,
      "base_num_query_heads": heads,
      "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
      "base_mlp_dim": hf["intermediate_size"],
      "base_num_decoder_layers": hf["num_hidden_layers"],
      "head_dim": hf.get("head_dim") or emb // heads,
      "vocab_size": hf["vocab_size"],
      "normalization_layer_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
      "logits_via_embedding": bool(hf.get("tie_word_embeddings", tied_by_default)),
    } | read_rope(hf)
    if hf.get("attention_bias") or hf.get("mlp_bias"):
      raise unsupported("attention_bias/mlp_bias=true is not supported for this family")
    act = hf.get("hidden_activation") or hf.get("hidden_act")
    if gelu and act not in TANH_GELUS:
      raise unsupported(f"hidden activation {act!r} is not supported; {model_type} uses gelu_pytorch_tanh")
    if not gelu and act != "silu":
      raise unsupported(f"hidden_act={act!r} is not supported for {model_type}; only silu (SwiGLU)")
    keys["mlp_activations"] = ["gelu" if gelu else "silu", "linear"]
    return keys | read(hf, keys)

  def write_config(cfg: Config) -> dict:
    act = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"} if gelu else {"hidden_act": "silu"}
    return {
      "hidden_size": cfg.emb_dim,
      "intermediate_size": cfg.mlp_dim,
      "num_attention_heads": cfg.num_query_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "num_hidden_layers": cfg.num_decoder_layers,
      "head_dim": cfg.head_dim,
      "rms_norm_eps": cfg.normalization_layer_epsilon,
      **write_rope(cfg),
      "tie_word_embeddings": cfg.logits_via_embedding,
      "max_position_embeddings": max_positions(cfg),
      **({} if qkv_bias else {"attention_bias": False}),  # Qwen 2's config.json has no such key: its biases are fixed
      **act,
      **write(cfg),
    }

  def layout(cfg: Config) -> Layout:
    heads, kv, hd = cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim
    model = [same("model.embed_tokens.weight", "token_embedder.embedding"), same("model.norm.weight", "decoder_norm.scale")]
    if not cfg.logits_via_embedding:
      model.append(linear("lm_head.weight", "logits_dense.kernel", (cfg.vocab_size,)))
    p = "model.layers.{i}."
    first_norm, *other_norms = [same(f"{p}{hf}.weight", f"{ours}.scale") for hf, ours in norms]
    layer = [
      first_norm,
      linear(p + "self_attn.q_proj.weight", "self_attention.query.kernel", (heads, hd)),
      linear(p + "self_attn.k_proj.weight", "self_attention.key.kernel", (kv, hd)),
      linear(p + "self_attn.v_proj.weight", "self_attention.value.kernel", (kv, hd)),
      linear_in(p + "self_attn.o_proj.weight", "self_attention.out.kernel", (heads, hd)),
      *(qkv_biases(p, heads, kv, hd) if qkv_bias else []),
      *mlp(cfg, p),
      *other_norms,
    ]
    return model, layer

  return HFMapping(model_type, architecture, read_config, write_config, layout)
