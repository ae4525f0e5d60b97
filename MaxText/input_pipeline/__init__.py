"""Input pipelines: each yields global batches (sharded jax.Arrays) of

  inputs, inputs_segmentation, inputs_position, targets, targets_segmentation: [global_batch, length] int32

where segmentation 0 marks padding and positions restart at 0 in every packed document.
"""

from MaxText.input_pipeline.synthetic import SyntheticIterator
from MaxText.pyconfig import Config

BATCH_KEYS = ("inputs", "inputs_segmentation", "inputs_position", "targets", "targets_segmentation")


def create_iterator(config: Config, mesh, start_step: int = 0):
  """The training iterator selected by `dataset_type`, positioned to yield the batch of `start_step`."""
  if config.dataset_type == "synthetic":
    return SyntheticIterator(config, mesh, start_step)
  raise ValueError(f"dataset_type={config.dataset_type!r} has no pipeline")
