"""Text pipelines (dataset_type grain, tfds, hf): documents -> tokens -> packed rows -> global batches.

  a random-access source of documents (ArrayRecord files, a TFDS data source, a Hugging Face dataset)
    -> this process's share: documents process_index, process_index + process_count, ...
    -> shuffled with data_shuffle_seed, reshuffled every epoch, repeated num_epoch times (-1: forever)
    -> tokenized (tokenizer_type: SentencePiece, tiktoken or Hugging Face tokenizers; add_bos, add_eos)
    -> a document longer than max_target_length + 1 tokens is cut into pieces that overlap by one token, so
       every token of the document is a target exactly once
    -> inputs = piece[:-1], targets = piece[1:]
    -> first-fit packing into rows of max_target_length (Grain's FirstFitPackIterDataset): segment ids
       1, 2, ... per piece (0 = padding) and positions restarting at 0 in every piece; packing=false pads
       each piece to its own row instead
    -> batches of this process's rows -> one global jax.Array per key.

Fine-tuning data (objective=sft) takes another road from the record to the pieces: sft.Conversation renders and
tokenizes a conversation with the mask of the tokens the loss sees, a conversation longer than max_target_length
+ 1 tokens is cut there (its end is lost, as in MaxText; one cut before any target in the loss is dropped), and
targets outside the mask get segment id 0, so the loss skips them while attention still sees their tokens.

The Grain iterator's state (a small dict) is what a checkpoint stores to resume exactly. This module is
imported only by runs that read text, so the synthetic path never imports Grain or a tokenizer library.
"""

import json
import operator

import grain
import grain.experimental as grain_experimental
import numpy as np

from MaxText import sharding
from MaxText.common_types import Config, ConfigError
from MaxText.input_pipeline.tokenizer import Tokenize

# Grain's packed keys -> ours.
_RENAME = {
  "inputs": "inputs",
  "inputs_segment_ids": "inputs_segmentation",
  "inputs_positions": "inputs_position",
  "targets": "targets",
  "targets_segment_ids": "targets_segmentation",
}


class Pieces(grain_experimental.FlatMapTransform):
  """tokens -> pieces of at most length + 1 tokens overlapping by one, as {"inputs": piece[:-1], "targets":
  piece[1:]}. A document of one token has nothing to predict and yields nothing."""

  def __init__(self, length: int, max_fan_out: int):
    self.length = length
    self.max_fan_out = max_fan_out

  def flat_map(self, tokens: np.ndarray) -> list[dict]:
    starts = range(0, max(len(tokens) - 1, 0), self.length)
    pieces = [tokens[start : start + self.length + 1] for start in starts]
    return [{"inputs": piece[:-1], "targets": piece[1:]} for piece in pieces]


# What a record becomes, by the `examples` of make_dataset: the key prefixes of its sequences ("documents" are
# token arrays cut into Pieces). A preference pair's two sequences are packed in lockstep: Grain places both in the
# same row under the same segment id, so chosen segment s and rejected segment s are one pair.
PREFIXES = {"conversations": ("",), "preferences": ("chosen_", "rejected_")}


class Fits:
  """Keeps an example that leaves a target in the loss once cut to `length` targets: a document of two tokens or
  more, a conversation whose first loss target is within the cut, a pair whose two sequences both are (a cut before
  the response would add rows without a gradient, and DPO pairs scored at a margin of 0).

  Data where nothing fits would be read forever without a batch, so `limit` examples dropped in a row (two passes
  over the records: a whole pass lies within them) raise ConfigError instead; check() finds it before the run.
  """

  def __init__(self, length: int, examples: str, where: str = "the data", limit: int = 0):
    self.length = length
    self.examples = examples
    self.where = where
    self.limit = limit
    self.dropped = 0  # examples dropped in a row
    self.shortest = None  # the fewest tokens one of them needs (None: none can fit at any length)

  def needed(self, example) -> int | None:
    """The smallest max_target_length at which `example` (a tokenize output) keeps a target in the loss; None if
    none does."""
    if self.examples == "documents":
      return 1 if len(example) >= 2 else None
    firsts = [np.flatnonzero(example[f"{p}mask"][1:]) for p in PREFIXES[self.examples]]
    return max(int(f[0]) + 1 for f in firsts) if all(len(f) for f in firsts) else None

  def __call__(self, example) -> bool:
    needed = self.needed(example)
    if needed is not None and needed <= self.length:
      self.dropped = 0
      return True
    self.dropped += 1
    if needed is not None:
      self.shortest = needed if self.shortest is None else min(self.shortest, needed)
    if self.limit and self.dropped >= self.limit:
      raise ConfigError(nothing_fits(self.where, self.length, self.examples, self.shortest))
    return False


def nothing_fits(where: str, length: int, examples: str, shortest: int | None) -> str:
  """The line for data of which no example fits (Fits)."""
  if examples == "documents":
    return f"no document of {where} has two tokens or more (one to read, one to predict); give non-empty documents"
  if shortest is None:
    return f"no record of {where} has a target in the loss; give records with a response"
  return (
    f"no record of {where} fits max_target_length={length}; the shortest needs {shortest} tokens: "
    f"set max_target_length={shortest} or more, or give shorter prompts"
  )


class Shift(grain.transforms.Map):
  """{"tokens", "mask"} (per prefix) -> {"inputs", "targets", "targets_mask"}, cut to `length` targets."""

  def __init__(self, length: int, prefixes: tuple[str, ...]):
    self.length = length
    self.prefixes = prefixes

  def map(self, example: dict) -> dict:
    out = {}
    for p in self.prefixes:
      tokens, mask = example[f"{p}tokens"][: self.length + 1], example[f"{p}mask"][: self.length + 1]
      out.update({f"{p}inputs": tokens[:-1], f"{p}targets": tokens[1:], f"{p}targets_mask": mask[1:]})
    return out


class Pad(grain.transforms.Map):
  """One example -> one row of `length`, with the keys packing gives: segment id 1 over the example, 0 after."""

  def __init__(self, length: int):
    self.length = length

  def map(self, example: dict) -> dict:
    row = {}
    for key, values in example.items():
      n = len(values)
      row[key] = np.pad(values, (0, self.length - n))
      row[f"{key}_segment_ids"] = (np.arange(self.length) < n).astype(np.int32)
      row[f"{key}_positions"] = np.where(np.arange(self.length) < n, np.arange(self.length), 0).astype(np.int32)
    return row


class Rename(grain.transforms.Map):
  """Grain's packed keys -> ours (BATCH_KEYS, under each prefix); targets outside a mask get segmentation 0."""

  def __init__(self, prefixes: tuple[str, ...]):
    self.prefixes = prefixes

  def map(self, batch: dict) -> dict:
    ours = {}
    for p in self.prefixes:
      for theirs, name in _RENAME.items():
        ours[p + name] = np.asarray(batch[p + theirs], np.int32)
      if f"{p}targets_mask" in batch:  # fine-tuning: targets outside the mask are not in the loss
        ours[f"{p}targets_segmentation"] *= np.asarray(batch[f"{p}targets_mask"], np.int32)
    return ours


def no_records(where: str, process_index: int, process_count: int) -> ConfigError:
  """The error for data of which this process's share is empty."""
  share = f" for process {process_index} of {process_count}" if process_count > 1 else ""
  return ConfigError(f"{where} holds no records{share}; give more records")


def make_dataset(  # noqa: PLR0913 (keyword-only, each named at the call: clearer than an options object)
  source,
  *,
  tokenize: Tokenize,
  length: int,
  rows: int,
  seed: int,
  num_epochs: int,
  process_index: int,
  process_count: int,
  text_key: str | None = None,
  shuffle: bool = True,
  worker_count: int = 0,
  max_document_tokens: int = 1 << 20,
  packing: bool = True,
  examples: str = "documents",
  where: str = "the data",
):
  """The Grain IterDataset of this process's batches: dicts of [rows, length] int32 arrays (our BATCH_KEYS).

  source: a random-access sequence of documents (str/bytes, or dicts holding the text under text_key).
  tokenize: a document -> its tokens (examples="documents"); a record -> sft.Conversation's {"tokens", "mask"}
    ("conversations") or sft.Preference's {"chosen_tokens", "chosen_mask", "rejected_tokens", ...} ("preferences").
  where: the data, for errors (e.g. "hf_train_files=chats/*.jsonl").
  """
  dataset = grain.MapDataset.source(source)[process_index::process_count]
  records = len(dataset)
  if not records:
    raise no_records(where, process_index, process_count)
  if shuffle:
    dataset = dataset.shuffle(seed=seed)
  dataset = dataset.repeat(None if num_epochs < 0 else num_epochs)
  if text_key is not None:
    dataset = dataset.map(operator.itemgetter(text_key))
  dataset = dataset.map(tokenize).to_iter_dataset().filter(Fits(length, examples, where, limit=2 * records))
  prefixes = PREFIXES.get(examples, ("",))
  if examples == "documents":
    dataset = grain_experimental.FlatMapIterDataset(dataset, Pieces(length, max_document_tokens // length + 1))
  else:
    dataset = dataset.map(Shift(length, prefixes))
  if packing:
    keys = ("inputs", "targets") if examples == "documents" else ("inputs", "targets", "targets_mask")
    dataset = grain_experimental.FirstFitPackIterDataset(
      dataset,
      length_struct={p + k: length for p in prefixes for k in keys},
      num_packing_bins=rows,
      shuffle_bins=False,
    )
  else:
    dataset = dataset.map(Pad(length))
  dataset = dataset.batch(rows, drop_remainder=True).map(Rename(prefixes))
  if worker_count > 0:
    from absl import flags  # Grain's workers read absl flags, which a non-absl program never parses.

    if not flags.FLAGS.is_parsed():
      flags.FLAGS.mark_as_parsed()
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
  return dataset


class TextIterator:
  """Global batches from a Grain dataset of this process's rows; get_state/set_state for exact resume."""

  def __init__(self, config: Config, mesh, dataset, batch_size: int | None = None):
    self.global_shape = (batch_size or config.global_batch_size, config.max_target_length)
    self.sharding = sharding.batch_sharding(mesh, config)
    self.iterator = iter(dataset)

  def __iter__(self):
    return self

  def __next__(self):
    local = next(self.iterator)
    return {k: sharding.make_global_array(v, self.sharding, self.global_shape) for k, v in local.items()}

  def get_state(self) -> dict:
    return self.iterator.get_state()

  def set_state(self, state: dict | bytes) -> None:
    self.iterator.set_state(json.loads(state) if isinstance(state, bytes) else state)

  def start_prefetch(self) -> None:
    """Called by Grain's checkpoint handler after a restore; prefetching starts on the next batch anyway."""
