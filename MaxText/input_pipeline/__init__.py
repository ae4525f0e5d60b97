"""Input pipelines: each yields global batches (sharded jax.Arrays) of

  inputs, inputs_segmentation, inputs_position, targets, targets_segmentation: [global_batch, length] int32

where segmentation 0 marks padding and positions restart at 0 in every packed document.

  synthetic  token streams that depend only on (seed, step, row): synthetic.py
  grain      ArrayRecord files of UTF-8 documents (grain_train_files, grain_eval_files)
  tfds       a prepared TFDS dataset read through tfds.data_source (dataset_path, dataset_name)
  hf         Hugging Face `datasets` on local files (hf_path, hf_data_dir, hf_train_files, hf_eval_files)

The three text sources feed one Grain pipeline (text_pipeline.py): tokenize, pack, batch, global arrays. What a
record is comes from the training objective (MaxText/objectives/) as `Examples`: documents (a text column), or
conversations and preference pairs (sft.py), whose targets outside the loss get segmentation 0.
`check(config, examples)` validates paths and the tokenizer before a run writes anything, and reads records until one fits
max_target_length: data of which none does is refused there, where the pipeline would read it forever for a batch.
Paths are looked at with os.stat before anything opens them: a FIFO or /dev/zero is refused, never read.
"""

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Callable

import jax

from MaxText import chat_template as template_lib
from MaxText import storage
from MaxText.common_types import Config, ConfigError, cut, shown
from MaxText.input_pipeline import tokenizer
from MaxText.input_pipeline.synthetic import SyntheticIterator
from MaxText.sections import data as section

BATCH_KEYS = ("inputs", "inputs_segmentation", "inputs_position", "targets", "targets_segmentation")


@dataclasses.dataclass(frozen=True)
class Examples:
  """What a text source's records are to a training objective: documents (a text column, tokenized as it is), or,
  with `transform`, the examples it makes of each record: transform(config, split) -> record -> the pieces
  text_pipeline.make_dataset packs (sft.Conversation's, sft.Preference's). `name` is text_pipeline's kind of
  example, and what messages call them ("no conversations fit max_target_length")."""

  name: str
  transform: Callable[[Config, str], Callable] | None = None


DOCUMENTS = Examples("documents")


def _files(key: str, pattern: str) -> list[str]:
  if not pattern:
    raise ConfigError(f"{key} is empty; give a glob of data files, e.g. ~/maxtext_data/demo/array_record/train/*")
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise ConfigError(f"{key}={pattern} matches no files; build the demo data with `python3 MaxText/build_demo_dataset.py`")
  folders = [f for f in files if os.path.isdir(f)]
  if folders:
    raise ConfigError(f"{key}={pattern} matches the folder {folders[0]}; give a glob of its files, e.g. {folders[0]}/*")
  for f in files:  # Before anything opens them: reading a FIFO or /dev/zero would never end.
    storage.check_file(key, f, "give a glob of data files")
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
  if os.path.exists(path) and not os.path.isdir(path):
    storage.check_file("hf_path", path, "give a builder name (json, parquet, ...) or a saved dataset folder")
  where = describe(config, train)
  if config.hf_path == "json":  # datasets reads a file of JSON arrays or scalars as rows of a made-up "text" column
    for f in files or []:
      if not _starts_like_records(f):
        raise _not_json_lines(where, [f]) or _file_error(where, f, "does not start with a JSON object")
  quiet = logging.getLogger("datasets")  # It logs each file it fails to parse; the error below says it once.
  level = quiet.level
  quiet.setLevel(logging.CRITICAL)
  try:
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
      source = datasets.load_from_disk(path)[config.train_split if train else config.eval_split]
    else:
      data_files = {"split": files} if files else None
      split = "split" if files else (config.train_split if train else config.eval_split)
      data_dir = os.path.expanduser(config.hf_data_dir) or None
      source = datasets.load_dataset(path, data_dir=data_dir, data_files=data_files, split=split)
  except Exception as e:  # noqa: BLE001 (datasets and pyarrow raise many types for a file they cannot parse)
    error = _not_json_lines(where, files or []) if config.hf_path == "json" else None
    raise error or ConfigError(
      f"{where}: cannot load ({_reason(e)}); check the files against hf_path={config.hf_path}"
    ) from None
  finally:
    quiet.setLevel(level)
  return _Rows(source, where, files if config.hf_path == "json" else [])


class _Rows:
  """A Hugging Face dataset whose rows raise ConfigError for text that is not UTF-8: pyarrow's json reader lets it
  through and fails only when the row is read. The error names the file and line when `files` (JSON lines) do."""

  def __init__(self, dataset, where: str, files: list[str]):
    self.dataset, self.where, self.files = dataset, where, files

  def __len__(self) -> int:
    return len(self.dataset)

  def __getitem__(self, index):
    try:
      return self.dataset[index]
    except UnicodeDecodeError as e:
      error = _not_json_lines(self.where, self.files)
      raise error or ConfigError(f"{self.where}: row {index} is not UTF-8 ({e.reason}); save the data as UTF-8") from None


def _reason(error: BaseException) -> str:
  """`error`'s type and message, on one line and cut short; through a wrapper to what it wraps (datasets'
  DatasetGenerationError wraps pyarrow's parse error)."""
  while error.__cause__ is not None and type(error).__name__.endswith("GenerationError"):
    error = error.__cause__
  return f"{type(error).__name__}: {cut(' '.join(str(error).split()), 160)}"


def _starts_like_records(path: str) -> bool:
  """Whether the file `path` starts as JSON lines of objects or an array of objects do (its first 4 KiB)."""
  with open(path, "rb") as f:
    head = f.read(4096).lstrip()
  return head.startswith(b"{") or (head.startswith(b"[") and head[1:].lstrip()[:1] in (b"{", b"]"))


def _file_error(where: str, path: str, problem: str) -> ConfigError:
  """`where` (the config's key=value), the file unless that is all it names, the problem, and the fix."""
  named = where if where.endswith(f"={path}") else f"{where}: {path}"
  return ConfigError(f"{named} {problem}; write one JSON object per line (UTF-8)")


def _not_json_lines(where: str, files: list[str]) -> ConfigError | None:
  """The error for the first of `files` that is not JSON lines of objects, or None."""
  for path in files:
    problem = json_lines_problem(path)
    if problem:
      return _file_error(where, path, problem)
  return None


def json_lines_problem(path: str) -> str | None:
  """What is wrong with the file `path` as JSON lines of objects ("line 3 is not JSON (...)"), or None. A file that
  is one JSON document (an array of records, which Hugging Face's json builder also reads) has no problem."""
  with open(path, "rb") as f:
    head = f.read(256).lstrip()[:1]
    f.seek(0)
    records = 0
    for number, line in enumerate(f, start=1):
      try:
        text = line.decode("utf-8")
      except UnicodeDecodeError as e:
        return f"line {number} is not UTF-8 (byte {e.start} of the line is {line[e.start : e.start + 1]!r})"
      if not text.strip():
        continue
      try:
        record = json.loads(text)
      except RecursionError:
        return f"line {number} nests deeper than Python's stack: {shown(text.strip(), 60)}"
      except ValueError as e:
        if head == b"[" and number == 1:
          return _json_document_problem(path)
        return f"line {number} is not JSON ({getattr(e, 'msg', e)}: {shown(text.strip(), 60)})"
      if not isinstance(record, dict):
        return f"line {number} is a JSON {type(record).__name__}, not an object of columns: {shown(text.strip(), 60)}"
      records += 1
  return None if records else "holds no records (only empty lines)"


def _json_document_problem(path: str) -> str | None:
  with open(path, encoding="utf-8") as f:
    try:
      records = json.load(f)
    except RecursionError:
      return "nests deeper than Python's stack"
    except ValueError as e:
      return f"is not JSON ({getattr(e, 'msg', e)} at line {getattr(e, 'lineno', '?')})"
  if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
    return "is not a JSON array of objects"
  return None if records else "holds no records (an empty JSON array)"


# dataset_type -> (config, is the train split) -> random-access records.
TEXT_SOURCES = {"grain": _grain_source, "tfds": _tfds_source, "hf": _hf_source}
DATASET_TYPES = section.DATASET_TYPES  # "synthetic", then TEXT_SOURCES


def records(config: Config, split: str):
  """The random-access records of a split ("train" or "eval") of a text source."""
  return TEXT_SOURCES[config.dataset_type](config, split == "train")


def describe(config: Config, train: bool) -> str:
  """The split's data as the config names it, for errors: "hf_train_files=chats/*.jsonl"."""
  if config.dataset_type == "tfds":
    return f"dataset_name={config.dataset_name if train else (config.eval_dataset_name or config.dataset_name)}"
  key = {"grain": "grain_%s_files", "hf": "hf_%s_files"}[config.dataset_type] % ("train" if train else "eval")
  if config.dataset_type == "hf" and not getattr(config, key):
    return f"hf_path={config.hf_path}"
  return f"{key}={getattr(config, key)}"


def _columns_key(split: str) -> str:
  return "train_data_columns" if split == "train" else "eval_data_columns"


def _text_key(config: Config, split: str) -> str | None:
  """The column of a document's text in a record (None: ArrayRecord records are the text)."""
  key = _columns_key(split)
  columns = getattr(config, key)
  if len(columns) != 1:
    raise ConfigError(f"{key}={list(columns)}: a document is one text column; give one, or set objective=sft")
  return None if config.dataset_type == "grain" else columns[0]


def conversations(config: Config, split: str):
  """The sft.Conversation transform of the split's records; raises ConfigError."""
  return _fine_tuning(config, split, preferences=False)


def preferences(config: Config, split: str):
  """The sft.Preference transform of the split's records (preference pairs); raises ConfigError."""
  return _fine_tuning(config, split, preferences=True)


CONVERSATIONS = Examples("conversations", conversations)
PREFERENCES = Examples("preferences", preferences)


def _fine_tuning(config: Config, split: str, preferences: bool):
  from MaxText.input_pipeline import sft

  key = _columns_key(split)
  if preferences:
    columns = sft.check_preference_columns(getattr(config, key), key)
  else:
    columns = sft.check_columns(getattr(config, key), key, config.use_chat_template)
  template = None
  if config.use_chat_template:
    template, _ = template_lib.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
    template_lib.compile_template(template)
  return (sft.Preference if preferences else sft.Conversation)(
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


def _check_split(config: Config, split: str, examples: Examples) -> None:
  """Reads the records of this process's share of the split until one fits max_target_length (text_pipeline.Fits),
  and at least CHECKED_RECORDS of them for examples made by a transform (conversations, preference pairs): data of
  which none fits would be read forever without a batch, so it is refused here, having been read once (one pass,
  as the run would have)."""
  from MaxText.input_pipeline import text_pipeline

  source = records(config, split)
  where = describe(config, split == "train")
  fine_tuning = examples.transform is not None
  if fine_tuning:
    transform = examples.transform(config, split)
  else:
    text_key, tokenize = _text_key(config, split), tokenizer.Tokenize.from_config(config)
    transform = lambda record: tokenize(_document(record, text_key, _columns_key(split)))  # noqa: E731
  share = range(jax.process_index(), len(source), jax.process_count())
  if not share:
    raise text_pipeline.no_records(where, jax.process_index(), jax.process_count())
  fits = text_pipeline.Fits(config.max_target_length, examples.name, where)
  checked, kept = CHECKED_RECORDS if fine_tuning else 1, False
  for n, i in enumerate(share):
    record = source[i]
    try:
      example = transform(record)
    except ConfigError as e:
      raise ConfigError(f"{e} (record {i + 1} of {where})") from None
    kept = fits(example) or kept
    if kept and n + 1 >= checked:
      return
  if not kept:
    raise ConfigError(text_pipeline.nothing_fits(where, config.max_target_length, examples.name, fits.shortest))


def _document(record, text_key: str | None, key: str):
  """The text of a record (ArrayRecord records are it); raises ConfigError for a record without the column."""
  if text_key is None:
    return record
  if not isinstance(record, dict) or text_key not in record:
    has = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ConfigError(f"{key}=[{text_key!r}]: a record has no column {text_key!r} (it has {has}); set {key}")
  return record[text_key]


def check(config: Config, examples: Examples = DOCUMENTS) -> None:
  """Raises ConfigError for a missing data path, an empty glob, an unusable tokenizer, records the `examples`
  transform cannot read, or data of which no record fits max_target_length (before any write)."""
  if config.dataset_type == "synthetic":
    return
  tokenizer.check_tokenizer(config)
  _check_split(config, "train", examples)
  if config.eval_interval > 0:
    _check_split(config, "eval", examples)
    if config.eval_steps < 0 and jax.process_count() > 1:
      raise ConfigError(
        "eval_steps=-1 with several processes: their shares of the eval split may give different batch counts; "
        "set eval_steps to a positive count"
      )


def create_iterator(config: Config, mesh, start_step: int = 0, examples: Examples = DOCUMENTS):
  """The training iterator selected by `dataset_type`, positioned to yield the batch of `start_step`
  (text pipelines: at their start; a resumed run restores their saved state instead)."""
  if config.dataset_type == "synthetic":
    return SyntheticIterator(config, mesh, start_step)
  return _text_iterator(config, mesh, "train", examples)


def create_eval_iterator(config: Config, mesh, examples: Examples = DOCUMENTS):
  """One pass over the evaluation split (synthetic: a fixed set of eval_steps batches)."""
  if config.dataset_type == "synthetic":
    # Rows from steps no training run reaches, so eval never sees a training batch.
    return SyntheticIterator(config, mesh, start_step=1 << 40, batch_size=config.eval_batch_size)
  return _text_iterator(config, mesh, "eval", examples)


def _text_iterator(config: Config, mesh, split: str, examples: Examples):
  from MaxText import sharding
  from MaxText.input_pipeline import text_pipeline
  from MaxText.input_pipeline.tokenizer import Tokenize

  train = split == "train"
  batch = config.global_batch_size if train else config.eval_batch_size
  rows = sharding.local_rows(sharding.batch_sharding(mesh, config), (batch, config.max_target_length))
  source = records(config, split)
  if examples.transform is not None:
    tokenize, text_key = examples.transform(config, split), None
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
    examples=examples.name,
    where=describe(config, train),
  )
  return text_pipeline.TextIterator(config, mesh, dataset, batch_size=batch)
