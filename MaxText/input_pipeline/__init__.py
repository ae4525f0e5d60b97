"""Input pipelines: each yields global batches (sharded jax.Arrays) of

  inputs, inputs_segmentation, inputs_position, targets, targets_segmentation: [global_batch, length] int32

where segmentation 0 marks padding and positions restart at 0 in every packed document.

  synthetic  token streams that depend only on (seed, step, row): synthetic.py
  grain      ArrayRecord files of UTF-8 documents (grain_train_files, grain_eval_files)
  tfds       a prepared TFDS dataset read through tfds.data_source (dataset_path, dataset_name)
  hf         Hugging Face `datasets` on local files (hf_path, hf_data_dir, hf_train_files, hf_eval_files)

The three text sources feed one Grain pipeline (text_pipeline.py): tokenize, pack, batch, global arrays. With
use_sft their records are conversations (sft.py), and targets outside the loss get segmentation 0.
`check(config)` validates paths and the tokenizer before a run writes anything.
"""

import glob
import os

import jax

from MaxText.common_types import Config, ConfigError
from MaxText.input_pipeline.synthetic import SyntheticIterator

BATCH_KEYS = ("inputs", "inputs_segmentation", "inputs_position", "targets", "targets_segmentation")


def batch_keys(config: Config) -> tuple[str, ...]:
  """The keys of a batch: BATCH_KEYS, or with use_dpo each of them for the chosen and the rejected responses."""
  if config.use_dpo:
    return tuple(f"{side}_{k}" for side in ("chosen", "rejected") for k in BATCH_KEYS)
  return BATCH_KEYS


def _files(key: str, pattern: str) -> list[str]:
  if not pattern:
    raise ConfigError(f"{key} is empty; give a glob of data files, e.g. ~/maxtext_data/demo/array_record/train/*")
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise ConfigError(f"{key}={pattern} matches no files; build the demo data with `python3 MaxText/build_demo_dataset.py`")
  folders = [f for f in files if os.path.isdir(f)]
  if folders:
    raise ConfigError(f"{key}={pattern} matches the folder {folders[0]}; give a glob of its files, e.g. {folders[0]}/*")
  empty = [f for f in files if os.path.getsize(f) == 0]
  if empty:
    raise ConfigError(f"{key}={pattern} matches an empty file {empty[0]}; remove it or rebuild the dataset")
  return files


def _grain_source(config: Config, train: bool):
  key = "grain_train_files" if train else "grain_eval_files"
  import grain  # Lazy: only text pipelines need Grain.

  return grain.sources.ArrayRecordDataSource(_files(key, getattr(config, key)))


def _tfds_source(config: Config, train: bool):
  name = config.dataset_name if train else (config.eval_dataset_name or config.dataset_name)
  if not name:
    raise ConfigError("dataset_type=tfds needs dataset_name=NAME (and dataset_path= its TFDS data_dir)")
  path = os.path.expanduser(config.dataset_path)
  if path and not os.path.isdir(path):
    raise ConfigError(f"dataset_path={path} does not exist; give the data_dir holding the prepared TFDS dataset")
  import tensorflow_datasets as tfds  # Lazy: its array_record sources need no TensorFlow.

  try:
    source = tfds.data_source(name, data_dir=path or None, split=config.train_split if train else config.eval_split)
  except Exception as e:  # noqa: BLE001 (tfds raises many types for a missing or unprepared dataset)
    raise ConfigError(
      f"dataset_name={name} dataset_path={path}: no prepared TFDS dataset ({type(e).__name__}: "
      f"{' '.join(str(e).split())[:160]}); prepare it first (e.g. python3 MaxText/build_demo_dataset.py)"
    ) from None
  return source


def _hf_source(config: Config, train: bool):
  if not config.hf_path:
    raise ConfigError("dataset_type=hf needs hf_path= (json, parquet, text, csv, or a saved dataset folder)")
  pattern = config.hf_train_files if train else config.hf_eval_files
  files = _files("hf_train_files" if train else "hf_eval_files", pattern) if pattern else None
  import datasets  # Lazy: only the hf pipeline needs Hugging Face datasets.

  datasets.disable_progress_bars()
  path = os.path.expanduser(config.hf_path)
  try:
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
      source = datasets.load_from_disk(path)[config.train_split if train else config.eval_split]
    else:
      data_files = {"split": files} if files else None
      split = "split" if files else (config.train_split if train else config.eval_split)
      data_dir = os.path.expanduser(config.hf_data_dir) or None
      source = datasets.load_dataset(path, data_dir=data_dir, data_files=data_files, split=split)
  except (FileNotFoundError, ValueError) as e:
    raise ConfigError(
      f"hf_path={config.hf_path}: cannot load ({type(e).__name__}: {' '.join(str(e).split())[:160]})"
    ) from None
  return source


# dataset_type -> (config, is the train split) -> random-access records.
TEXT_SOURCES = {"grain": _grain_source, "tfds": _tfds_source, "hf": _hf_source}
DATASET_TYPES = ("synthetic", *TEXT_SOURCES)


def _source(config: Config, split: str):
  return TEXT_SOURCES[config.dataset_type](config, split == "train")


def _columns_key(split: str) -> str:
  return "train_data_columns" if split == "train" else "eval_data_columns"


def _text_key(config: Config, split: str) -> str | None:
  """The column of a document's text in a record (None: ArrayRecord records are the text)."""
  key = _columns_key(split)
  columns = getattr(config, key)
  if len(columns) != 1:
    raise ConfigError(f"{key}={list(columns)}: a document is one text column; give one, or set use_sft=true")
  return None if config.dataset_type == "grain" else columns[0]


def _conversation(config: Config, split: str):
  """The sft.Conversation transform of the split's records; raises ConfigError."""
  from MaxText.input_pipeline import sft

  key = _columns_key(split)
  if config.use_dpo:
    columns = sft.check_preference_columns(getattr(config, key), key)
  else:
    columns = sft.check_columns(getattr(config, key), key, config.use_chat_template)
  template = None
  if config.use_chat_template:
    template, _ = sft.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
    sft.compile_template(template)
  return (sft.Preference if config.use_dpo else sft.Conversation)(
    tokenizer_path=os.path.expanduser(config.tokenizer_path),
    tokenizer_type=config.tokenizer_type,
    columns=columns,
    key=key,
    template=template,
    completion_only=config.sft_train_on_completion_only,
    add_bos=config.add_bos,
    add_eos=config.add_eos,
  )


# Records check() reads through the fine-tuning transform, so a wrong column or an unusable conversation stops the
# run before it writes anything (a bad record further on stops it when reached).
CHECKED_RECORDS = 8


def _check_split(config: Config, split: str) -> None:
  source = _source(config, split)
  if not (config.use_sft or config.use_dpo):
    _text_key(config, split)
    return
  conversation = _conversation(config, split)
  for i in range(min(len(source), CHECKED_RECORDS)):
    conversation(source[i])


def check(config: Config) -> None:
  """Raises ConfigError for a missing data path, an empty glob, an unusable tokenizer, or fine-tuning records the
  configuration cannot read (before any write)."""
  if config.dataset_type == "synthetic":
    return
  from MaxText.input_pipeline import tokenizer

  tokenizer.check_tokenizer(config)
  _check_split(config, "train")
  if config.eval_interval > 0:
    _check_split(config, "eval")
    if config.eval_steps < 0 and jax.process_count() > 1:
      raise ConfigError(
        "eval_steps=-1 with several processes: their shares of the eval split may give different batch counts; "
        "set eval_steps to a positive count"
      )


def create_iterator(config: Config, mesh, start_step: int = 0):
  """The training iterator selected by `dataset_type`, positioned to yield the batch of `start_step`
  (text pipelines: at their start; a resumed run restores their saved state instead)."""
  if config.dataset_type == "synthetic":
    return SyntheticIterator(config, mesh, start_step)
  return _text_iterator(config, mesh, "train")


def create_eval_iterator(config: Config, mesh):
  """One pass over the evaluation split (synthetic: a fixed set of eval_steps batches)."""
  if config.dataset_type == "synthetic":
    # Rows from steps no training run reaches, so eval never sees a training batch.
    return SyntheticIterator(config, mesh, start_step=1 << 40, batch_size=config.eval_batch_size)
  return _text_iterator(config, mesh, "eval")


def _text_iterator(config: Config, mesh, split: str):
  from MaxText import sharding
  from MaxText.input_pipeline import text_pipeline
  from MaxText.input_pipeline.tokenizer import Tokenize

  train = split == "train"
  batch = config.global_batch_size if train else config.eval_batch_size
  rows = sharding.local_rows(sharding.batch_sharding(mesh, config), (batch, config.max_target_length))
  source = _source(config, split)
  if config.use_sft or config.use_dpo:
    tokenize, text_key = _conversation(config, split), None
  else:
    tokenize, text_key = Tokenize.from_config(config), _text_key(config, split)
  dataset = text_pipeline.make_dataset(
    source,
    tokenize=tokenize,
    length=config.max_target_length,
    rows=rows.stop - rows.start,
    seed=config.data_shuffle_seed,
    # Eval reads its split once, or (eval_steps > 0) cycles it so every process has its eval_steps batches.
    num_epochs=config.num_epoch if train else (1 if config.eval_steps < 0 else -1),
    process_index=jax.process_index(),
    process_count=jax.process_count(),
    text_key=text_key,
    shuffle=train,
    worker_count=config.grain_worker_count,
    packing=config.packing,
    examples="preferences" if config.use_dpo else "conversations" if config.use_sft else "documents",
  )
  return text_pipeline.TextIterator(config, mesh, dataset, batch_size=batch)
