"""Synthetic data: learnable token streams that depend only on (seed, step, row).

Row r of step s is an arithmetic progression modulo vocab_size, (a + k * d) % V, whose start a and stride d
come from a generator seeded with (data_shuffle_seed, s, r). Unlike uniform random tokens, a stream is
predictable from its first two tokens, so a model has something to learn. The global batch depends on
the seed, the step and its shape, never on the mesh: each process makes only the rows its devices hold
and the rows become one global array.
"""

import numpy as np
from jax.sharding import Mesh

from MaxText import sharding
from MaxText.common_types import Config


def synthetic_rows(seed: int, step: int, rows: range, length: int, vocab_size: int) -> dict[str, np.ndarray]:
  """The given rows of the step's global batch, each a stream of length + 1 tokens shifted into (inputs, targets)."""
  streams = np.empty((len(rows), length + 1), np.int64)
  k = np.arange(length + 1)
  for i, row in enumerate(rows):
    rng = np.random.default_rng((seed, step, row))
    start, stride = rng.integers(0, vocab_size), rng.integers(1, min(vocab_size, 64))
    streams[i] = (start + k * stride) % vocab_size
  streams = streams.astype(np.int32)
  ones = np.ones((len(rows), length), np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), (len(rows), length)).copy()
  return {
    "inputs": streams[:, :-1].copy(),
    "inputs_segmentation": ones,
    "inputs_position": positions,
    "targets": streams[:, 1:].copy(),
    "targets_segmentation": ones.copy(),
  }


class SyntheticIterator:
  """Yields the global batch of step `step`, `step + 1`, ...; its state is the next step."""

  def __init__(self, config: Config, mesh: Mesh, start_step: int = 0, batch_size: int | None = None):
    self.config = config
    self.step = start_step
    self.global_shape = (batch_size or config.global_batch_size, config.max_target_length)
    self.sharding = sharding.batch_sharding(mesh, config)
    self.rows = sharding.local_rows(self.sharding, self.global_shape)

  def __iter__(self):
    return self

  def __next__(self):
    cfg = self.config
    local = synthetic_rows(
      cfg.data_shuffle_seed, self.step, range(self.rows.start, self.rows.stop), cfg.max_target_length, cfg.vocab_size
    )
    self.step += 1
    return {k: sharding.make_global_array(v, self.sharding, self.global_shape) for k, v in local.items()}

  def get_state(self) -> dict:
    return {"step": self.step}

  def set_state(self, state: dict) -> None:
    self.step = int(state["step"])
