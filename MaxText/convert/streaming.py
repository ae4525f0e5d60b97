"""Reading Hugging Face safetensors and writing Orbax checkpoints a tensor (or a layer) at a time.

Peak memory is a few tensors, not the checkpoint: `HFTensors` opens a safetensors file only for the tensor
it reads (the mapping is dropped after each read), and `save_params` hands Orbax `LazyArray`s, whose chunks
(one layer of a scanned parameter, or a whole tensor) are loaded, converted and written one after another,
each into its own storage chunk. `.bin` files are never opened: unpickling runs arbitrary code.

What a tensor holds is checked as it is read, while its chunk is in memory: a NaN or an infinity is refused
(`NonFinite`, naming the tensor and counting them in all of it), unless the importer allows them
(hf_allow_non_finite_weights); integer and boolean tensors, which no float parameter can be, are refused by the
importer's plan from their stored dtype, before anything is read.
"""

import dataclasses
import glob
import json
import os
from collections.abc import Callable

import numpy as np

from MaxText.common_types import ConfigError
from MaxText.convert import mxfp4

# safetensors' dtypes a float parameter may be stored in (MXFP4 pairs are listed as "MXFP4"); the others (integers,
# booleans, float8 without a quantization_config) are refused, not cast.
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64", mxfp4.DTYPE)
# Rows read at a time when a refused tensor's non-finite values are counted in all of it.
COUNT_BLOCK_BYTES = 64 * 2**20


class NonFinite(ConfigError):
  """A tensor holds NaN or infinite values (raised while the import streams it)."""


class HFTensors:
  """The tensors of a Hugging Face model folder (`*.safetensors`, sharded or not): name -> (file, shape).

  An MXFP4-quantized weight (gpt-oss's experts: `{name}_blocks` and `{name}_scales`, convert/mxfp4.py) is listed
  under `name` alone, with the shape of the weight, and dequantized when loaded: to the importer it is the tensor
  of an unquantized checkpoint.
  """

  def __init__(self, folder: str):
    from safetensors import SafetensorError, safe_open

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
      if glob.glob(os.path.join(folder, "*.bin")):
        raise ConfigError(
          f"hf_model_path={folder} holds only .bin (pickle) weights, which are never loaded (unpickling runs code); "
          "convert them to safetensors first, e.g. save_pretrained(..., safe_serialization=True) in transformers"
        )
      raise ConfigError(f"hf_model_path={folder} has no *.safetensors files; give a Hugging Face model folder")
    self.files: dict[str, str] = {}
    self.shapes: dict[str, tuple[int, ...]] = {}
    self.dtypes: dict[str, str] = {}  # safetensors' dtype names ("F32", "BF16", "I8", ...); "MXFP4" for a pair
    for path in files:
      try:
        with safe_open(path, "numpy") as f:
          for name in f.keys():
            self.files[name] = path
            self.shapes[name] = tuple(f.get_slice(name).get_shape())
            self.dtypes[name] = f.get_slice(name).get_dtype()
      except (SafetensorError, OSError) as e:
        raise ConfigError(f"{path} is not a readable safetensors file ({e}); re-download or re-save it") from None
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
      with open(index) as f:
        missing = sorted(set(json.load(f).get("weight_map", {})) - set(self.files))
      if missing:
        raise ConfigError(f"{index} lists {missing[0]} (and {len(missing) - 1} more) that no shard holds; re-download")
    # MXFP4 name -> ((file, name) of its blocks, of its scales), which are listed under the name alone.
    self.packed: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {}
    for name, parts in mxfp4.packed_pairs(self.shapes, self.dtypes).items():
      self.packed[name] = tuple((self.files.pop(part), part) for part in parts)
      self.files[name] = self.packed[name][0][0]
      self.shapes[name] = mxfp4.dequantized_shape(self.shapes[parts[0]])
      self.dtypes[name] = mxfp4.DTYPE
      for part in parts:
        del self.shapes[part], self.dtypes[part]

  # A multimodal checkpoint's text tower (hf_families.TextTower), set by the importer: the text model's tensors are
  # stored under the tower's names, and the other towers' tensors are not the text model's (text_name).
  tower = None
  # Set by the importer from hf_allow_non_finite_weights: load() then passes NaN and infinities through.
  allow_non_finite = False

  def resolve(self, name: str) -> str | None:
    """The stored name of the text model's tensor `name`; GPT-2 checkpoints may omit the `transformer.` prefix, and
    a multimodal checkpoint stores it under its tower's prefix."""
    if name in self.files:
      return name
    for stored in [name.removeprefix("transformer."), *(self.tower.stored_names(name) if self.tower else [])]:
      if stored in self.files:
        return stored
    return None

  def text_name(self, stored: str) -> str | None:
    """The text model's name of stored tensor `stored` (itself, but for a tower's renames); None for another
    tower's tensor."""
    return stored if self.tower is None else self.tower.text_name(stored)

  def load(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The tensor `name`, or only its `rows` (a slice of axis 0); an MXFP4 one dequantized (bfloat16). NonFinite if it
    holds a NaN or an infinity (unless allow_non_finite), counted in the whole tensor."""
    array = self._load(name, rows)
    if not self.allow_non_finite and non_finite(array):
      raise self._non_finite(self.resolve(name))
    return array

  def _load(self, name: str, rows: slice | None = None) -> np.ndarray:
    stored = self.resolve(name)
    if stored not in self.packed:
      return _read(self.files[stored], stored, rows)
    if rows is not None and len(self.shapes[stored]) < 3:  # axis 0 is the blocks' last but one: rows of the whole
      return self._load(name)[rows]
    return mxfp4.dequantize(*(_read(path, part, rows) for path, part in self.packed[stored]))

  def _non_finite(self, stored: str) -> NonFinite:
    """The error for tensor `stored`, with its non-finite values counted in all of it, a block of rows at a time."""
    shape = self.shapes[stored]
    size = int(np.prod(shape))
    row_bytes = 4 * size // max(shape[0], 1) if shape else 4
    step = max(1, COUNT_BLOCK_BYTES // max(row_bytes, 1))
    blocks = [None] if len(shape) == 0 else [slice(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]
    count = sum(non_finite(self._load(stored, rows)) for rows in blocks)
    fix = "re-download or re-save it, or set hf_allow_non_finite_weights=true to import it as it is"
    if stored in self.packed:
      (_, blocks_name), (path, scales_name) = self.packed[stored]
      nan_scales = int(np.count_nonzero(_read(path, scales_name, None) == mxfp4.SCALE_NAN))
      return NonFinite(
        f"hf_model_path: tensor {stored} (MXFP4: {blocks_name}, {scales_name}) dequantizes to {count} NaN or infinite "
        f"values (of {size}; {nan_scales} scales of {mxfp4.SCALE_NAN}, E8M0's NaN; scales of 253 and 254 overflow with "
        f"the largest values); the checkpoint is damaged: {fix}"
      )
    return NonFinite(
      f"hf_model_path: tensor {stored} holds {count} NaN or infinite values (of {size}); the checkpoint is damaged: {fix}"
    )


def non_finite(array: np.ndarray) -> int:
  """How many of a float array's values are NaN or infinite (0 for any other dtype)."""
  import ml_dtypes

  if array.dtype == ml_dtypes.bfloat16:  # all exponent bits set: NaN or infinity (twice as fast as its isfinite)
    return int(np.count_nonzero((np.ascontiguousarray(array).view(np.uint16) & 0x7F80) == 0x7F80))
  if array.dtype.kind not in "fc":
    return 0
  return int(array.size - np.count_nonzero(np.isfinite(array)))


def _read(path: str, name: str, rows: slice | None) -> np.ndarray:
  """Tensor `name` of safetensors file `path`, or only its `rows` (a slice of axis 0)."""
  from safetensors import safe_open

  with safe_open(path, "numpy") as f:
    return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]


@dataclasses.dataclass
class LazyArray:
  """An array written chunk by chunk: `chunks` are (index into the array, a function loading that part)."""

  shape: tuple[int, ...]
  dtype: np.dtype
  chunks: list[tuple[tuple, Callable[[], np.ndarray]]]
  checksum: tuple[int, int] = (0, 0)  # integrity's sums over the chunks written so far
  # Refusals (ConfigError) of chunk loaders, shared by the arrays save_params writes: once one refuses what it read,
  # the other chunks are written as zeros without reading, and save_params raises it when Orbax is done. (Raised
  # inside Orbax, it would leave writer threads still writing, after the staging folder is removed, and be logged
  # with a traceback.)
  refused: list = dataclasses.field(default_factory=list)

  def load(self, index: tuple, load: Callable[[], np.ndarray]) -> np.ndarray:
    """Loads one chunk, adding it to the checksum; zeros once a chunk was refused."""
    from MaxText import integrity

    if not self.refused:
      try:
        part = np.asarray(load(), dtype=self.dtype)
      except ConfigError as e:
        self.refused.append(e)
    if self.refused:  # the part's shape: an int index drops its axis
      sizes = [len(range(*x.indices(n))) for x, n in zip(index, self.shape, strict=False) if not isinstance(x, int)]
      return np.zeros((*sizes, *self.shape[len(index) :]), self.dtype)
    self.checksum = integrity.add(self.checksum, integrity.partial_checksum(part, integrity.positions(self.shape, index)))
    return part

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def chunk_shape(self) -> tuple[int, ...]:
    """Shape of the first chunk (an int index takes one element of its axis)."""
    index = self.chunks[0][0]
    sizes = [1 if isinstance(x, int) else len(range(*x.indices(n))) for x, n in zip(index, self.shape, strict=False)]
    return (*sizes, *self.shape[len(index) :])

  def save_args(self):
    """Orbax SaveArgs whose storage chunks are this array's chunks, split along the chunked axis."""
    import orbax.checkpoint as ocp

    chunk = self.chunk_shape()
    axes = tuple(a for a, (c, n) in enumerate(zip(chunk, self.shape, strict=True)) if c != n)
    return ocp.SaveArgs(chunk_byte_size=int(np.prod(chunk)) * self.dtype.itemsize, shard_axes=axes)


def _handler():
  import orbax.checkpoint as ocp

  class LazyArrayHandler(ocp.type_handlers.NumpyHandler):
    """Orbax's numpy handler, writing a LazyArray one chunk at a time (saved as, and restored like, an array)."""

    def __init__(self):
      super().__init__(deepcopy_host_arrays=False)
      self.one_at_a_time = None  # Orbax writes all leaves concurrently; one chunk in memory at a time is the point.

    async def _open_and_write(self, value: LazyArray, tspec, ts_context):
      import asyncio

      import tensorstore as ts

      self.one_at_a_time = self.one_at_a_time or asyncio.Lock()
      store = await ts.open(ts.Spec(tspec), create=True, open=True, context=ts_context)
      for index, load in value.chunks:
        async with self.one_at_a_time:
          await store[index].write(value.load(index, load), can_reference_source_data_indefinitely=True)

  return LazyArrayHandler()


def save_params(path: str, params: dict) -> dict:
  """Writes {"params": params} (a tree of LazyArray) as an Orbax PyTree checkpoint at `path`, each storage chunk
  being one LazyArray chunk; returns the integrity.record of what it wrote."""
  import jax
  import orbax.checkpoint as ocp

  registry = ocp.type_handlers.create_type_handler_registry((LazyArray, _handler()))
  is_lazy = lambda x: isinstance(x, LazyArray)  # noqa: E731
  save_args = jax.tree_util.tree_map(lambda a: a.save_args(), params, is_leaf=is_lazy)
  handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_zarr3=False)
  refused: list[ConfigError] = []  # shared by every array: the first refusal ends the reading
  for array in jax.tree_util.tree_leaves(params, is_leaf=is_lazy):
    array.refused = refused
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(path, args=ocp.args.PyTreeSave({"params": params}, save_args={"params": save_args}))
  if refused:
    raise refused[0]
  from MaxText import integrity

  named = jax.tree_util.tree_leaves_with_path({"params": params}, is_leaf=is_lazy)
  arrays = {integrity.leaf_name(p): integrity.entry(a.checksum, a.dtype, a.shape) for p, a in named}
  return {"format": integrity.FORMAT, "arrays": arrays}
