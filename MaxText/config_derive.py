"""Configuration, part three: the derived values. From typed values that config_validate has accepted and the device
topology, every value the run computes rather than reads: the model's dimensions (global_parameter_scale), the
training objective, the schedule's steps, the mesh (ICI x DCN), the global batch sizes, the pipeline's layout, and
the family's own keys. This is the one place they are computed; the checks that need them (does each sharded
dimension split over its mesh axes?) are config_validate's `check_derived`.
"""

import math
from collections.abc import Mapping

from MaxText import families

# Mesh axes of the parallelism keys: `ici_<name>_parallelism` and `dcn_<name>_parallelism` set the size
# of mesh axis <axis>. Only these keys name mesh axes outside `logical_axis_rules`.
PARALLELISM_AXES = {
  "data": "data",
  "pipeline": "stage",
  "fsdp": "fsdp",
  "sequence": "sequence",
  "context": "context",
  "tensor": "tensor",
  "expert": "expert",
}
NAME_OF_AXIS = {axis: name for name, axis in PARALLELISM_AXES.items()}  # mesh axis -> its *_parallelism keys' name
# MaxText's keys for three training objectives (the `objective` key names any of MaxText/objectives/).
OBJECTIVE_FLAGS = {"use_rl": "rl", "use_dpo": "dpo", "use_sft": "sft"}


def derive(values: Mapping, num_devices: int, num_slices: int = 1) -> dict:
  """Every derived value but the family's (`family_keys`), from values that config_validate's `validate` and
  `check_topology` have accepted. Model shapes follow MaxText's global_parameter_scale; the mesh is ICI x DCN;
  batch sizes are global."""
  d = model_dims(values)
  d |= objective_keys(values)
  d |= schedule(values)
  d |= _mesh(values, num_devices, num_slices)
  d |= _batches(values, num_devices)
  d |= _pipeline(values, d)
  return d


def objective(values: Mapping) -> str:
  """The training objective's name: `objective`, else the one a MaxText flag (use_sft, use_dpo, use_rl) names,
  else lm (config_validate refuses flags that disagree)."""
  flagged = [name for key, name in OBJECTIVE_FLAGS.items() if values[key]]
  return values["objective"] or (flagged[0] if flagged else "lm")


def objective_keys(values: Mapping) -> dict:
  """`objective` resolved, and MaxText's flags agreeing with it."""
  name = objective(values)
  return {"objective": name} | {key: name == flagged for key, flagged in OBJECTIVE_FLAGS.items()}


def family_keys(values: Mapping, d: Mapping) -> dict:
  """The keys the family adds, computed from the values and the derived values `d`. A family adds keys; it never
  changes those of base.yml or of `derive`."""
  family = families.get(values["decoder_block"])
  extra = family.derive({**values, **d})
  taken = sorted(set(extra) & (set(values) | set(d)))
  if taken:
    raise ValueError(f"family {family.name} derives {taken}, which exist already; give its keys names of their own")
  return extra


def scales(global_parameter_scale: int) -> tuple[int, int, int, int]:
  """MaxText's split of a power-of-2 scale into (emb, heads, mlp, layers) powers of 2: log2(scale) = 3*base + rem,
  heads and mlp growing first, then emb, then layers."""
  base, rem = divmod(int(math.log2(global_parameter_scale)), 3)
  heads = base + int(rem > 0)
  return base + int(rem > 1), heads, heads, base


def model_dims(values: Mapping) -> dict:
  """The model's dimensions: the base_* keys scaled by global_parameter_scale."""
  emb_scale, head_scale, mlp_scale, layer_scale = scales(values["global_parameter_scale"])
  return {
    "emb_dim": values["base_emb_dim"] * 2**emb_scale,
    "num_query_heads": values["base_num_query_heads"] * 2**head_scale,
    "num_kv_heads": values["base_num_kv_heads"] * 2**head_scale,
    "mlp_dim": values["base_mlp_dim"] * 2**mlp_scale,
    "moe_mlp_dim": (values["base_moe_mlp_dim"] if values["base_moe_mlp_dim"] > 0 else values["base_mlp_dim"]) * 2**mlp_scale,
    "num_decoder_layers": values["base_num_decoder_layers"] * 2**layer_scale,
  }


def schedule(values: Mapping) -> dict:
  """steps and learning_rate_schedule_steps, each -1 taking the other; the warmup in steps."""
  steps = values["learning_rate_schedule_steps"] if values["steps"] == -1 else values["steps"]
  schedule = steps if values["learning_rate_schedule_steps"] == -1 else values["learning_rate_schedule_steps"]
  warmup = int(values["warmup_steps_fraction"] * schedule)
  return {"steps": steps, "learning_rate_schedule_steps": schedule, "warmup_steps": warmup}


def parallelism(kind: str, values: Mapping, total: int) -> dict[str, int]:
  """Sizes of the `{kind}_*_parallelism` axes ("ici" or "dcn"), with the one -1 (if any) filling what the others
  leave of `total`."""
  sizes = {name: values[f"{kind}_{name}_parallelism"] for name in PARALLELISM_AXES}
  fill = [name for name, size in sizes.items() if size == -1]
  if fill:
    sizes[fill[0]] = total // math.prod(size for size in sizes.values() if size != -1)
  return sizes


def _mesh(values: Mapping, num_devices: int, num_slices: int) -> dict:
  """The mesh: ICI axes inside a slice times DCN axes across slices, in mesh_axes order."""
  ici = parallelism("ici", values, num_devices // num_slices)
  dcn = parallelism("dcn", values, num_slices)
  ici_shape = tuple(ici[NAME_OF_AXIS[axis]] for axis in values["mesh_axes"])
  dcn_shape = tuple(dcn[NAME_OF_AXIS[axis]] for axis in values["mesh_axes"])
  return {
    "ici_mesh_shape": ici_shape,
    "dcn_mesh_shape": dcn_shape,
    "mesh_shape": tuple(i * j for i, j in zip(ici_shape, dcn_shape, strict=True)),
    "num_devices": num_devices,
    "num_slices": num_slices,
  }


def _batches(values: Mapping, num_devices: int) -> dict:
  """Global batch sizes: per_device_batch_size x devices rows per micro-batch, and the eval batch."""
  micro = int(values["per_device_batch_size"] * num_devices)
  eval_per_device = values["eval_per_device_batch_size"] or values["per_device_batch_size"]
  return {
    "micro_batch_size": micro,
    "global_batch_size": micro * values["gradient_accumulation_steps"],
    "eval_batch_size": int(eval_per_device * num_devices),
  }


def last_stack_layers(values: Mapping, num_decoder_layers: int) -> int:
  """The layers of the decoder's last stack: all of them, or those after the first_num_dense_layers dense ones of a
  family with dense layers (layers/decoders.layer_stacks)."""
  family = families.get(values["decoder_block"])
  return num_decoder_layers - (values["first_num_dense_layers"] if family.dense_layers else 0)


def mesh_axis_sizes(values: Mapping, d: Mapping) -> dict[str, int]:
  """Mesh axis -> its size."""
  return dict(zip(values["mesh_axes"], d["mesh_shape"], strict=True))


def _pipeline(values: Mapping, d: Mapping) -> dict:
  """The pipeline's layers, repeats and microbatches (layers/pipeline.py); each -1 derived."""
  stages = mesh_axis_sizes(values, d)["stage"]
  last_stack = last_stack_layers(values, d["num_decoder_layers"])
  piped = values["pipeline_parallel_layers"] if values["pipeline_parallel_layers"] > 0 else last_stack
  per_stage = values["num_layers_per_pipeline_stage"]
  repeats = values["num_pipeline_repeats"] if values["num_pipeline_repeats"] > 0 else piped // max(stages * per_stage, 1)
  micro = values["num_pipeline_microbatches"] if values["num_pipeline_microbatches"] > 0 else stages
  return {"pipeline_parallel_layers": piped, "num_pipeline_repeats": repeats, "num_pipeline_microbatches": micro}
