"""Llama 4 (Scout and Maverick, text): RoPE layers with chunked attention and QK L2 norm, NoPE layers with attention
temperature tuning, a mixture of experts with a shared expert whose router scales the expert's input, every layer or
interleaved with dense layers; and Hugging Face's Llama4ForCausalLM format (model_type llama4_text)."""

from collections.abc import Mapping
from typing import Any

import numpy as np

from MaxText.common_types import Config, ConfigError
from MaxText.convert import hf_families
from MaxText.convert.hf_families import SMALL, Group, HFExample
from MaxText.families import Family, rope_rotates_pairs


def is_nope_layer(config: Config, layer_index):
  """Whether layer `layer_index` (an int, or a traced index) has no RoPE: every nope_layer_interval-th layer, counting
  from 1 (transformers' no_rope_layers default). A python bool for an int index, or when no layer is one."""
  interval = config.nope_layer_interval
  if interval <= 0:
    return False
  return (layer_index + 1) % interval == 0


def is_moe_layer(config: Config, layer_index: int) -> bool:
  """Whether layer `layer_index` has the mixture of experts: every interleave_moe_layer_step-th, counting from 1
  (transformers' moe_layers default, range(step - 1, layers, step))."""
  return (layer_index + 1) % config.interleave_moe_layer_step == 0


# What Llama 4's mixture of experts is (layers/llama4.py); a llama4 config that says otherwise is refused.
ROUTING = {
  "routed_score_func": "sigmoid",
  "num_experts_per_tok": 1,
  "shared_experts": 1,
  "routed_bias": False,
  "n_routing_groups": -1,
  "routed_scaling_factor": 1.0,
}


def check(values: Mapping[str, Any]) -> None:
  rope_rotates_pairs(values)
  for key, value in ROUTING.items():
    if values[key] != value:
      raise ConfigError(f"{key}={values[key]}: Llama 4's mixture of experts needs {key}={value} (decoder_block=llama4)")
  step, layers = values["interleave_moe_layer_step"], values["base_num_decoder_layers"]
  if step < 1 or layers % step:
    raise ConfigError(
      f"interleave_moe_layer_step={step} must be >= 1 and divide base_num_decoder_layers={layers}: the layers are "
      "scanned by periods of a step's dense layers and one MoE layer"
    )
  pipelined = values["ici_pipeline_parallelism"] != 1 or values["dcn_pipeline_parallelism"] != 1
  if step > 1 and pipelined:
    raise ConfigError(
      f"interleave_moe_layer_step={step} with pipeline parallelism is not supported (the pipeline stages one layer "
      "class); set ici_pipeline_parallelism=1 and dcn_pipeline_parallelism=1"
    )
  if values["sliding_window_size"]:
    raise ConfigError(
      f"sliding_window_size={values['sliding_window_size']} has no effect for llama4; set it to 0 "
      "(its RoPE layers attend in chunks: chunk_attn_window_size)"
    )
  if values["chunk_attn_window_size"] < 0 or values["temperature_tuning_floor_scale"] <= 0:
    raise ConfigError(
      f"chunk_attn_window_size={values['chunk_attn_window_size']} must be >= 0 (0: off) and "
      f"temperature_tuning_floor_scale={values['temperature_tuning_floor_scale']} positive"
    )


# ------------------------------------------------------------------------------------- Hugging Face's format
def layer_types(num_layers: int, nope_interval: int, chunk: int) -> list[str]:
  """transformers' layer_types: the RoPE layers are chunked when there is a chunk, the NoPE layers full."""
  nope = [nope_interval > 0 and (i + 1) % nope_interval == 0 for i in range(num_layers)]
  return ["full_attention" if n or chunk <= 0 else "chunked_attention" for n in nope]


def _moe_step(config_json: Mapping, num_layers: int) -> int:
  """interleave_moe_layer_step from moe_layers (or the step itself): the MoE layers must be every step-th."""
  step = config_json.get("interleave_moe_layer_step", 1)
  moe = config_json.get("moe_layers")
  if moe is None:
    moe = list(range(step - 1, num_layers, step))
  step = moe[0] + 1 if moe else 0
  if not moe or list(moe) != list(range(step - 1, num_layers, step)) or num_layers % step:
    raise hf_families.unsupported(
      f"moe_layers={list(moe)} is not supported for llama4: the MoE layers must be every k-th layer "
      f"(k-1, 2k-1, ...) with k dividing num_hidden_layers={num_layers}"
    )
  return step


def _nope_interval(config_json: Mapping, num_layers: int) -> int:
  """nope_layer_interval from no_rope_layers (1: RoPE, 0: NoPE per layer; or no_rope_layer_interval where none are
  given): the NoPE layers must be every k-th layer; -1 where there are none."""
  flags = config_json.get("no_rope_layers")
  if not flags:
    interval = config_json.get("no_rope_layer_interval", 4)
    flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
  flags = [int(f) for f in flags[:num_layers]]
  nope = [i for i, f in enumerate(flags) if not f]
  if not nope:
    return -1
  interval = nope[0] + 1
  if flags != [int((i + 1) % interval != 0) for i in range(num_layers)]:
    raise hf_families.unsupported(
      f"no_rope_layers={flags} is not supported for llama4: the NoPE layers (0) must be every k-th layer"
    )
  return interval


def read(config_json: Mapping, keys: dict) -> dict:
  layers = keys["base_num_decoder_layers"]
  if config_json.get("num_experts_per_tok", 1) != 1:
    raise hf_families.unsupported(
      f"num_experts_per_tok={config_json['num_experts_per_tok']} is not supported for llama4: its router scales "
      "the input of one expert per token"
    )
  step, interval = _moe_step(config_json, layers), _nope_interval(config_json, layers)
  chunk = config_json.get("attention_chunk_size", 8192) or 0
  hf_families.check_layer_types(config_json, layer_types(layers, interval, chunk), "llama4")
  return {
    "base_mlp_dim": config_json["intermediate_size_mlp"],
    "base_moe_mlp_dim": config_json["intermediate_size"],
    "num_experts": config_json["num_local_experts"],
    "interleave_moe_layer_step": step,
    "nope_layer_interval": interval,
    "chunk_attn_window_size": chunk,
    "use_qk_norm": bool(config_json.get("use_qk_norm", True)),
    "temperature_tuning": bool(config_json.get("attn_temperature_tuning", True)),
    "temperature_tuning_floor_scale": int(config_json.get("floor_scale", 8192)),
    "temperature_tuning_scale": float(config_json.get("attn_scale", 0.1)),
  } | ROUTING


def write(cfg: Config) -> dict:
  n, step, interval = cfg.num_decoder_layers, cfg.interleave_moe_layer_step, cfg.nope_layer_interval
  return {
    "intermediate_size": cfg.moe_mlp_dim,
    "intermediate_size_mlp": cfg.mlp_dim,
    "num_local_experts": cfg.num_experts,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": step,
    "moe_layers": [i for i in range(n) if is_moe_layer(cfg, i)],
    "no_rope_layers": [int(not is_nope_layer(cfg, i)) for i in range(n)],
    **({"no_rope_layer_interval": interval} if interval > 0 else {}),
    "attention_chunk_size": cfg.chunk_attn_window_size or None,
    "layer_types": layer_types(n, interval, cfg.chunk_attn_window_size),
    "use_qk_norm": cfg.use_qk_norm,
    "attn_temperature_tuning": cfg.temperature_tuning,
    "floor_scale": cfg.temperature_tuning_floor_scale,
    "attn_scale": cfg.temperature_tuning_scale,
  }


def gate_up(hf: str, ours: tuple[str, str]) -> Group:
  """Llama 4's fused experts [experts, embed, 2 * moe_mlp] (the gate's half, then the up projection's) <-> our
  wi_0 and wi_1 [experts, embed, moe_mlp]: already [in, out], so only split and joined."""

  def join(gate, up):
    if isinstance(gate, np.ndarray) and isinstance(up, np.ndarray):
      return (np.concatenate([gate, up], axis=-1),)
    import jax.numpy as jnp  # abstract shapes (jax.eval_shape) go through jax

    return (jnp.concatenate([gate, up], axis=-1),)

  return Group((hf,), ours, lambda w: tuple(np.split(w, 2, axis=-1)), join)


def layout(cfg: Config) -> hf_families.Layout:
  """Llama's model tensors and attention, and per layer `feed_forward`: the MoE's router, fused experts and shared
  expert in MoE layers, a SwiGLU MLP (of intermediate_size_mlp) in the others."""
  model, common = _BASE.layout(cfg)
  linear, linear_in, p = hf_families.linear, hf_families.linear_in, "model.layers.{i}.feed_forward."
  mlp, shared = cfg.mlp_dim, cfg.moe_mlp_dim
  dense = common + [
    linear(p + "gate_proj.weight", "mlp.wi_0.kernel", (mlp,)),
    linear(p + "up_proj.weight", "mlp.wi_1.kernel", (mlp,)),
    linear_in(p + "down_proj.weight", "mlp.wo.kernel", (mlp,)),
  ]
  moe = common + [
    linear(p + "router.weight", "mlp.gate.kernel", (cfg.num_experts,)),
    gate_up(p + "experts.gate_up_proj", ("mlp.wi_0", "mlp.wi_1")),
    hf_families.same(p + "experts.down_proj", "mlp.wo"),
    linear(p + "shared_expert.gate_proj.weight", "mlp.shared.wi_0.kernel", (shared,)),
    linear(p + "shared_expert.up_proj.weight", "mlp.shared.wi_1.kernel", (shared,)),
    linear_in(p + "shared_expert.down_proj.weight", "mlp.shared.wo.kernel", (shared,)),
  ]
  return model, lambda i: moe if is_moe_layer(cfg, i) else dense


# Llama's config.json keys and attention tensors; the MLP tensors are layout's.
_BASE = hf_families.llama_like("llama4_text", "Llama4ForCausalLM", read=read, write=write, mlp=lambda cfg, p: [])

# The published checkpoints are multimodal (Llama4ForConditionalGeneration): the text model's config.json is their
# text_config, its tensors are stored under language_model., beside the vision tower and its projector.
PUBLISHED = hf_families.TextTower(
  "llama4",
  "Llama4ForConditionalGeneration",
  renames=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
  other_towers=("vision_model.", "multi_modal_projector."),
)

# Scout's RoPE scaling (its low and high frequency factors are equal: no blended band), over 16 positions; and one
# with a blended band.
SCOUT_ROPE = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0}
SCOUT_ROPE |= {"original_max_position_embeddings": 16, "rope_theta": 5000.0}
BLENDED_ROPE = SCOUT_ROPE | {"high_freq_factor": 4.0}
_EXAMPLE = SMALL | {"intermediate_size": 24, "intermediate_size_mlp": 80, "num_local_experts": 4, "num_experts_per_tok": 1}
_EXAMPLE |= {"attn_temperature_tuning": True, "attn_scale": 0.3}

FAMILY = Family(
  "llama4",
  "MaxText.layers.llama4:Llama4MoeLayer",
  hf_families.HFMapping(
    _BASE.model_type, _BASE.architecture, _BASE.read_config, _BASE.write_config, layout, text_tower=PUBLISHED
  ),
  check=check,
  summary=(
    "RoPE layers with chunked attention (`chunk_attn_window_size`) and `use_qk_norm`, NoPE layers "
    "(`nope_layer_interval`) with `temperature_tuning`, top-1 sigmoid experts scaling their input with a shared "
    "expert, every layer or every `interleave_moe_layer_step`-th"
  ),
  hf_examples={
    # Maverick-like, with all of Scout's options too: MoE every 2nd of 4 layers (scanned by periods), NoPE every
    # 2nd, chunks of 5, the temperature rising every 4 positions, QK L2 norm, Llama 3.1 RoPE scaling, 6 heads over 2.
    "llama4": HFExample(
      _EXAMPLE
      | {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 8}
      | {"interleave_moe_layer_step": 2, "no_rope_layer_interval": 2, "attention_chunk_size": 5, "floor_scale": 4}
      | {"use_qk_norm": True, "rope_parameters": BLENDED_ROPE}
    ),
    # Scout-like: MoE in every one of 3 layers, the 3rd NoPE, chunks of 8, QK L2 norm, Scout's RoPE scaling, 5 heads
    # over 1; scanned.
    "llama4_scout": HFExample(
      _EXAMPLE
      | {"num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 12, "interleave_moe_layer_step": 1}
      | {"no_rope_layer_interval": 3, "attention_chunk_size": 8, "floor_scale": 6, "use_qk_norm": True}
      | {"rope_parameters": SCOUT_ROPE}
    ),
    # Maverick-like: MoE every 2nd of 4 layers, unrolled; the 4th NoPE, chunks of 7, no QK norm, plain RoPE.
    "llama4_maverick": HFExample(
      _EXAMPLE
      | {"num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}
      | {"interleave_moe_layer_step": 2, "no_rope_layer_interval": 4, "attention_chunk_size": 7, "floor_scale": 5}
      | {"use_qk_norm": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
      scan_layers=False,
    ),
  },
  moe=True,
)
