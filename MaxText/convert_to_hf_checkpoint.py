"""Exports a MaxText checkpoint's params as a Hugging Face model folder:

    python3 MaxText/convert_to_hf_checkpoint.py MaxText/configs/base.yml model_name=... \
      load_parameters_path=RUN/checkpoints/STEP/items hf_model_path=OUT [tokenizer_path=... tokenizer_type=...]

writes OUT/config.json and OUT/model*.safetensors (split into shards of at most hf_max_shard_size_mb, with
model.safetensors.index.json when there are several), which transformers loads with from_pretrained. Tensors
keep the dtype they are stored in, so importing and exporting gives back the original bits. With
tokenizer_path set, the tokenizer files are copied too. OUT must be new or empty; it appears only when complete.

A LoRA checkpoint (lora_rank > 0, the keys it was trained with) exports, by hf_lora_export, as the model with the
adapters merged into its weights ("merged"), as a PEFT adapter folder ("adapter": adapter_config.json +
adapter_model.safetensors) that peft.PeftModel.from_pretrained loads on the base model, or as that base model
without its adapters ("base").
"""

import json
import os
import shutil
import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import numpy as np

from MaxText import checkpointing, cli, families, lora, pyconfig, state
from MaxText.common_types import Config, ConfigError
from MaxText.convert import get, hf_families, new_file_mode, peft, staged
from MaxText.input_pipeline import tokenizer as tokenizer_lib

TOKENIZER_FILES = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model", "tiktoken": "tokenizer.model"}


def hf_tensors(config: Config, mapping: hf_families.HFMapping, params: dict):
  """(Hugging Face name, array) of every tensor, in layer order."""
  model_groups, layer_groups = mapping.layout(config)

  def leaf(path: str, i: int | None):
    where, index = families.param_path(config, path, i)
    value = get(params, where)
    return value if index is None else value[index]

  instances = [(g, None) for g in model_groups]
  instances += [(g, i) for i in range(config.num_decoder_layers) for g in hf_families.layer_groups(layer_groups, i)]
  for group, i in instances:
    arrays = group.to_hf(*[leaf(p, i) for p in group.ours])
    for name, array in zip(group.hf, arrays, strict=True):
      yield name.format(i=i), np.ascontiguousarray(array)


def write_shards(folder: str, tensors, max_bytes: int) -> int:
  """Writes safetensors shards of at most max_bytes (a bigger tensor gets a shard of its own); returns the count."""
  from safetensors.numpy import save_file

  shards, current, size, weight_map, total = [], {}, 0, {}, 0

  def flush():
    nonlocal current, size
    if current:
      name = f"part-{len(shards):05d}.safetensors"
      save_file(current, os.path.join(folder, name), metadata={"format": "pt"})
      os.chmod(os.path.join(folder, name), new_file_mode())  # as open() makes config.json (save_file: 0o600)
      shards.append((name, list(current)))
      current, size = {}, 0

  for name, array in tensors:
    if size and size + array.nbytes > max_bytes:
      flush()
    current[name] = array
    size += array.nbytes
    total += array.nbytes
  flush()
  count = len(shards)
  for k, (part, names) in enumerate(shards):
    final = "model.safetensors" if count == 1 else f"model-{k + 1:05d}-of-{count:05d}.safetensors"
    os.rename(os.path.join(folder, part), os.path.join(folder, final))
    weight_map.update(dict.fromkeys(names, final))
  if count > 1:
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return count


def export(config: Config) -> str:
  out = os.path.expanduser(config.hf_model_path)
  if not out:
    raise ConfigError("hf_model_path is empty; give the folder to write the Hugging Face model to")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ConfigError(f"hf_model_path={out} already exists and is not empty; give a new or empty folder")
  cli.check_writable("hf_model_path", os.path.abspath(out), folder=True)
  mapping = families.hf_mapping(config)  # Before any work: a family without one cannot be exported.
  tokenizer = None
  if config.tokenizer_path:
    tokenizer = tokenizer_lib.load(config.tokenizer_path, config.tokenizer_type)
  params, source = checkpointing.restore_host_params(config, state.abstract_params(config))
  dtype = np.dtype(params["token_embedder"]["embedding"].dtype).name
  if config.lora_rank > 0 and config.hf_lora_export == "adapter":
    adapters = lora.partition(params)[0]
    with staged(out) as staging:
      count = peft.write_adapter(staging, config, mapping, adapters, lambda p, i: families.param_path(config, p, i))
    print(f"Wrote {out} (a PEFT LoRA adapter: {count} tensors, rank {config.lora_rank}) from {source}", flush=True)
    return out
  if config.lora_rank > 0:
    params = lora.merge(params, config) if config.hf_lora_export == "merged" else lora.partition(params)[1]
    config = pyconfig.replace(config, lora_rank=0, hf_lora_export="merged", hf_lora_adapter_path="")

  bos = tokenizer.bos_id if tokenizer and tokenizer.bos_id >= 0 else None
  eos = tokenizer.eos_id if tokenizer and tokenizer.eos_id >= 0 else None
  # Before any tensor is written: what the format cannot hold (write_config's refusals) fails in seconds.
  hf_config = hf_families.hf_config(mapping, config, dtype, bos, eos)
  with staged(out) as staging:
    count = write_shards(staging, hf_tensors(config, mapping, params), config.hf_max_shard_size_mb * 10**6)
    with open(os.path.join(staging, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2)
    if tokenizer:
      path = os.path.expanduser(config.tokenizer_path)
      shutil.copy(path, os.path.join(staging, TOKENIZER_FILES[config.tokenizer_type]))
      extra = os.path.join(os.path.dirname(path), "tokenizer_config.json")
      if config.tokenizer_type == "huggingface" and os.path.isfile(extra):
        shutil.copy(extra, staging)
  print(f"Wrote {out} ({count} safetensors shard{'s' if count > 1 else ''}, {dtype}) from {source}", flush=True)
  return out


def main(argv) -> int:
  return cli.run_cli(export, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
