"""Times the input pipeline alone, as MaxText's standalone_dataloader.py:

    python3 MaxText/standalone_dataloader.py MaxText/configs/demo.yml [steps=200 key=value ...]

Builds the training iterator of the config (same mesh, same global arrays) and pulls `steps` batches
without training, printing batches/s, tokens/s (all rows, and non-padding targets), to set beside the
train step's consumption (tokens/s per device x devices).
"""

import sys
import time

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np

from MaxText import cli, input_pipeline, objectives, sharding


def measure(config, warmup: int = 5) -> dict:
  """Pulls config.steps batches after `warmup`; returns the rates."""
  mesh = sharding.create_mesh(config)
  objective = objectives.get(config)  # its records: documents, conversations (SFT) or preference pairs (DPO)
  input_pipeline.check(config, objective.examples)
  data = input_pipeline.create_iterator(config, mesh, examples=objective.examples)
  for _ in range(warmup):
    jax.block_until_ready(next(data))
  start, real_tokens = time.time(), 0
  for _ in range(config.steps):
    batch = jax.block_until_ready(next(data))
    masks = [jax.device_get(v) for k, v in batch.items() if k.endswith("targets_segmentation")]
    real_tokens += sum(int(np.sum(m != 0)) for m in masks)
  seconds = time.time() - start
  tokens = config.steps * config.global_batch_size * config.max_target_length * objective.sequences_per_row
  return {
    "batches_per_sec": config.steps / seconds,
    "tokens_per_sec": tokens / seconds,
    "non_padding_fraction": real_tokens / tokens,
  }


def report(config) -> None:
  rates = measure(config)
  cli.log(
    f"dataset_type={config.dataset_type}: {rates['batches_per_sec']:.1f} batches/s, "
    f"{rates['tokens_per_sec']:,.0f} tokens/s over {config.num_devices} devices "
    f"({100 * rates['non_padding_fraction']:.1f}% non-padding) for {config.steps} batches of "
    f"{config.global_batch_size} x {config.max_target_length}"
  )


def main(argv) -> int:
  return cli.run_cli(report, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
