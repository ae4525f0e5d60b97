"""Tokenizers behind one interface, chosen by `tokenizer_type` (MaxText's key and values):

  sentencepiece  a SentencePiece model (MaxText/train_tokenizer.py trains one)
  tiktoken       Llama 3's BPE file (`original/tokenizer.model`: lines of `base64(token) rank`) with Llama 3's
                 pre-tokenisation regex and its 256 special tokens numbered after the ranks
  huggingface    a Hugging Face `tokenizer.json`; BOS, EOS and pad come from the `tokenizer_config.json` beside it

`load(path, tokenizer_type)` gives a `Tokenizer`; `check_tokenizer(config)` loads the configured one and checks
it against the run. `Tokenize` is a picklable Grain transform: each worker process loads the file once, on first
use. Each library is imported only by its loader, so a machine without the other two still runs.
"""

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence

import numpy as np

from MaxText import storage
from MaxText.common_types import Config, ConfigError
from MaxText.sections import implement
from MaxText.sections.data import TOKENIZER_TYPES

_FILES = {
  "sentencepiece": "a SentencePiece model",
  "tiktoken": "a tiktoken BPE file (Llama 3's original/tokenizer.model)",
  "huggingface": "a Hugging Face tokenizer.json",
}


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A loaded tokenizer, whatever its library. `encode` adds no special tokens; an absent special token's id is -1.

  Chat templates write special tokens as text: `special_tokens` holds their strings under the names templates use
  ("bos_token", "eos_token", ...), and `encode_with_specials` reads those strings (all the tokenizer's special
  tokens) as the tokens themselves, as transformers' apply_chat_template does.
  """

  encode: Callable[[str], list[int]]
  decode: Callable[[Sequence[int]], str]
  bos_id: int
  eos_id: int
  pad_id: int
  vocab_size: int  # one more than the largest id, special tokens included
  special_tokens: dict[str, str]
  encode_with_specials: Callable[[str], list[int]]
  # Where decoding stops: the EOS and the model's other end-of-turn ids (a Hugging Face folder's
  # generation_config.json lists them: Llama 3's <|eot_id|> beside <|end_of_text|>), and where they came from.
  extra_end_ids: tuple[int, ...] = ()
  end_source: str = ""

  @property
  def end_ids(self) -> tuple[int, ...]:
    """The ids decoding stops at, sorted: eos_id (if any) and extra_end_ids."""
    return tuple(sorted({self.eos_id, *self.extra_end_ids} - {-1}))

  def describe_end(self) -> str:
    """One line naming the ids decoding stops at and where they came from."""
    if self.end_source:
      return f"stops at {self.end_source}"
    if self.eos_id >= 0:
      return f"stops at the tokenizer's EOS ({self.eos_id})"
    return "stops at no token: the tokenizer has no EOS (max lengths and stop sequences end a completion)"


def _split_specials(encode: Callable[[str], list[int]], ids: dict[str, int]) -> Callable[[str], list[int]]:
  """An encoder reading each string of `ids` (special token text -> id) as its token, the rest with `encode`."""
  if not ids:
    return encode
  pattern = re.compile("|".join(re.escape(token) for token in sorted(ids, key=len, reverse=True)))

  def encode_with_specials(text: str) -> list[int]:
    out, start = [], 0
    for match in pattern.finditer(text):
      out += encode(text[start : match.start()]) if match.start() > start else []
      out.append(ids[match.group()])
      start = match.end()
    return out + (encode(text[start:]) if start < len(text) else [])

  return encode_with_specials


def looks_like(path: str) -> str | None:
  """The tokenizer_type whose files start like `path` does (for error messages), or None."""
  with open(path, "rb") as f:
    head = f.read(1024)
  if head.lstrip().startswith(b"{"):
    return "huggingface"
  fields = head.split(b"\n", 1)[0].split()
  if len(fields) == 2 and fields[1].isdigit():  # base64 token, rank
    return "tiktoken"
  if head.startswith(b"\n"):  # the tag of field 1 (the pieces) of a SentencePiece ModelProto
    return "sentencepiece"
  return None


def _wrong_file(path: str, tokenizer_type: str, error: Exception) -> ConfigError:
  guess = looks_like(path)
  fix = f"set tokenizer_type={guess}" if guess and guess != tokenizer_type else f"give {_FILES[tokenizer_type]}"
  reason = " ".join(str(error).split())[:120]
  return ConfigError(f"tokenizer_path={path} is not {_FILES[tokenizer_type]} ({reason}); {fix}")


def _sentencepiece(path: str) -> Tokenizer:
  import sentencepiece as spm  # Lazy, like the other two libraries.

  try:
    model = spm.SentencePieceProcessor(model_file=path)
  except (OSError, RuntimeError) as e:
    raise _wrong_file(path, "sentencepiece", e) from None
  encode = lambda text: model.encode(text, out_type=int)  # noqa: E731
  named = {
    "bos_token": model.bos_id(),
    "eos_token": model.eos_id(),
    "unk_token": model.unk_id(),
    "pad_token": model.pad_id(),
  }
  specials = {name: model.id_to_piece(i) for name, i in named.items() if i >= 0}
  return Tokenizer(
    encode=encode,
    decode=model.decode,
    bos_id=model.bos_id(),
    eos_id=model.eos_id(),
    pad_id=model.pad_id(),
    vocab_size=model.get_piece_size(),
    special_tokens=specials,
    encode_with_specials=_split_specials(encode, {specials[n]: named[n] for n in specials if n != "unk_token"}),
  )


# Llama 3's pre-tokenisation regex and special tokens, as in Meta's llama3 tokenizer.py (and MaxText's
# TikTokenTokenizer): the 11 named ones, then reserved ones up to 256, with ids from len(ranks) on.
LLAMA3_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMED = (
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
  "<|finetune_right_pad_id|>",
  "<|step_id|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eom_id|>",
  "<|eot_id|>",
  "<|python_tag|>",
)
LLAMA3_SPECIAL_TOKENS = (
  *_LLAMA3_NAMED,
  *(f"<|reserved_special_token_{i}|>" for i in range(2, 2 + 256 - len(_LLAMA3_NAMED))),
)

# Meta's limits: tiktoken's regex runs out of backtracking stack on a long run of whitespace (1M spaces fail), so
# text is encoded in pieces of at most 400k characters, cut inside any run of whitespace or non-whitespace longer
# than 25k characters.
_MAX_CHARS = 400_000
_MAX_RUN = 25_000
_LONG_RUN = re.compile(rf"\s{{{_MAX_RUN + 1},}}|\S{{{_MAX_RUN + 1},}}")


def _pieces(text: str) -> list[str]:
  pieces = []
  for start in range(0, len(text), _MAX_CHARS):
    chunk = text[start : start + _MAX_CHARS]
    cuts = [cut for run in _LONG_RUN.finditer(chunk) for cut in range(run.start() + _MAX_RUN, run.end(), _MAX_RUN)]
    bounds = [0, *cuts, len(chunk)]
    pieces += [chunk[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
  return pieces


def _tiktoken(path: str) -> Tokenizer:
  import tiktoken
  from tiktoken.load import load_tiktoken_bpe

  with open(path, "rb") as f:
    digest = hashlib.sha256(f.read()).hexdigest()
  try:
    # tiktoken caches the file under a key of its path; the hash keeps it from serving an older file's ranks.
    ranks = load_tiktoken_bpe(path, expected_hash=digest)
  except ValueError as e:
    raise _wrong_file(path, "tiktoken", e) from None
  if sorted(ranks.values()) != list(range(len(ranks))) or any(bytes([b]) not in ranks for b in range(256)):
    raise _wrong_file(path, "tiktoken", ValueError("its ranks are not 0..n-1 over all 256 single bytes and merges"))
  specials = {token: len(ranks) + i for i, token in enumerate(LLAMA3_SPECIAL_TOKENS)}
  encoding = tiktoken.Encoding(
    name=os.path.basename(path), pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials
  )

  def encode(text: str) -> list[int]:
    # Special tokens' text is ordinary text here (Meta's defaults): a document never injects a control token.
    return [t for piece in _pieces(text) for t in encoding.encode(piece, allowed_special=set(), disallowed_special=())]

  return Tokenizer(
    encode=encode,
    decode=encoding.decode,
    bos_id=specials["<|begin_of_text|>"],
    eos_id=specials["<|end_of_text|>"],
    pad_id=-1,
    vocab_size=encoding.n_vocab,
    special_tokens={"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
    encode_with_specials=lambda text: [
      t for piece in _pieces(text) for t in encoding.encode(piece, allowed_special="all", disallowed_special=())
    ],
  )


def _special_tokens(config_path: str) -> dict[str, str]:
  """{"bos": token, "eos": ..., "pad": ..., "unk": ...} named by a tokenizer_config.json (strings or {"content": ...})."""
  if not os.path.isfile(config_path):
    return {}
  try:
    with open(config_path, encoding="utf-8") as f:
      values = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{config_path} is not a JSON file ({' '.join(str(e).split())[:120]}); fix or remove it") from None
  tokens = {}
  for name in ("bos", "eos", "pad", "unk"):
    token = values.get(f"{name}_token") if isinstance(values, dict) else None
    token = token.get("content") if isinstance(token, dict) else token
    if token is not None:
      tokens[name] = token
  return tokens


def _huggingface(path: str) -> Tokenizer:
  import tokenizers

  try:
    model = tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception for a file it cannot parse)
    raise _wrong_file(path, "huggingface", e) from None
  config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
  ids = {}
  tokens = _special_tokens(config_path)
  for name, token in list(tokens.items()):
    ids[name] = model.token_to_id(token)
    if ids[name] is None and name == "unk":  # only chat templates read it, and none relies on it
      del tokens[name], ids[name]
    elif ids[name] is None:
      raise ConfigError(f"{config_path} names {name}_token={token!r}, which {path} lacks; fix one of the two files")
  encode = lambda text: model.encode(text, add_special_tokens=False).ids  # noqa: E731
  vocab_size = max(model.get_vocab(with_added_tokens=True).values(), default=-1) + 1
  generation_path = os.path.join(os.path.dirname(path), "generation_config.json")
  generation_ends = _generation_end_ids(generation_path, vocab_size)
  named_by = {i: [f"{os.path.basename(generation_path)}'s eos_token_id"] for i in generation_ends}
  if ids.get("eos") is not None:
    named_by.setdefault(ids["eos"], []).insert(0, f"{os.path.basename(config_path)}'s eos_token")
  return Tokenizer(
    encode=encode,
    decode=model.decode,
    bos_id=ids.get("bos", -1),
    eos_id=ids.get("eos", -1),
    pad_id=ids.get("pad", -1),
    vocab_size=vocab_size,
    special_tokens={f"{name}_token": token for name, token in tokens.items()},
    encode_with_specials=encode,  # tokenizers reads added tokens in text as the tokens (transformers' default)
    extra_end_ids=generation_ends,
    end_source="; ".join(f"{model.id_to_token(i)} ({i}), {' and '.join(w)}" for i, w in sorted(named_by.items())),
  )


def _generation_end_ids(path: str, vocab_size: int) -> tuple[int, ...]:
  """The eos_token_id of a Hugging Face generation_config.json (one id or a list; none without the file): the ids
  transformers' generate() stops at."""
  if not os.path.isfile(path):
    return ()
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(f"{path} is not a JSON file ({' '.join(str(e).split())[:120]}); fix or remove it") from None
  ends = value.get("eos_token_id") if isinstance(value, dict) else None
  ends = [ends] if ends is None or isinstance(ends, int) else ends
  if not isinstance(ends, list) or any(type(i) is not int or not 0 <= i < vocab_size for i in ends if i is not None):
    raise ConfigError(
      f"{path}: eos_token_id={str(ends)[:80]} must be a token id or a list of ids in [0, {vocab_size}); fix or remove it"
    )
  return tuple(sorted({i for i in ends if i is not None}))


LOADERS = implement(TOKENIZER_TYPES, {"sentencepiece": _sentencepiece, "tiktoken": _tiktoken, "huggingface": _huggingface})


def load(path: str, tokenizer_type: str = "sentencepiece") -> Tokenizer:
  """The tokenizer in the file `path`, of `tokenizer_type` (a key of LOADERS); raises ConfigError."""
  if tokenizer_type not in LOADERS:
    raise ConfigError(f"tokenizer_type={tokenizer_type!r} is not supported; choose one of {', '.join(map(repr, LOADERS))}")
  path = os.path.expanduser(path)
  if os.path.isdir(path):
    raise ConfigError(f"tokenizer_path={path} is a folder; give {_FILES[tokenizer_type]} file inside it")
  hint = f"give {_FILES[tokenizer_type]}"
  if tokenizer_type == "sentencepiece" and not os.path.lexists(path):
    hint = "build the demo one with `bash setup.sh` or train one with MaxText/train_tokenizer.py"
  storage.check_file("tokenizer_path", path, hint)
  return LOADERS[tokenizer_type](path)


def check_specials(tokenizer: Tokenizer, path: str, tokenizer_type: str, add_bos: bool, add_eos: bool) -> None:
  """Raises ConfigError if add_bos / add_eos ask for a token the tokenizer lacks."""
  for name, wanted, token_id in (("bos", add_bos, tokenizer.bos_id), ("eos", add_eos, tokenizer.eos_id)):
    if wanted and token_id < 0:
      also = f", or name a {name}_token in tokenizer_config.json beside it" if tokenizer_type == "huggingface" else ""
      raise ConfigError(
        f"tokenizer_path={path} (tokenizer_type={tokenizer_type}) has no {name.upper()} token but add_{name}=true; "
        f"set add_{name}=false{also}"
      )


def check_tokenizer(config: Config) -> Tokenizer:
  """The configured tokenizer, after checking it loads, fits the model and has the BOS/EOS asked for;
  raises ConfigError."""
  path = os.path.expanduser(config.tokenizer_path)
  if not path:
    raise ConfigError(
      f"dataset_type={config.dataset_type} needs tokenizer_path= (and tokenizer_type=, one of {', '.join(LOADERS)}); "
      "build a SentencePiece one with MaxText/train_tokenizer.py"
    )
  tokenizer = load(path, config.tokenizer_type)
  if tokenizer.vocab_size > config.vocab_size:
    raise ConfigError(
      f"tokenizer_path={path} has {tokenizer.vocab_size} tokens but vocab_size={config.vocab_size}; "
      f"set vocab_size >= {tokenizer.vocab_size} (or use a smaller tokenizer)"
    )
  check_specials(tokenizer, path, config.tokenizer_type, config.add_bos, config.add_eos)
  return tokenizer


@dataclasses.dataclass
class Tokenize:
  """Text (str or UTF-8 bytes) -> int32 token ids, with BOS/EOS as configured."""

  path: str
  tokenizer_type: str
  add_bos: bool
  add_eos: bool

  @classmethod
  def from_config(cls, config: Config) -> "Tokenize":
    return cls(os.path.expanduser(config.tokenizer_path), config.tokenizer_type, config.add_bos, config.add_eos)

  def __post_init__(self):
    self._tokenizer = None

  def __getstate__(self):
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._tokenizer = None

  def __call__(self, text) -> np.ndarray:
    if self._tokenizer is None:
      tokenizer = load(self.path, self.tokenizer_type)
      check_specials(tokenizer, self.path, self.tokenizer_type, self.add_bos, self.add_eos)
      self._tokenizer = tokenizer
    if isinstance(text, bytes):
      try:
        text = text.decode("utf-8")
      except UnicodeDecodeError as e:
        raise ConfigError(
          f"a document is not UTF-8 text (byte {e.start}: {text[e.start : e.start + 1]!r}); fix the data"
        ) from None
    if not isinstance(text, str):
      raise ConfigError(f"a document is a {type(text).__name__}, not text; give a text column in train_data_columns")
    ids = self._tokenizer.encode(text)
    if self.add_bos:
      ids = [self._tokenizer.bos_id, *ids]
    if self.add_eos:
      ids = [*ids, self._tokenizer.eos_id]
    return np.asarray(ids, np.int32)
