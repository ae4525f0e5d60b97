"""Checksums of checkpoint arrays: the device and NumPy computations agree, do not depend on sharding, add up
over chunks, and change with any single flipped bit; the data state's seal."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from MaxText import integrity


def _arrays(rng):
  return {
    "f32": rng.standard_normal((6, 50)).astype(np.float32),
    "bf16": rng.standard_normal((7, 3)).astype(ml_dtypes.bfloat16),
    "i32": rng.integers(-(2**31), 2**31 - 1, size=(9,), dtype=np.int32),
    "u8": rng.integers(0, 255, size=(4, 4), dtype=np.uint8),
    "bool": rng.random(11) > 0.5,
    "scalar": np.float32(3.5),
    "empty": np.zeros((0, 3), np.float32),
  }


def test_device_and_numpy_checksums_agree():
  host = _arrays(np.random.default_rng(0))
  recorded = integrity.record(host)
  assert recorded == integrity.record(jax.tree_util.tree_map(jnp.asarray, host))
  assert recorded["arrays"]["bf16"]["dtype"] == "bfloat16" and recorded["arrays"]["f32"]["shape"] == [6, 50]
  assert integrity.verify(recorded, host) == len(host)


@pytest.mark.mesh
def test_checksum_does_not_depend_on_sharding():
  x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
  mesh = jax.make_mesh((4, 2), ("a", "b"), devices=jax.devices()[:8])
  sharded = jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b")))
  assert len(sharded.addressable_shards) == 8
  assert integrity.record({"x": sharded}) == integrity.record({"x": x})


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_every_single_bit_flip_is_detected(dtype):
  x = np.random.default_rng(2).standard_normal(24).astype(dtype)
  recorded = integrity.record({"x": x})
  bits = x.view(np.dtype(f"u{x.dtype.itemsize}"))
  for element in range(x.size):
    for bit in range(8 * x.dtype.itemsize):
      flipped = bits.copy()
      flipped[element] ^= 1 << bit
      with pytest.raises(integrity.Mismatch, match="x differs from what was saved"):
        integrity.verify(recorded, {"x": flipped.view(x.dtype)})
  swapped = x.copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert swapped[0] != x[0]
  with pytest.raises(integrity.Mismatch):
    integrity.verify(recorded, {"x": swapped})


def test_a_missing_or_reshaped_array_is_a_mismatch():
  recorded = integrity.record({"x": np.zeros((2, 3), np.float32)})
  with pytest.raises(integrity.Mismatch, match="y has no recorded checksum"):
    integrity.verify(recorded, {"y": np.zeros((2, 3), np.float32)})
  with pytest.raises(integrity.Mismatch, match=r"saved as float32\[2, 3\] but reads as float32\[3, 2\]"):
    integrity.verify(recorded, {"x": np.zeros((3, 2), np.float32)})


@pytest.mark.parametrize("axis", [0, 1])
def test_partial_checksums_of_chunks_add_up_to_the_whole(axis):
  """What the Hugging Face importer does: one checksum summed over the chunks it writes, in any order."""
  x = np.random.default_rng(3).standard_normal((5, 6, 4)).astype(np.float32)
  total = (0, 0)
  for k in reversed(range(x.shape[axis])):
    index = (slice(None),) * axis + (slice(k, k + 1),) if axis else (k,)
    total = integrity.add(total, integrity.partial_checksum(x[index], integrity.positions(x.shape, index)))
  assert integrity.entry(total, x.dtype, x.shape) == integrity.record({"x": x})["arrays"]["x"]


def test_data_state_seal():
  state = {"next_index": 12, "worker": [1, 2]}
  sealed = integrity.seal_data(state)
  assert json.loads(integrity.open_data(sealed)) == state
  tampered = sealed.replace(b"12", b"13")
  with pytest.raises(integrity.Mismatch, match="SHA-256"):
    integrity.open_data(tampered)
  with pytest.raises(integrity.Mismatch, match="SHA-256"):
    integrity.open_data(sealed.replace(b"sha256", b"sha266"))
  with pytest.raises(integrity.Mismatch, match="not JSON"):
    integrity.open_data(sealed[:-3])
  legacy = b'{"next_index": 12}'  # saved before checksums: passed on as it is
  assert integrity.open_data(legacy) == legacy
  with pytest.raises(integrity.Mismatch, match="has no seal"):  # a checkpoint with checksums: the seal was removed
    integrity.open_data(legacy, sealed_when_saved=True)


def test_eight_byte_elements_agree_between_device_and_numpy():
  """float64 / int64 (jax_enable_x64): two words per element, low word first, in both computations."""
  rng = np.random.default_rng(4)
  host = {"f64": rng.standard_normal((3, 5)), "i64": rng.integers(-(2**62), 2**62, size=(7,))}
  with jax.enable_x64(True):
    device = jax.tree_util.tree_map(jnp.asarray, host)
    assert device["f64"].dtype == jnp.float64
    assert integrity.record(device) == integrity.record(host)
