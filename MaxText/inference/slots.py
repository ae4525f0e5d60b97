"""The decode slots' state: on the device (`Slots`, what a generate call carries from step to step) and its numpy
mirror on the host (`empty_slots`), one row per slot, with each request's sampling settings (`sampling_of`)."""

import jax
import numpy as np
from flax import struct

from MaxText.inference.request import MAX_STOP_IDS, Request

SAMPLING = ("seeds", "temperature", "top_k", "top_p")  # a request's sampling settings, as the programs take them


@struct.dataclass
class Slots:
  """The decode slots on the device, one row each ([slots] unless said)."""

  last: jax.Array  # int32: the newest token, the next step's input (its keys are not cached yet)
  lengths: jax.Array  # int32: tokens in the cache, which is also `last`'s position
  active: jax.Array  # bool: generating
  budget: jax.Array  # int32: tokens it may still generate
  counter: jax.Array  # int32: tokens sampled so far (the index its key is folded with)
  seeds: jax.Array  # uint32 [slots, 2]: the request's seed, its low and high 32 bits
  temperature: jax.Array  # float32
  top_k: jax.Array  # int32
  top_p: jax.Array  # float32
  stop_ids: jax.Array  # int32 [slots, MAX_STOP_IDS], -1 padded


def empty_slots(n: int) -> dict[str, np.ndarray]:
  return {
    "last": np.zeros(n, np.int32),
    "lengths": np.zeros(n, np.int32),
    "active": np.zeros(n, bool),
    "budget": np.zeros(n, np.int32),
    "counter": np.zeros(n, np.int32),
    "seeds": np.zeros((n, 2), np.uint32),
    "temperature": np.zeros(n, np.float32),
    "top_k": np.zeros(n, np.int32),
    "top_p": np.ones(n, np.float32),
    "stop_ids": np.full((n, MAX_STOP_IDS), -1, np.int32),
  }


def sampling_of(request: Request, seed: int) -> dict[str, np.ndarray]:
  """A request's sampling settings as one row of the programs' arrays."""
  return {
    "seeds": np.asarray([[seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF]], np.uint32),
    "temperature": np.asarray([request.temperature], np.float32),
    "top_k": np.asarray([request.top_k], np.int32),
    "top_p": np.asarray([request.top_p], np.float32),
  }
