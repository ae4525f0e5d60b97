"""SentencePiece tokenization for the text pipelines.

`Tokenize` is a picklable Grain transform: each worker process loads the model file once, on first use.
"""

import dataclasses
import os

import numpy as np

from MaxText.pyconfig import Config, ConfigError


def check_tokenizer(config: Config) -> int:
  """The tokenizer's vocabulary size, after checking it exists and fits the model; raises ConfigError."""
  path = os.path.expanduser(config.tokenizer_path)
  if not path:
    raise ConfigError(f"dataset_type={config.dataset_type} needs tokenizer_path=; build one with MaxText/train_tokenizer.py")
  if not os.path.isfile(path):
    raise ConfigError(
      f"tokenizer_path={path} does not exist; build the demo one with `python3 MaxText/build_demo_dataset.py` "
      "or train one with MaxText/train_tokenizer.py"
    )
  size = load(path).get_piece_size()
  if size > config.vocab_size:
    raise ConfigError(
      f"tokenizer_path={path} has {size} tokens but vocab_size={config.vocab_size}; set vocab_size >= {size} "
      "(or use a smaller tokenizer)"
    )
  return size


def load(path: str):
  import sentencepiece as spm  # Lazy: only text pipelines need it.

  try:
    return spm.SentencePieceProcessor(model_file=os.path.expanduser(path))
  except (OSError, RuntimeError) as e:
    raise ConfigError(f"tokenizer_path={path} is not a SentencePiece model ({str(e).splitlines()[0][:120]})") from None


@dataclasses.dataclass
class Tokenize:
  """Text (str or UTF-8 bytes) -> int32 token ids, with BOS/EOS as configured."""

  path: str
  add_bos: bool
  add_eos: bool

  def __post_init__(self):
    self._processor = None

  def __getstate__(self):
    return {"path": self.path, "add_bos": self.add_bos, "add_eos": self.add_eos}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._processor = None

  def __call__(self, text) -> np.ndarray:
    if self._processor is None:
      self._processor = load(self.path)
    if isinstance(text, bytes):
      text = text.decode("utf-8")
    ids = self._processor.encode(text, out_type=int)
    if self.add_bos:
      ids = [self._processor.bos_id(), *ids]
    if self.add_eos:
      ids = [*ids, self._processor.eos_id()]
    return np.asarray(ids, np.int32)
