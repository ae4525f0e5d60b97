"""A training checkpoint -> a params-only checkpoint for decoding, as MaxText's script of the same name:

    python3 MaxText/generate_param_only_checkpoint.py MaxText/configs/base.yml run_name=DECODE_RUN \
      load_full_state_path=RUN/checkpoints/STEP/items [force_unroll=true]

writes {base_output_directory}/DECODE_RUN/checkpoints/0/items holding only `params` (no optimizer state),
which decode.py and train.py read with load_parameters_path. The model keys must be those of the training
run. force_unroll=true stores the layers unscanned (layers_0, layers_1, ...; DeepSeek's dense_layers_0, ...,
moe_layers_0, ...) for scan_layers=false
decoding. A LoRA run's checkpoint (lora_rank > 0) is written with its adapters merged into the weights, for
decoding with lora_rank=0 (decode.py with the run's lora keys samples with the adapters on instead). An existing
checkpoint is never overwritten.
"""

import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax

from MaxText import checkpointing, cli, lora, pyconfig, sharding, storage
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.layers import decoders, models


def unroll(params: dict, stacks: list[decoders.Stack]) -> dict:
  """Scanned params (each stack's layers on axis 0 of params[stack.name]) -> unrolled ones (params[name_<j>])."""
  out = {k: v for k, v in params.items() if k not in {stack.name for stack in stacks}}
  for stack in stacks:
    for j in range(stack.count):
      out[f"{stack.name}_{j}"] = jax.tree_util.tree_map(lambda x, j=j: x[j], params[stack.name])
  return out


def generate(config: Config) -> str:
  """Writes the params-only checkpoint; returns its path."""
  if not (config.load_full_state_path or config.load_parameters_path):
    raise ConfigError("give the training checkpoint to convert: load_full_state_path=RUN/checkpoints/STEP/items")
  target = checkpointing.checkpoint_dir(config)
  if storage.listdir(target):
    raise ConfigError(f"{target} already holds checkpoints; pick a new run_name for the params-only checkpoint")
  mesh = sharding.create_mesh(config)
  abstract, _ = state_lib.params_layout(models.Transformer(config, mesh), config, mesh)
  params, source = checkpointing.restore_params(config, abstract)
  if config.lora_rank > 0:
    merged = pyconfig.replace(config, lora_rank=0, hf_lora_export="merged", hf_lora_adapter_path="")
    _, shardings = state_lib.params_layout(models.Transformer(merged, mesh), merged, mesh)
    params = jax.jit(lambda p: lora.merge(p, config), out_shardings=shardings)(params)
    config = merged
  if config.force_unroll and config.scan_layers:
    unrolled = pyconfig.replace(config, scan_layers=False)
    _, shardings = state_lib.params_layout(models.Transformer(unrolled, mesh), unrolled, mesh)
    params = jax.jit(lambda p: unroll(p, decoders.layer_stacks(config)), out_shardings=shardings)(params)

  path = checkpointing.save_params(target, params)
  print(f"Wrote the params of {source} to {path}", flush=True)
  return path


def main(argv) -> int:
  return cli.run_cli(generate, argv, writes_run_dir=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
