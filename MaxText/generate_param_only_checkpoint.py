"""A training checkpoint -> a params-only checkpoint for decoding, as MaxText's script of the same name:

    python3 MaxText/generate_param_only_checkpoint.py MaxText/configs/base.yml run_name=DECODE_RUN \
      load_full_state_path=RUN/checkpoints/STEP/items [force_unroll=true]

writes {base_output_directory}/DECODE_RUN/checkpoints/0/items holding only `params` (no optimizer state),
which decode.py and train.py read with load_parameters_path. The model keys must be those of the training
run. force_unroll=true stores the layers unscanned (layers_0, layers_1, ...) for scan_layers=false
decoding. An existing checkpoint is never overwritten.
"""

import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax

from MaxText import checkpointing, cli, sharding, storage
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.layers import models


def unroll(params: dict, num_layers: int) -> dict:
  """Scanned params (params["layers"], layers stacked on axis 0) -> unrolled ones (params["layers_<i>"])."""
  out = {k: v for k, v in params.items() if k != "layers"}
  for i in range(num_layers):
    out[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], params["layers"])
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
  if config.force_unroll and config.scan_layers:
    unrolled = config.replace(scan_layers=False)
    _, shardings = state_lib.params_layout(models.Transformer(unrolled, mesh), unrolled, mesh)
    params = jax.jit(lambda p: unroll(p, config.num_decoder_layers), out_shardings=shardings)(params)

  path = checkpointing.save_params(target, params)
  print(f"Wrote the params of {source} to {path}", flush=True)
  return path


def main(argv) -> int:
  return cli.run_cli(generate, argv, writes_run_dir=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
