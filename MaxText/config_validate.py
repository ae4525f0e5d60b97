"""Configuration, part two: the checks. Every rule a config must keep, grouped by what it is about, each raising
`ConfigError` with the key, the value and the fix:

  validate(values)                          -> the checks that need no devices (config_parse's typed values)
  check_topology(values, devices, slices)   -> the parallelism keys and the batch against the devices
  check_derived(values, derived)            -> what only the derived values tell: the pipeline's layout, and
                                               every sharded dimension splitting over its mesh axes

Keys with a fixed set of values are checked against `choices`: each component's section (MaxText/sections/: its keys,
their valid values and its rules, with neither jax nor flax imported), the kernels' capability table and the model
families. Each section's `check` runs with the rest. This module checks; it computes nothing the run uses
(config_derive does).
"""

import math
import os
from collections.abc import Collection, Mapping, Sequence

from MaxText import families, kernel_capabilities, objectives, sections, storage
from MaxText.common_types import Config, ConfigError, cut, shown, thaw
from MaxText.config_derive import (
  NAME_OF_AXIS,
  OBJECTIVE_FLAGS,
  PARALLELISM_AXES,
  last_stack_layers,
  mesh_axis_sizes,
  model_dims,
)
from MaxText.config_derive import objective as config_objective
from MaxText.config_parse import PATH_KEYS
from MaxText.sections import layers as layers_section
from MaxText.sections import reinforcement

# `hardware` -> the JAX platform it runs on (cli.configure_jax sets jax_platforms from it).
HARDWARE_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def choices() -> dict[str, Collection[str]]:
  """Each key with a fixed set of values -> those values, read from the module that owns them (at call time, so
  a family registered after import counts): the sections' (MaxText/sections/), the kernels' and the families'."""
  return {
    "hardware": HARDWARE_PLATFORMS,
    "attention": kernel_capabilities.CHOICES,
    "decoder_block": families.FAMILIES,
    "attention_type": sorted({family.attention_type for family in families.FAMILIES.values()}),
    **{key: valid for section in sections.all() for key, valid in section.choices.items()},
  }


def validate(values: Mapping) -> None:
  """Checks that need no devices: choices, names and paths, the model's shape, each section's rules (training's
  among them), the objective, the layers, the axis rules, and the family's own."""
  _check_choices(values)
  _check_run_name(values)
  _check_path_names(values)
  _check_local_paths(values)
  _check_model(values)
  _check_scale(values)
  with_dims = {**values, **model_dims(values)}  # what a section's check sees (sections.Section.check)
  for section in sections.all():
    section.check(with_dims)
  _check_objective(values)
  _check_post_training(values)
  _check_rl(values)
  _check_evaluation_and_checkpoints(values)
  _check_axis_rules(values)
  _check_attention(values)
  _check_layers(values)
  _check_moe(values)
  families.get(values["decoder_block"]).check(values)


# ------------------------------------------------------------------------------------------ fixed choices
def _check_choices(values: Mapping) -> None:
  for key, valid in choices().items():
    if values[key] not in valid:
      raise ConfigError(f"{key}={shown(values[key])} is not supported; choose one of {', '.join(map(repr, valid))}")
  _check_clamped_swiglu(values)


def _check_clamped_swiglu(values: Mapping) -> None:
  """mlp_activations_limit > 0 is gpt-oss's clamped SwiGLU (linears.gated_activation): of its activations, in a
  family whose layer has it."""
  limit, acts = values["mlp_activations_limit"], list(values["mlp_activations"])
  if limit <= 0:
    return
  if not families.get(values["decoder_block"]).clamped_swiglu:
    raise ConfigError(
      f"mlp_activations_limit={limit} is gpt-oss's clamped SwiGLU, which decoder_block={values['decoder_block']} "
      "has not (gpt_oss has); set mlp_activations_limit=-1"
    )
  if tuple(acts) != layers_section.CLAMPED_SWIGLU:
    raise ConfigError(
      f"mlp_activations_limit={limit} is gpt-oss's clamped SwiGLU, of mlp_activations={list(layers_section.CLAMPED_SWIGLU)} "
      f"(now {acts}); set those, or mlp_activations_limit=-1"
    )


# ------------------------------------------------------------------------------------------ names and paths
def _check_run_name(values: Mapping) -> None:
  """run_name names one folder under base_output_directory, so nothing that leads anywhere else."""
  name = values["run_name"]
  if "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in name):
    raise ConfigError(
      f"run_name={shown(name)} must be one plain folder name: no '/' or '\\', not '.' or '..', no control characters "
      "(it names the run's folder under base_output_directory)"
    )


# Longest file or folder name, and longest path, in bytes (Linux's NAME_MAX and PATH_MAX less the NUL; macOS's
# NAME_MAX is 255 too): beyond them every open fails with ENAMETOOLONG, some only after the run has started.
NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095


def _check_path_names(values: Mapping) -> None:
  """run_name and the local paths of PATH_KEYS: names the file system takes (the bytes of each name, as os.fsencode
  encodes it, within NAME_MAX_BYTES; no NUL character)."""
  paths = [("run_name", values["run_name"])]
  paths += [(key, values[key]) for key in PATH_KEYS if values[key] and not storage.is_remote(values[key])]
  for key, path in paths:
    try:
      encoded = os.fsencode(path)
    except UnicodeEncodeError:
      raise ConfigError(f"{key}={shown(path)} cannot be encoded as a file name; use characters of your locale") from None
    if b"\0" in encoded:
      raise ConfigError(f"{key}={shown(path)} holds a NUL character, which no file name may; remove it")
    if len(encoded) > PATH_MAX_BYTES:
      raise ConfigError(f"{key}={shown(path)} is {len(encoded)} bytes long; a path may have {PATH_MAX_BYTES}")
    for name in encoded.split(b"/"):
      if len(name) > NAME_MAX_BYTES:
        raise ConfigError(
          f"{key}={shown(path)}: the name {shown(os.fsdecode(name), 60)} is {len(name)} bytes long; a file or folder "
          f"name may have {NAME_MAX_BYTES} bytes, so shorten it"
        )


def _check_local_paths(values: Mapping) -> None:
  """Paths read by libraries that take local files only (SentencePiece, safetensors, the HF folder layout)."""
  for key in ("tokenizer_path", "hf_model_path"):
    if storage.is_remote(values[key]):
      raise ConfigError(
        f"{key}={cut(values[key])} must be a local path; copy it first (e.g. gsutil -m cp -r {cut(values[key])} .) or use a "
        "gcsfuse mount"
      )


# ------------------------------------------------------------------------------------------ the model's shape
def _check_positive(values: Mapping, keys: Sequence[str]) -> None:
  for key in keys:
    if values[key] <= 0:
      raise ConfigError(f"{key}={shown(values[key])} must be positive")


def _check_model(values: Mapping) -> None:
  shape = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers")
  _check_positive(values, (*shape, "head_dim", "vocab_size", "max_target_length"))
  _check_positive(values, ("rope_min_timescale", "rope_max_timescale", "rope_scaling_factor"))
  if values["rope_type"] == "yarn":
    _check_positive(values, ("original_max_position_embeddings", "rope_factor", "beta_fast", "beta_slow"))
  if values["vocab_size"] >= 2**31:
    raise ConfigError(f"vocab_size={values['vocab_size']} does not fit the int32 token ids; give a size below 2**31")
  if values["base_num_query_heads"] % values["base_num_kv_heads"]:
    raise ConfigError(
      f"base_num_query_heads={values['base_num_query_heads']} is not a multiple of "
      f"base_num_kv_heads={values['base_num_kv_heads']}; grouped-query attention needs whole groups"
    )
  if values["fused_qkv"] and values["base_num_query_heads"] != values["base_num_kv_heads"]:
    raise ConfigError(
      f"fused_qkv=true needs base_num_kv_heads == base_num_query_heads (now {values['base_num_kv_heads']} and "
      f"{values['base_num_query_heads']}): its one matmul makes queries, keys and values of one shape; set fused_qkv=false"
    )
  tiles, length = values["num_vocab_tiling"], values["max_target_length"]
  if tiles < 1 or length % tiles:
    raise ConfigError(
      f"num_vocab_tiling={tiles} must be a positive divisor of max_target_length={length}: each chunk takes every "
      "row's tokens j, j + n, ...; choose e.g. num_vocab_tiling=4"
    )
  if not 0.0 <= values["dropout_rate"] < 1.0:
    raise ConfigError(f"dropout_rate={values['dropout_rate']} must be in [0, 1)")
  if values["rope_high_freq_factor"] < values["rope_low_freq_factor"]:  # equal: no blended band (Llama 4 Scout)
    raise ConfigError(
      f"rope_high_freq_factor={values['rope_high_freq_factor']} must be at least "
      f"rope_low_freq_factor={values['rope_low_freq_factor']}"
    )


def _check_scale(values: Mapping) -> None:
  """global_parameter_scale multiplies the model's dimensions by powers of 2 (config_derive.scales)."""
  scale = values["global_parameter_scale"]
  if scale <= 0 or 2 ** int(math.log2(scale)) != scale:
    raise ConfigError(f"global_parameter_scale={scale} is not a power of 2; use 1, 2, 4, ...")


# ------------------------------------------------------------------------------------------ training
def _objective_said(values: Mapping) -> str:
  """How the config names its training objective: "objective=dpo", or MaxText's "use_dpo=true"."""
  if values["objective"]:
    return f"objective={values['objective']}"
  return next((f"{key}=true" for key in OBJECTIVE_FLAGS if values[key]), "objective=lm")


def _check_objective(values: Mapping) -> None:
  """One training objective, of those MaxText/objectives/ holds (or a test registers)."""
  said = [f"objective={values['objective']}"] if values["objective"] else []
  said += [f"{key}=true" for key in OBJECTIVE_FLAGS if values[key]]
  named = {values["objective"]} - {""} | {OBJECTIVE_FLAGS[key] for key in OBJECTIVE_FLAGS if values[key]}
  if len(named) > 1:
    raise ConfigError(f"{' and '.join(said)}: a run trains for one objective; set one")
  if values["objective"]:
    objectives.check_name(values["objective"])


def _check_post_training(values: Mapping) -> None:
  """Supervised fine-tuning and DPO: their data, and what DPO's loss needs."""
  objective, said = config_objective(values), _objective_said(values)
  if objective == "sft" and values["dataset_type"] == "synthetic":
    raise ConfigError(f"{said} trains on conversations; set dataset_type to grain, tfds or hf")
  if objective != "dpo":
    return
  if values["dataset_type"] == "synthetic":
    raise ConfigError(f"{said} trains on preference pairs; set dataset_type to grain, tfds or hf")
  if values["num_vocab_tiling"] > 1:
    raise ConfigError(f"num_vocab_tiling={values['num_vocab_tiling']}: DPO computes whole logits; set num_vocab_tiling=1")


def _check_rl(values: Mapping) -> None:
  """Reinforcement learning, when the run trains with it: a reward and groups (sections.reinforcement's
  check_rewards), its data, the sampling that makes groups differ, and steps in whole batches of rollouts (the
  section has checked the loss's numbers)."""
  if config_objective(values) != "rl":
    return
  reinforcement.check_rewards(values, _objective_said(values))
  if values["dataset_type"] == "synthetic":
    raise ConfigError(f"{_objective_said(values)} samples completions of prompts; set dataset_type to grain, tfds or hf")
  top_1 = values["decode_sampling_strategy"] == "topk" and values["decode_sampling_top_k"] == 1
  if values["decode_sampling_strategy"] == "greedy" or values["decode_sampling_temperature"] == 0 or top_1:
    raise ConfigError(
      f"decode_sampling_strategy={values['decode_sampling_strategy']}, decode_sampling_temperature="
      f"{values['decode_sampling_temperature']}, decode_sampling_top_k={values['decode_sampling_top_k']}: greedy "
      "rollouts make a group's completions all the same; set decode_sampling_strategy=weighted (or nucleus, topk "
      "with top_k > 1) with a temperature > 0"
    )
  mu = values["num_iterations"]
  counts = {"steps": values["learning_rate_schedule_steps"] if values["steps"] == -1 else values["steps"]}
  if values["enable_checkpointing"]:
    counts["checkpoint_period"] = values["checkpoint_period"]
  for key, count in counts.items():
    if count % mu:
      raise ConfigError(
        f"{key}={values[key]} ({count} steps) is not a multiple of num_iterations={mu}: a run stops and saves only "
        f"between batches of rollouts; give a multiple of {mu}"
      )
  if values["num_vocab_tiling"] > 1:
    raise ConfigError(f"num_vocab_tiling={values['num_vocab_tiling']}: RL computes whole logits; set num_vocab_tiling=1")


def _check_evaluation_and_checkpoints(values: Mapping) -> None:
  """Evaluation, the checkpoints to keep and to load, and the seeds."""
  if values["eval_interval"] > 0 and values["eval_steps"] < 1 and values["dataset_type"] == "synthetic":
    raise ConfigError(f"eval_steps={values['eval_steps']}: synthetic data has no end; set eval_steps to a positive count")
  if values["eval_per_device_batch_size"] < 0:
    raise ConfigError(
      f"eval_per_device_batch_size={values['eval_per_device_batch_size']} must be >= 0 (0: per_device_batch_size)"
    )
  if values["max_num_checkpoints_to_keep"] < 0:
    raise ConfigError(
      f"max_num_checkpoints_to_keep={values['max_num_checkpoints_to_keep']} is negative; give a count (0 keeps all)"
    )
  for key in ("init_weights_seed", "decode_sampling_seed"):  # jax.random.key takes a 32-bit seed.
    if not -(2**31) <= values[key] < 2**32:
      raise ConfigError(f"{key}={shown(values[key])} does not fit 32 bits; give a seed in [-2**31, 2**32)")
  if values["load_parameters_path"] and values["load_full_state_path"]:
    raise ConfigError("load_parameters_path and load_full_state_path are both set; give at most one")


# ------------------------------------------------------------------------------------------ the layers
def _check_layers(values: Mapping) -> None:
  """The family's layer kinds: its attention (attention_type; MaxText's key, which the family decides) and how
  many dense layers come before its MoE layers."""
  block = values["decoder_block"]
  family = families.get(block)
  if values["attention_type"] != family.attention_type:
    raise ConfigError(
      f"attention_type={shown(values['attention_type'])}: decoder_block={block} needs "
      f"attention_type={family.attention_type!r}"
    )
  first, layers = values["first_num_dense_layers"], values["base_num_decoder_layers"]
  if first and not family.dense_layers:
    with_dense = ", ".join(name for name, f in families.FAMILIES.items() if f.dense_layers)
    raise ConfigError(
      f"first_num_dense_layers={first}: decoder_block={block} has no dense layers; set it to 0 ({with_dense} has)"
    )
  if not 0 <= first < layers:
    raise ConfigError(
      f"first_num_dense_layers={first} must be in [0, base_num_decoder_layers={layers}): a mixture-of-experts "
      "family needs at least one MoE layer"
    )


def _check_moe(values: Mapping) -> None:
  """A mixture-of-experts family needs experts to route to; a dense one has none. Then the router's keys."""
  n, k, block = values["num_experts"], values["num_experts_per_tok"], values["decoder_block"]
  if families.get(block).moe:
    if n < 2:
      raise ConfigError(f"num_experts={n}: decoder_block={block} is a mixture of experts; give num_experts >= 2")
    if not 1 <= k <= n:
      raise ConfigError(f"num_experts_per_tok={k} must be in [1, num_experts={n}]")
    if values["base_moe_mlp_dim"] == 0 or values["base_moe_mlp_dim"] < -1:
      raise ConfigError(f"base_moe_mlp_dim={values['base_moe_mlp_dim']} must be positive, or -1 to take base_mlp_dim")
  elif n != 1:
    moe_families = [name for name, family in families.FAMILIES.items() if family.moe]
    raise ConfigError(
      f"num_experts={n}: decoder_block={block} has a dense MLP; set num_experts=1 or use a mixture-of-experts family "
      f"({', '.join(moe_families)})"
    )
  _check_router(values)


def _check_router(values: Mapping) -> None:
  """A bias on the router's logits, which only some families' layers have (the router's own rules, sigmoid
  routing's bias and groups (DeepSeek-V3) and the router's weights, are sections.router's)."""
  sigmoid_bias = values["routed_bias"] and values["routed_score_func"] == "sigmoid"
  family = families.get(values["decoder_block"])
  if values["routed_bias"] and not sigmoid_bias and not family.router_logit_bias:
    raise ConfigError(
      f"routed_bias=true under softmax routing is a bias on the router's logits, which decoder_block="
      f"{values['decoder_block']} has not (gpt_oss has); set routed_score_func=sigmoid (DeepSeek-V3's choice bias) or "
      "routed_bias=false"
    )


def _check_attention(values: Mapping) -> None:
  """What the chosen attention kernel cannot do, known before any device work: its row of the capability table
  (kernel_capabilities), which attention_kernels reads too when the step is traced, for anything only the traced
  shapes tell. autoselected picks a kernel that runs each call, so it has nothing to refuse here."""
  name = values["attention"]
  kernel = kernel_capabilities.CAPABILITIES.get(name)
  if kernel is None:
    return
  if values["hardware"] not in kernel.platforms:
    raise ConfigError(
      f"attention={name} is {kernel.title}, for {kernel.where}; set hardware={kernel.platforms[0]}, or use "
      f"attention={kernel.instead[0]}"
    )
  head_dim = values["head_dim"]
  if values["attention_type"] == "mla":  # the width MLA gives the kernel (attention_mla.py pads to it)
    head_dim = max(values["qk_nope_head_dim"] + values["qk_rope_head_dim"], values["v_head_dim"])
  call = kernel_capabilities.Call(
    length=values["max_target_length"],
    head_dim=head_dim,
    dtype=values["dtype"],
    cap=values["attn_logits_soft_cap"],
    windowed=values["sliding_window_size"] > 0,
    sinks=bool(families.get(values["decoder_block"]).attention_sinks),
    chunked=values["chunk_attn_window_size"] > 0,
  )
  reason = kernel.refusal(call)
  if reason:
    raise kernel.refused(reason)
  tiles = kernel.tiles.get("tpu" if values["compile_topology"] else values["hardware"])
  if tiles is not None:
    tiles(Config(values), values["max_target_length"])


# ------------------------------------------------------------------------------------------ mesh axes
def _check_axis_rules(values: Mapping) -> None:
  if sorted(values["mesh_axes"]) != sorted(PARALLELISM_AXES.values()):
    raise ConfigError(
      f"mesh_axes={shown(thaw(values['mesh_axes']))} must be an ordering of {sorted(PARALLELISM_AXES.values())}"
    )
  for rule in values["logical_axis_rules"]:
    if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
      raise ConfigError(f"logical_axis_rules entry {shown(thaw(rule))} is not [logical_name, [mesh_axes]]")
    for axis in _rule_axes(rule[1]):
      if axis not in values["mesh_axes"]:
        raise ConfigError(
          f"logical_axis_rules maps {shown(rule[0])} to unknown mesh axis {shown(axis)}; use one of "
          f"{list(values['mesh_axes'])}"
        )


def _rule_axes(mesh_axes) -> tuple[str, ...]:
  """The mesh axes of one rule's right-hand side: an axis name, or a list of them."""
  return mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)


def _rule_of(values: Mapping, logical: str) -> tuple[str, ...]:
  """The mesh axes of a logical name's first rule in logical_axis_rules."""
  rule = next((mesh_axes for name, mesh_axes in values["logical_axis_rules"] if name == logical), ())
  return _rule_axes(rule) if rule else ()


# ------------------------------------------------------------------------------------------ the devices
def check_topology(values: Mapping, num_devices: int, num_slices: int) -> None:
  """The parallelism keys against the devices (ICI inside a slice, DCN across slices), and the batch: a whole
  number of sequences over the devices."""
  if num_devices % num_slices:
    raise ConfigError(f"{num_devices} devices do not split evenly into {num_slices} slices")
  _check_parallelism("ici", values, num_devices // num_slices)
  _check_parallelism("dcn", values, num_slices)
  micro = values["per_device_batch_size"] * num_devices
  if micro < 1 or not float(micro).is_integer():
    raise ConfigError(
      f"per_device_batch_size={values['per_device_batch_size']} x {num_devices} devices = {micro} is not a whole "
      "number of sequences; choose a per_device_batch_size that gives one"
    )
  eval_per_device = values["eval_per_device_batch_size"] or values["per_device_batch_size"]
  eval_batch = eval_per_device * num_devices
  if eval_batch < 1 or not float(eval_batch).is_integer():
    raise ConfigError(
      f"eval_per_device_batch_size={eval_per_device} x {num_devices} devices = {eval_batch} is not a whole number "
      "of sequences; choose another eval_per_device_batch_size"
    )


def _check_parallelism(kind: str, values: Mapping, total: int) -> None:
  """The `{kind}_*_parallelism` sizes: positive or one -1 filling the rest, their product `total`."""
  sizes = {name: values[f"{kind}_{name}_parallelism"] for name in PARALLELISM_AXES}
  fill = [name for name, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ConfigError(
      f"{kind}_{fill[0]}_parallelism and {kind}_{fill[1]}_parallelism are both -1; at most one {kind} axis may be -1"
    )
  for name, size in sizes.items():
    if size == 0 or size < -1:
      raise ConfigError(f"{kind}_{name}_parallelism={size} must be positive or -1")
  known = math.prod(size for size in sizes.values() if size != -1)
  unit = "devices per slice" if kind == "ici" else "slices (DCN granules: TPU slices, else processes)"
  given = " x ".join(f"{kind}_{name}_parallelism={size}" for name, size in sizes.items() if size > 1)
  given = given or f"every {kind}_*_parallelism=1"
  if fill and total % known:
    raise ConfigError(
      f"{given} does not divide the {total} {unit} ({kind}_{fill[0]}_parallelism=-1 fills the rest); "
      f"choose {kind}_*_parallelism values whose product divides {total}"
    )
  if not fill and known != total:
    raise ConfigError(
      f"{given} makes {known}, not the {total} {unit}; make the product {total}, "
      f"or set one {kind}_*_parallelism to -1 to fill"
    )


# ------------------------------------------------------------------------------------------ the derived values
def check_derived(values: Mapping, d: Mapping) -> None:
  """What only the derived values `d` (config_derive.derive's) tell: the pipeline's layout, and each sharded
  dimension splitting evenly over the mesh axes its logical name maps to in logical_axis_rules (a jitted array
  cannot be split unevenly)."""
  _check_pipeline(values, d)
  _check_dimension_splits(values, d)
  _check_sequence_splits(values, d)
  _check_batch_splits(values, d)


def _check_pipeline(values: Mapping, d: Mapping) -> None:
  """The pipeline's layers, repeats and microbatches (layers/pipeline.py) against the model and the batch."""
  stages = mesh_axis_sizes(values, d)["stage"]
  if stages == 1:
    return
  layers, last_stack = d["num_decoder_layers"], last_stack_layers(values, d["num_decoder_layers"])
  piped, micro, per_stage = (
    d["pipeline_parallel_layers"],
    d["num_pipeline_microbatches"],
    values["num_layers_per_pipeline_stage"],
  )
  ici, dcn = values["ici_pipeline_parallelism"], values["dcn_pipeline_parallelism"]
  given = f"{stages} stages (ici_pipeline_parallelism={ici}, dcn_pipeline_parallelism={dcn})"
  if not 0 < piped <= last_stack:
    raise ConfigError(f"pipeline_parallel_layers={piped}: the pipeline takes 1 to {last_stack} layers (the last stack's)")
  if per_stage < 1 or stages * per_stage * d["num_pipeline_repeats"] != piped:
    raise ConfigError(
      f"the {piped} pipelined layers (pipeline_parallel_layers) must be {given} x num_layers_per_pipeline_stage="
      f"{per_stage} x num_pipeline_repeats={values['num_pipeline_repeats']} (-1: derived); choose values whose "
      f"product is {piped}"
    )
  stacks = [layers - last_stack, last_stack] if last_stack < layers else [layers]
  if any(count % stages for count in stacks if count):
    raise ConfigError(
      f"{given}: the layer stacks of {', '.join(map(str, (c for c in stacks if c)))} layers must split evenly over the "
      "stages (their weights are sharded over them); change the pipeline parallelism or first_num_dense_layers"
    )
  if micro % stages:
    raise ConfigError(f"num_pipeline_microbatches={micro} must be a multiple of the {given}")
  for key, rows in (("per_device_batch_size", d["micro_batch_size"]), ("eval_per_device_batch_size", d["eval_batch_size"])):
    if rows % micro:
      raise ConfigError(
        f"{key} gives batches of {rows} rows, which num_pipeline_microbatches={micro} does not divide; raise {key} or "
        "change num_pipeline_microbatches"
      )


def _check_dimension_splits(values: Mapping, d: Mapping) -> None:
  """The model's sharded dimensions over the mesh axes of their logical names."""
  dims = (
    ("num_query_heads", d["num_query_heads"], "heads"),
    ("num_kv_heads", d["num_kv_heads"], "kv_heads"),
    ("mlp_dim", d["mlp_dim"], "mlp"),
    ("max_target_length", values["max_target_length"], "activation_length"),
  )
  if values["num_experts"] > 1:
    dims += (("moe_mlp_dim", d["moe_mlp_dim"], "mlp"), ("num_experts", values["num_experts"], "exp"))
  if values["attention_type"] == "mla":
    dims += (("kv_lora_rank", values["kv_lora_rank"], "kv_lora"),)
    if values["q_lora_rank"] > 0:
      dims += (("q_lora_rank", values["q_lora_rank"], "q_lora"),)
  for key, size, logical in dims:
    shards, axes = _shards(values, d, logical)
    if size % shards:
      raise ConfigError(
        f"{key}={size} does not split over the {shards} shards of the mesh axes of {logical}: {axes}; make the product "
        f"of these parallelism values divide {size}"
      )


def _check_sequence_splits(values: Mapping, d: Mapping) -> None:
  """Sequences split over devices (context parallelism): what runs with it."""
  shards, axes = _shards(values, d, "activation_length")
  if shards == 1:
    return
  if values["context_parallel_load_balance"] and values["max_target_length"] % (2 * shards):
    raise ConfigError(
      f"context_parallel_load_balance: max_target_length={values['max_target_length']} does not split into 2 x "
      f"{shards} chunks for the {shards} sequence shards of {axes}; make it a multiple of {2 * shards}, or set "
      "context_parallel_load_balance=false"
    )
  if values["context_parallel_load_balance"] and values["capacity_factor"] > 0:
    raise ConfigError(
      f"capacity_factor={values['capacity_factor']} drops expert assignments in token order, which "
      "context_parallel_load_balance changes; set context_parallel_load_balance=false or capacity_factor=-1 (dropless)"
    )
  stages = mesh_axis_sizes(values, d)["stage"]
  if stages > 1:
    raise ConfigError(
      f"pipeline parallelism ({stages} stages) with sequences split over {axes} is not supported yet; set the "
      "*_pipeline_parallelism or the *_context/_sequence_parallelism keys to 1"
    )
  kernel = kernel_capabilities.CAPABILITIES.get(values["attention"])
  if kernel is not None and kernel.whole_sequences:
    raise ConfigError(
      f"attention={values['attention']} ({kernel.family}) does not run under context parallelism ({axes}); use "
      f"attention={' or '.join(kernel.instead)}"
    )


def _check_batch_splits(values: Mapping, d: Mapping) -> None:
  """The batch (or each pipeline microbatch) over the mesh axes of activation_batch."""
  shards, axes = _shards(values, d, "activation_batch")
  batch_axes = _rule_of(values, "activation_batch")
  elsewhere = [f"ici_{name}_parallelism" for name, axis in PARALLELISM_AXES.items() if axis not in batch_axes]
  pieces = d["num_pipeline_microbatches"] if mesh_axis_sizes(values, d)["stage"] > 1 else 1
  for key, rows in (("per_device_batch_size", d["micro_batch_size"]), ("eval_per_device_batch_size", d["eval_batch_size"])):
    if (rows // pieces) % shards:
      what = f"pipeline microbatches of {rows // pieces} rows" if pieces > 1 else f"a batch of {rows} rows"
      raise ConfigError(
        f"{key}={values[key] or values['per_device_batch_size']} gives {what} that does not split "
        f"over the {shards} shards of the mesh axes of activation_batch: {axes}; raise {key}, or move devices to axes "
        f"that do not shard the batch ({', '.join(elsewhere)})"
      )


def _shards(values: Mapping, d: Mapping, logical: str) -> tuple[int, str]:
  """How many shards a logical name's mesh axes make, and those axes of size > 1 described with the parallelism
  keys that set them, e.g. "fsdp=4 (ici_fsdp_parallelism=-1, dcn_fsdp_parallelism=1)"."""
  axis_size = mesh_axis_sizes(values, d)
  axes = _rule_of(values, logical)
  described = []
  for axis in (a for a in axes if axis_size[a] > 1):
    keys = [f"{kind}_{NAME_OF_AXIS[axis]}_parallelism" for kind in ("ici", "dcn")]
    described.append(f"{axis}={axis_size[axis]} ({', '.join(f'{key}={values[key]}' for key in keys)})")
  return math.prod(axis_size[axis] for axis in axes), " x ".join(described)
