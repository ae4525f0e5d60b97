"""Imports a Hugging Face model folder as a params-only MaxText checkpoint:

    python3 MaxText/convert_hf_checkpoint.py MaxText/configs/base.yml hf_model_path=DIR \
      base_output_directory=OUT run_name=NAME [scan_layers=true] [weight_dtype=float32]

hf_model_path may also be a Hugging Face Hub id (owner/name), fetched into the Hugging Face cache (MaxText/hub.py).

DIR holds `config.json` and `*.safetensors` (sharded or not; `.bin` files are refused, never unpickled). The
architecture comes from config.json (llama, mistral, qwen3, gemma, gemma2, gpt2: the families of MaxText/families/).
Writes OUT/NAME/checkpoints/0/items (Orbax, params only, layers scanned or not as scan_layers says) and next to
it model.yml (our model keys, for model_name=OUT/NAME/checkpoints/0/model.yml) and the tokenizer files (with
what transformers keeps beside them: tokenizer_config.json, the chat template, generation_config.json, ...). The
tensors are streamed: each is read, converted to weight_dtype and written before the next is read. Everything
that can be is checked before anything is written (config.json's fields, every tensor present with its shape and a
float dtype, the tokenizer loading); a NaN or an infinity in a tensor is found as it is streamed and refused too
(hf_allow_non_finite_weights=true imports it). A refused import leaves nothing: the output is staged and appears
only when complete; an existing checkpoint is never overwritten.
"""

import json
import os
import shutil
import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np
import yaml

from MaxText import chat_template as template_lib
from MaxText import checkpointing, cli, families, hub, state, storage
from MaxText.common_types import Config, ConfigError, cut
from MaxText.convert import get, hf_families, put, staged, tokenizer_companions
from MaxText.convert.streaming import FLOAT_DTYPES, HFTensors, LazyArray, non_finite, save_params
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import decoders
from MaxText.layers.linears import DTYPES

MODEL_YML = "model.yml"
CHUNK_BYTES = 64 * 2**20  # a model-level tensor bigger than this (an embedding) is converted in blocks of rows


JSON_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def read_hf_config(folder: str) -> dict:
  """config.json of a Hugging Face folder as a dict; ConfigError, naming the file, for one that is no JSON object.
  (What its fields hold is checked by the family reading them: hf_families.check_fields.)"""
  if not folder:
    raise ConfigError("hf_model_path is empty; give the Hugging Face model folder (config.json + *.safetensors)")
  path = os.path.join(folder, "config.json")
  if not os.path.isdir(folder):
    raise ConfigError(f"hf_model_path={folder} is not a folder; give the Hugging Face model folder")
  if not os.path.isfile(path):
    raise ConfigError(f"hf_model_path={folder} has no config.json; give a Hugging Face model folder")
  try:
    with open(path, encoding="utf-8") as f:
      values = json.load(f)
  except RecursionError:
    raise ConfigError(
      f"{path} nests its values deeper than {sys.getrecursionlimit()} levels; it is not a model's config.json"
    ) from None
  except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and an integer of too many digits
    raise ConfigError(f"{path} is not valid JSON ({cut(' '.join(str(e).split()), 200)})") from None
  if not isinstance(values, dict):
    raise ConfigError(
      f"{path} holds a JSON {JSON_KINDS.get(type(values), type(values).__name__)}, not an object of the model's keys; "
      "give the model's own config.json"
    )
  return values


def find_tokenizer(folder: str) -> tuple[str, list[str]] | None:
  """(tokenizer_type, files to copy: the tokenizer's first, then its TOKENIZER_COMPANIONS) from the files in a Hugging
  Face folder, or None. ConfigError for a tokenizer.model of no kind we read."""
  companions = tokenizer_companions(folder)
  if os.path.isfile(os.path.join(folder, "tokenizer.json")):
    return "huggingface", ["tokenizer.json", *companions]
  for name in ("tokenizer.model", os.path.join("original", "tokenizer.model")):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      kind = tokenizer_lib.looks_like(path)
      if kind not in ("sentencepiece", "tiktoken"):
        raise ConfigError(
          f"hf_model_path: {path} is neither a SentencePiece model nor a tiktoken file, so it cannot be the "
          "checkpoint's tokenizer; replace it with the model's own, or remove it (and give tokenizer_path= to runs)"
        )
      return kind, [name, *companions]
  return None


def check_tokenizer(folder: str, tokenizer: tuple[str, list[str]], vocab_size: int) -> None:
  """The tokenizer the import would copy (and print as the one to use) must load as our runs load it, fit the model's
  vocabulary, and its chat template, if any, must parse: else ConfigError, before anything is written. Refused
  rather than skipped: a checkpoint imported without its tokenizer is one a user goes on to use with another."""
  kind, files = tokenizer
  path = os.path.join(folder, files[0])
  fix = "replace it with the model's own, or remove it (and give tokenizer_path= to runs)"
  try:
    loaded = tokenizer_lib.load(path, kind)
  except ConfigError as e:  # its own message ends "; <the fix for a run's tokenizer_path>": this one's is ours
    reason = str(e).rsplit("; ", 1)[0].removeprefix("tokenizer_path=")
    raise ConfigError(f"hf_model_path: the tokenizer does not load: {reason}; {fix}") from None
  if loaded.vocab_size > vocab_size:
    raise ConfigError(
      f"hf_model_path: {path} has {loaded.vocab_size} tokens but config.json's vocabulary is {vocab_size}; the "
      f"tokenizer is not this model's: {fix}"
    )

  template = template_lib.tokenizer_template(path)
  if template is not None:
    try:
      template_lib.compile_template(template[0])
    except ConfigError as e:
      raise ConfigError(f"hf_model_path: {template[1]}: {str(e).rsplit('; ', 1)[0]}; {fix}") from None


class Plan:
  """Which HF tensors make which of our parameters, checked against the config before anything is written."""

  def __init__(self, config: Config, tensors: HFTensors, abstract: dict):
    self.config, self.tensors, self.abstract = config, tensors, abstract
    self.mapping = families.hf_mapping(config)
    self.model_groups, self.layer_groups = self.mapping.layout(config)
    used = set()
    expected = {}  # (group, is a layer group) -> HF shapes, the same for every layer
    for group, i in self.instances():
      if (id(group), i is None) not in expected:
        ours = [jax.ShapeDtypeStruct(self.our_shape(p, i), np.float32) for p in group.ours]
        expected[id(group), i is None] = [a.shape for a in jax.eval_shape(group.to_hf, *ours)]
      for name, want in zip([n.format(i=i) for n in group.hf], expected[id(group), i is None], strict=True):
        stored = tensors.resolve(name)
        if stored is None:
          raise ConfigError(
            f"hf_model_path: tensor {name} is missing; the checkpoint is incomplete or not this architecture"
          )
        if tensors.shapes[stored] != want:
          raise ConfigError(
            f"hf_model_path: tensor {name} has shape {tensors.shapes[stored]} but config.json implies {want}; "
            "the weights do not match config.json"
          )
        if tensors.dtypes[stored] not in FLOAT_DTYPES:  # an int8 weight would be cast, its scale lost, without this
          raise ConfigError(
            f"hf_model_path: tensor {stored} is stored as {tensors.dtypes[stored]}, but the parameter it makes is "
            f"floating-point ({', '.join(FLOAT_DTYPES[:-1])}); the checkpoint is quantized or damaged: dequantize it "
            "to bfloat16 or float32 first"
          )
        used.add(stored)
    extra = sorted(n for n in set(tensors.files) - used if not self.ignored(tensors.text_name(n)))
    if extra:
      raise ConfigError(
        f"hf_model_path: tensor {extra[0]} (and {len(extra) - 1} more) is not part of a "
        f"{config.decoder_block} model; this variant of the architecture is not supported"
      )

  def ignored(self, name: str | None) -> bool:
    """A tensor the import leaves out: not a parameter (the mapping's `ignored`), or another tower's (name None)."""
    return name is None or self.mapping.ignored(name, self.config)

  def instances(self):
    for group in self.model_groups:
      yield group, None
    for i in range(self.config.num_decoder_layers):
      for group in hf_families.layer_groups(self.layer_groups, i):
        yield group, i

  def our_shape(self, path: str, i: int | None) -> tuple[int, ...]:
    where, index = decoders.param_path(self.config, path, i)
    shape = get(self.abstract, where).shape
    return shape if index is None else shape[1:]

  def lazy_params(self, progress) -> dict:
    """Our params as a tree of LazyArrays (a scanned parameter gets one chunk per layer)."""
    dtype = np.dtype(DTYPES[self.config.weight_dtype])
    tree: dict = {}

    def loader(group, i, k, rows=None, last=True):
      def load():
        hf = [self.tensors.load(n.format(i=i), rows) for n in group.hf]
        with np.errstate(over="ignore"):  # counted next, and refused in one line
          out = np.ascontiguousarray(group.to_ours(*hf)[k]).astype(dtype, copy=False)
        if not self.tensors.allow_non_finite and non_finite(out):  # finite in the file: beyond weight_dtype's range
          raise ConfigError(
            f"hf_model_path: tensor {group.hf[0].format(i=i)} has {non_finite(out)} values beyond the range of "
            f"weight_dtype={self.config.weight_dtype}; import with weight_dtype=float32 (or bfloat16)"
          )
        progress.update(int(last))
        return out

      return load

    def row_blocks(group, path):
      """(index into ours, rows of the HF tensor) blocks of about CHUNK_BYTES, or None for one piece."""
      shape = self.our_shape(path, None)
      if group.row_axis is None or np.prod(shape) * dtype.itemsize <= CHUNK_BYTES:
        return None
      n = shape[group.row_axis]
      step = max(1, n * CHUNK_BYTES // (int(np.prod(shape)) * dtype.itemsize))
      blocks = []
      for a in range(0, n, step):
        rows = slice(a, min(a + step, n))
        blocks.append(((slice(None),) * group.row_axis + (rows,), rows))
      return blocks

    for group, i in self.instances():
      for k, path in enumerate(group.ours):
        where, index = decoders.param_path(self.config, path, i)
        if index is not None:
          if index == 0:
            put(tree, where, LazyArray(get(self.abstract, where).shape, dtype, []))
          get(tree, where).chunks.append(((index,), loader(group, i, k)))
        elif i is None and (blocks := row_blocks(group, path)):
          chunks = [(index, loader(group, i, k, rows, b == len(blocks) - 1)) for b, (index, rows) in enumerate(blocks)]
          put(tree, where, LazyArray(self.our_shape(path, i), dtype, chunks))
        else:
          put(tree, where, LazyArray(self.our_shape(path, i), dtype, [((), loader(group, i, k))]))
    return tree


def check_layer_count(config: Config, tensors: HFTensors) -> None:
  """The last decoder layer's tensors are there: checked before the model is built (layer by layer, unscanned), so
  a config.json claiming far more layers than the checkpoint holds is refused at once."""
  _, layer_groups = families.hf_mapping(config).layout(config)
  last = config.num_decoder_layers - 1
  for group in hf_families.layer_groups(layer_groups, last):
    for name in (n.format(i=last) for n in group.hf):
      if tensors.resolve(name) is None:
        raise ConfigError(
          f"hf_model_path: tensor {name} is missing, but config.json has {config.num_decoder_layers} layers; the "
          "checkpoint is incomplete or config.json is not its own"
        )


def source_max_positions(hf_config: dict) -> int | None:
  """The source's max_position_embeddings (its text model's), kept in model.yml as hf_max_position_embeddings so
  that an export says what the model was made for (convert_to_hf_checkpoint.py)."""
  tower = families.text_tower(hf_config)
  text = hf_config.get(tower.config_key) if tower else hf_config
  value = text.get("max_position_embeddings")
  return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def convert(config: Config, argv: list[str]) -> str:
  """Writes the checkpoint, model.yml and tokenizer; returns the checkpoint's `items` path. `argv` is the
  command line, loaded again with model_name=model.yml so the imported keys are checked like any preset."""
  if config.model_name != "default":
    raise ConfigError(f"model_name={config.model_name}: the importer takes the model from config.json; drop model_name")
  folder = hub.model_folder(config.hf_model_path)  # a local folder, or a Hub id fetched into the HF cache
  hf_config = read_hf_config(folder)
  keys = families.model_keys_from_hf(hf_config)
  if (positions := source_max_positions(hf_config)) is not None:
    keys["hf_max_position_embeddings"] = positions
  target = os.path.join(checkpointing.checkpoint_dir(config), "0")
  if os.path.exists(target):
    raise ConfigError(f"{target} already exists; choose another run_name (an existing checkpoint is never overwritten)")
  tensors = HFTensors(folder)
  tensors.tower = families.text_tower(hf_config)  # a multimodal checkpoint's text model: its tensors' stored names
  tensors.allow_non_finite = config.hf_allow_non_finite_weights
  tokenizer = find_tokenizer(folder)
  if tokenizer:
    check_tokenizer(folder, tokenizer, keys["vocab_size"])

  with staged(target) as staging:
    yml = os.path.join(staging, MODEL_YML)
    with open(yml, "w") as f:
      f.write(f"# Imported from {os.path.abspath(folder)} by convert_hf_checkpoint.py.\n")
      yaml.safe_dump(keys, f, sort_keys=False)
    model_config = cli.load_config([*argv[1:], f"model_name={yml}"])
    check_layer_count(model_config, tensors)
    plan = Plan(model_config, tensors, state.abstract_params(model_config))

    from tqdm import tqdm

    total = sum(len(g.ours) for g, _ in plan.instances())
    with tqdm(total=total, desc="tensors", unit="tensor", file=sys.stderr) as progress:
      checksums = save_params(os.path.join(staging, checkpointing.ITEM), plan.lazy_params(progress))
    checkpointing.write_checksums(staging, checksums)
    if tokenizer:
      for name in tokenizer[1]:
        shutil.copy(os.path.join(folder, name), os.path.join(staging, os.path.basename(name)))

  items = os.path.join(target, checkpointing.ITEM)
  use = f"model_name={os.path.join(target, MODEL_YML)} load_parameters_path={items}"
  copied = ""
  if tokenizer:
    use += f" tokenizer_type={tokenizer[0]} tokenizer_path={os.path.join(target, os.path.basename(tokenizer[1][0]))}"
    copied = f"\nCopied beside it, from {os.path.abspath(folder)}: {', '.join(os.path.basename(n) for n in tokenizer[1])}"
  print(f"Wrote {items}{copied}\nUse it with: {use}", flush=True)
  return items


def load_config(args: list[str]) -> Config:
  """The importer's config: a bucket as base_output_directory is refused before its access is checked."""
  config = cli.load_config(args)
  if storage.is_remote(config.base_output_directory):
    raise ConfigError(
      f"base_output_directory={config.base_output_directory}: the importer writes to a local folder (it stages the "
      "checkpoint and renames it into place); import locally, then copy the run folder to the bucket "
      "(gsutil -m cp -r) and load it from there"
    )
  checkpointing.run_dir(config)  # What load_config(writes_run_dir=True) checks, from here on.
  cli.check_output_paths(config)
  return config


def main(argv) -> int:
  return cli.run_cli(lambda config: convert(config, argv), argv, load=load_config)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
