"""Checksums of a checkpoint's arrays and data state: recorded when it is saved, verified when it is restored.

Each array's checksum is two 32-bit sums over its elements' bits, computed on the devices where the array lives:

  position-weighted: sum of bits[i] * (2 i + 1)          (any single flipped bit changes it: the weight is odd)
  mixed:             sum of fmix32(bits[i] + i * golden)  (MurmurHash3's finaliser: catches what a linear sum misses)

Both are sums of unsigned integers modulo 2**32, so they do not depend on how the array is sharded or in which
order XLA adds the shards: a state saved from 8 devices verifies when restored onto 1. The data iterator's state,
a small JSON text per process, is covered by its SHA-256.
"""

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = 1
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}  # (8-byte elements: two uint32 words, see _bits)


class Mismatch(Exception):
  """Arrays or data state that differ from what was recorded when the checkpoint was saved."""


def _bits(x: jax.Array) -> jax.Array:
  """The elements' bit patterns as uint32, in the array's own shape (no reshape: a sharded array stays where it
  is); an 8-byte element becomes two words on a new last axis, low word first (NumPy's little-endian view)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  if x.dtype.itemsize == 8:
    wide = jax.lax.bitcast_convert_type(x, jnp.uint64)
    return jnp.stack([(wide & 0xFFFFFFFF).astype(jnp.uint32), (wide >> 32).astype(jnp.uint32)], axis=-1)
  return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def _flat_positions(shape: tuple[int, ...]) -> jax.Array:
  """Each element's C-order position in an array of `shape`, modulo 2**32, built from iotas over the shape."""
  position = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    position = position + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= shape[axis]
  return position


def _fmix32(h: jax.Array) -> jax.Array:
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _checksum(x: jax.Array) -> jax.Array:
  bits = _bits(x)
  i = _flat_positions(bits.shape)
  weighted = jnp.sum(bits * (2 * i + 1), dtype=jnp.uint32)
  mixed = jnp.sum(_fmix32(bits + i * jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)
  return jnp.stack([weighted, mixed])


@jax.jit
def _checksums(leaves: list) -> jax.Array:
  return jnp.stack([_checksum(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def leaf_name(path) -> str:
  """Orbax's name of a pytree leaf: its keys joined by dots (e.g. params.decoder_norm.scale)."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def _host_checksum(x: np.ndarray, chunk: int = 1 << 22) -> tuple[int, int]:
  """_checksum of a host array in NumPy, a chunk at a time (bounded memory)."""
  x = np.ascontiguousarray(x).reshape(-1)
  sums = (0, 0)
  for start in range(0, x.size, chunk):
    part = x[start : start + chunk]
    sums = add(sums, partial_checksum(part, np.arange(start, start + part.size, dtype=np.uint64).astype(np.uint32)))
  return sums


def partial_checksum(values: np.ndarray, positions: np.ndarray) -> tuple[int, int]:
  """The two sums of _checksum over some elements of an array: `values` at flat `positions` (uint32, modulo 2**32)
  in the whole array. Partial sums of disjoint parts add up (`add`) to the whole array's."""
  values = np.asarray(values)
  if values.dtype.itemsize == 8:  # Two uint32 words per element, as jax.lax.bitcast_convert_type gives them.
    bits = values.reshape(-1).view(np.uint32)
    positions = (2 * positions.reshape(-1, 1).astype(np.uint32) + np.arange(2, dtype=np.uint32)).reshape(-1)
  elif values.dtype == np.bool_:
    bits = values.reshape(-1).astype(np.uint32)
  else:
    bits = values.reshape(-1).view(np.dtype(f"u{values.dtype.itemsize}")).astype(np.uint32)
  i = positions.reshape(-1).astype(np.uint32)
  weighted = int(np.sum(bits * (np.uint32(2) * i + np.uint32(1)), dtype=np.uint32))
  h = bits + i * np.uint32(0x9E3779B9)
  h ^= h >> np.uint32(16)
  h *= np.uint32(0x85EBCA6B)
  h ^= h >> np.uint32(13)
  h *= np.uint32(0xC2B2AE35)
  h ^= h >> np.uint32(16)
  return weighted, int(np.sum(h, dtype=np.uint32))


def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
  return (a[0] + b[0]) % 2**32, (a[1] + b[1]) % 2**32


def positions(shape: tuple[int, ...], index: tuple) -> np.ndarray:
  """Flat (C-order) positions, as uint32 modulo 2**32, of the elements `array[index]` selects in an array of
  `shape`, where `index` holds ints and slices of the leading axes."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  strides = np.cumprod((1, *shape[:0:-1]))[::-1]
  flat = np.zeros((), np.uint32)
  for selection, n, stride in zip(index, shape, strides, strict=True):
    along = np.arange(n, dtype=np.uint64)[selection]
    flat = (
      flat[..., None] + (along * np.uint64(stride)).astype(np.uint32)
      if np.ndim(along)
      else flat + np.uint32(int(along) * int(stride) % 2**32)
    )
  return flat


def entry(sums: tuple[int, int], dtype, shape) -> dict:
  return {"checksum": f"{sums[0]:08x}{sums[1]:08x}", "dtype": str(np.dtype(dtype)), "shape": list(shape)}


def record(tree) -> dict:
  """{"format", "arrays": {leaf name: {"checksum", "dtype", "shape"}}} of a pytree of arrays: JAX arrays are
  summed on their devices (one jitted call), NumPy arrays on the host."""
  named = jax.tree_util.tree_leaves_with_path(tree)
  on_devices = [i for i, (_, leaf) in enumerate(named) if isinstance(leaf, jax.Array)]
  sums = dict(
    zip(on_devices, np.asarray(jax.device_get(_checksums([named[i][1] for i in on_devices]))).tolist(), strict=True)
  )
  arrays = {}
  for i, (path, leaf) in enumerate(named):
    arrays[leaf_name(path)] = entry(sums[i] if i in sums else _host_checksum(np.asarray(leaf)), leaf.dtype, np.shape(leaf))
  return {"format": FORMAT, "arrays": arrays}


def verify(recorded: dict, tree) -> int:
  """Raises Mismatch naming the first array of `tree` whose checksum differs from `recorded` (or which it
  lacks); returns how many arrays were verified."""
  expected = recorded.get("arrays", {})
  actual = record(tree)["arrays"]
  for name, now in actual.items():
    then = expected.get(name)
    if then is None:
      raise Mismatch(f"{name} has no recorded checksum")
    if then["dtype"] != now["dtype"] or list(then["shape"]) != now["shape"]:
      raise Mismatch(f"{name} was saved as {then['dtype']}{then['shape']} but reads as {now['dtype']}{now['shape']}")
    if then["checksum"] != now["checksum"]:
      raise Mismatch(f"{name} differs from what was saved (checksum {now['checksum']}, recorded {then['checksum']})")
  return len(actual)


def seal_data(state) -> bytes:
  """A data iterator's state as the JSON text stored in a checkpoint, with the SHA-256 of its own text."""
  text = json.dumps(state, sort_keys=True)
  return json.dumps({"iterator_state": text, "sha256": hashlib.sha256(text.encode()).hexdigest()}).encode()


def open_data(stored: bytes | str, sealed_when_saved: bool = False) -> bytes:
  """The iterator state inside seal_data's text, verified; a state saved before checksums passes as it is, unless
  `sealed_when_saved` (its checkpoint has checksums, which came with the seal): then it has lost its seal."""
  try:
    sealed = json.loads(stored)
  except ValueError as e:
    raise Mismatch(f"the data state is not JSON ({e})") from None
  if not (isinstance(sealed, dict) and "iterator_state" in sealed):
    if sealed_when_saved:
      raise Mismatch("the data iterator's state has no seal (SHA-256), though its checkpoint was saved with one")
    return stored.encode() if isinstance(stored, str) else stored
  text = sealed["iterator_state"]
  if not isinstance(text, str) or hashlib.sha256(text.encode()).hexdigest() != sealed.get("sha256"):
    raise Mismatch("the data iterator's state differs from what was saved (SHA-256)")
  return text.encode()
