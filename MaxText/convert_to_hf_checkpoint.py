"""Exports a MaxText checkpoint's params as a Hugging Face model folder:

    python3 MaxText/convert_to_hf_checkpoint.py MaxText/configs/base.yml model_name=... \
      load_parameters_path=RUN/checkpoints/STEP/items hf_model_path=OUT tokenizer_path=... tokenizer_type=...

(the config and keys the model was trained with) writes OUT/config.json and OUT/model*.safetensors (split into shards
of at most hf_max_shard_size_mb, with model.safetensors.index.json when there are several), which transformers loads
with from_pretrained. Tensors keep the dtype they are stored in, so importing and exporting gives back the original
bits. The tokenizer (tokenizer_path) is copied with the files transformers keeps beside it (tokenizer_config.json,
the chat template, generation_config.json, ...; a Unigram SentencePiece model is written as a tokenizer.json:
convert/spm_tokenizer.py), the chat template the run renders with (use_chat_template, chat_template,
chat_template_path) is written as chat_template.jinja, and config.json gets the tokenizer's BOS and EOS ids; without
a tokenizer_path a warning says that generate() will not stop. config.json's max_position_embeddings is
hf_families.max_positions'. OUT must be new or empty; it appears only when complete.

A LoRA checkpoint (lora_rank > 0, the keys it was trained with) exports, by hf_lora_export, as the model with the
adapters merged into its weights ("merged"), as a PEFT adapter folder ("adapter": adapter_config.json +
adapter_model.safetensors) that peft.PeftModel.from_pretrained loads on the base model, or as that base model
without its adapters ("base").
"""

import dataclasses
import json
import os
import shutil
import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import numpy as np

from MaxText import chat_template as template_lib
from MaxText import checkpointing, cli, families, lora, pyconfig, state
from MaxText.common_types import Config, ConfigError
from MaxText.convert import get, hf_families, new_file_mode, peft, spm_tokenizer, staged, tokenizer_companions
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import decoders

TOKENIZER_FILES = {"huggingface": "tokenizer.json", "sentencepiece": "tokenizer.model", "tiktoken": "tokenizer.model"}


def hf_tensors(config: Config, mapping: hf_families.HFMapping, params: dict):
  """(Hugging Face name, array) of every tensor, in layer order."""
  model_groups, layer_groups = mapping.layout(config)

  def leaf(path: str, i: int | None):
    where, index = decoders.param_path(config, path, i)
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


@dataclasses.dataclass(frozen=True)
class ExportTokenizer:
  """The run's tokenizer as the export writes it: the loaded tokenizer (BOS and EOS for config.json), the files to
  copy (source path -> name in the folder) and the chat template to write as chat_template.jinja, if the run renders
  chat (use_chat_template, chat_template, chat_template_path)."""

  tokenizer: tokenizer_lib.Tokenizer
  files: dict[str, str]
  template: str | None
  unigram: str | None = None  # a Unigram SentencePiece model, written as tokenizer.json too (convert/spm_tokenizer.py)


def export_tokenizer(config: Config) -> ExportTokenizer | None:
  """The tokenizer of the export's config (tokenizer_path, tokenizer_type; chat_template or chat_template_path), its
  files with those transformers keeps beside them; None, with one warning line, when no tokenizer_path is given.
  Warned rather than refused: the weights are whole without it (and a user may add the tokenizer), but config.json
  then has no BOS or EOS, so generate() would not stop."""
  if not config.tokenizer_path:
    print(
      "warning: no tokenizer_path, so the export has no tokenizer and config.json's bos_token_id and eos_token_id "
      "are null: transformers' generate() will not stop at the end of a text; pass the tokenizer_path and "
      "tokenizer_type the model was trained with",
      file=sys.stderr,
      flush=True,
    )
    return None
  path = os.path.expanduser(config.tokenizer_path)
  tokenizer = tokenizer_lib.load(path, config.tokenizer_type)
  if tokenizer.vocab_size > config.vocab_size:
    raise ConfigError(
      f"tokenizer_path={path} has {tokenizer.vocab_size} tokens but vocab_size={config.vocab_size}; give the "
      "tokenizer the model was trained with"
    )
  if tokenizer.eos_id < 0:
    also = " (name an eos_token in the tokenizer_config.json beside it)" if config.tokenizer_type == "huggingface" else ""
    print(
      f"warning: tokenizer_path={path} has no EOS token{also}, so config.json's eos_token_id is null: transformers' "
      "generate() will not stop at the end of a text",
      file=sys.stderr,
      flush=True,
    )
  folder = os.path.dirname(path)
  files = {path: TOKENIZER_FILES[config.tokenizer_type]}
  files |= {os.path.join(folder, name): name for name in tokenizer_companions(folder)}
  template = None
  if config.use_chat_template or config.chat_template or config.chat_template_path:
    # The template the run renders chat with (its keys', else the tokenizer's own, else the fallback a model tuned
    # with use_chat_template learned), so transformers' apply_chat_template renders what the model knows.
    template, _ = template_lib.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
  unigram = None
  if config.tokenizer_type == "sentencepiece" and spm_tokenizer.is_unigram(path):
    unigram = path
    del files[path]  # transformers would read a tokenizer.model beside tokenizer.json in place of it
    if families.hf_mapping(config).model_type in spm_tokenizer.TOKENIZER_CLASS_FORCED:
      print(
        f"warning: transformers loads the tokenizer of model_type={families.hf_mapping(config).model_type} as its own "
        "class, whatever tokenizer_config.json says, and that splits this SentencePiece model's text differently; "
        "load the tokenizer with PreTrainedTokenizerFast(tokenizer_file=.../tokenizer.json) instead",
        file=sys.stderr,
        flush=True,
      )
  elif config.tokenizer_type != "huggingface":
    print(
      f"warning: tokenizer_path={path} ({config.tokenizer_type}) is copied as tokenizer.model, which transformers "
      "reads with a generic conversion that may split text differently; give the model's tokenizer.json "
      "(tokenizer_type=huggingface) if it has one",
      file=sys.stderr,
      flush=True,
    )
  return ExportTokenizer(tokenizer, files, template, unigram)


def export(config: Config) -> str:
  out = os.path.expanduser(config.hf_model_path)
  if not out:
    raise ConfigError("hf_model_path is empty; give the folder to write the Hugging Face model to")
  if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
    raise ConfigError(f"hf_model_path={out} already exists and is not empty; give a new or empty folder")
  if config.hf_max_position_embeddings < 0:
    raise ConfigError(
      f"hf_max_position_embeddings={config.hf_max_position_embeddings} is negative; give the longest sequence the "
      "model is for, or 0 for max_target_length"
    )
  cli.check_writable("hf_model_path", os.path.abspath(out), folder=True)
  mapping = families.hf_mapping(config)  # Before any work: a family without one cannot be exported.
  adapter = config.lora_rank > 0 and config.hf_lora_export == "adapter"
  tokenizer = None if adapter else export_tokenizer(config)
  params, source = checkpointing.restore_host_params(config, state.abstract_params(config))
  dtype = np.dtype(params["token_embedder"]["embedding"].dtype).name
  if adapter:
    adapters = lora.partition(params)[0]
    with staged(out) as staging:
      count = peft.write_adapter(staging, config, mapping, adapters, lambda p, i: decoders.param_path(config, p, i))
    print(f"Wrote {out} (a PEFT LoRA adapter: {count} tensors, rank {config.lora_rank}) from {source}", flush=True)
    return out
  if config.lora_rank > 0:
    params = lora.merge(params, config) if config.hf_lora_export == "merged" else lora.partition(params)[1]
    config = pyconfig.replace(config, lora_rank=0, hf_lora_export="merged", hf_lora_adapter_path="")

  bos = tokenizer.tokenizer.bos_id if tokenizer and tokenizer.tokenizer.bos_id >= 0 else None
  eos = tokenizer.tokenizer.eos_id if tokenizer and tokenizer.tokenizer.eos_id >= 0 else None
  # Before any tensor is written: what the format cannot hold (write_config's refusals) fails in seconds.
  hf_config = hf_families.hf_config(mapping, config, dtype, bos, eos)
  with staged(out) as staging:
    count = write_shards(staging, hf_tensors(config, mapping, params), config.hf_max_shard_size_mb * 10**6)
    with open(os.path.join(staging, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2)
    if tokenizer:
      for path, name in tokenizer.files.items():
        shutil.copy(path, os.path.join(staging, name))
      names = set(tokenizer.files.values())
      if tokenizer.unigram is not None:
        max_length = hf_config.get("max_position_embeddings") or config.max_target_length
        names |= set(spm_tokenizer.write(staging, tokenizer.unigram, config.add_bos, max_length))
      if tokenizer.template is not None:
        with open(os.path.join(staging, "chat_template.jinja"), "w", encoding="utf-8") as f:
          f.write(tokenizer.template)
        names.add("chat_template.jinja")
  written = f"{count} safetensors shard{'s' if count > 1 else ''}, {dtype}"
  if tokenizer:
    written += f"; the tokenizer: {', '.join(sorted(names))}"
  print(f"Wrote {out} ({written}) from {source}", flush=True)
  return out


def main(argv) -> int:
  return cli.run_cli(export, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
