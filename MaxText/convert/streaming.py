"""Reading Hugging Face safetensors and writing Orbax checkpoints a tensor (or a layer) at a time.

Peak memory is a few tensors, not the checkpoint: `HFTensors` opens a safetensors file only for the tensor
it reads (the mapping is dropped after each read), and `save_params` hands Orbax `LazyArray`s, whose chunks
(one layer of a scanned parameter, or a whole tensor) are loaded, converted and written one after another,
each into its own storage chunk. `.bin` files are never opened: unpickling runs arbitrary code.
"""

import dataclasses
import glob
import json
import os
from collections.abc import Callable

import numpy as np

from MaxText.common_types import ConfigError
from MaxText.convert import mxfp4


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
    dtypes: dict[str, str] = {}
    for path in files:
      try:
        with safe_open(path, "numpy") as f:
          for name in f.keys():
            self.files[name] = path
            self.shapes[name] = tuple(f.get_slice(name).get_shape())
            dtypes[name] = f.get_slice(name).get_dtype()
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
    for name, parts in mxfp4.packed_pairs(self.shapes, dtypes).items():
      self.packed[name] = tuple((self.files.pop(part), part) for part in parts)
      self.files[name] = self.packed[name][0][0]
      self.shapes[name] = mxfp4.dequantized_shape(self.shapes[parts[0]])
      for part in parts:
        del self.shapes[part]

  # A multimodal checkpoint's text tower (hf_families.TextTower), set by the importer: the text model's tensors are
  # stored under the tower's names, and the other towers' tensors are not the text model's (text_name).
  tower = None

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
    """The tensor `name`, or only its `rows` (a slice of axis 0); an MXFP4 one dequantized (bfloat16)."""
    stored = self.resolve(name)
    if stored not in self.packed:
      return _read(self.files[stored], stored, rows)
    if rows is not None and len(self.shapes[stored]) < 3:  # axis 0 is the blocks' last but one: rows of the whole
      return self.load(name)[rows]
    return mxfp4.dequantize(*(_read(path, part, rows) for path, part in self.packed[stored]))


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

  def load(self, index: tuple, load: Callable[[], np.ndarray]) -> np.ndarray:
    """Loads one chunk, adding it to the checksum."""
    from MaxText import integrity

    part = np.asarray(load(), dtype=self.dtype)
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
  with ocp.Checkpointer(handler) as checkpointer:
    checkpointer.save(path, args=ocp.args.PyTreeSave({"params": params}, save_args={"params": save_args}))
  from MaxText import integrity

  named = jax.tree_util.tree_leaves_with_path({"params": params}, is_leaf=is_lazy)
  arrays = {integrity.leaf_name(p): integrity.entry(a.checksum, a.dtype, a.shape) for p, a in named}
  return {"format": integrity.FORMAT, "arrays": arrays}
