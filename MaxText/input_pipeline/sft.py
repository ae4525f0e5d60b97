"""Supervised fine-tuning data (objective=sft): one record -> its tokens and the mask of those the loss sees.

Columns (train_data_columns / eval_data_columns, as in MaxText), one of COLUMN_SETS:
  messages             a list of {"role", "content"} turns: an optional first system turn, then user and assistant
  prompt, completion   one user turn and one assistant turn (question, answer: the same under other names)

Rendering:
  use_chat_template=true   the turns go through the chat template exactly as transformers' apply_chat_template
                           renders and tokenizes them (MaxText/chat_template.py: which template, and the rendering the
                           server and RL use too); add_bos/add_eos are the template's business.
  use_chat_template=false  prompt and completion are plain text: [BOS] prompt completion [EOS].

The mask: with sft_train_on_completion_only=true, the tokens of assistant turns (their end-of-turn token included,
so the model learns to stop). The assistant turn k spans from where the rendering of turns[:k] with the generation
prompt stops agreeing with the whole conversation's tokens to where turns[:k+1] does: the tokens are always the
whole conversation's own, never pieces tokenized apart. Otherwise every token is in the loss.
"""

import dataclasses
import json

import numpy as np

from MaxText.chat_template import (
  check_turns,
  compile_template,
  quoted,
  render,
)
from MaxText.common_types import ConfigError
from MaxText.input_pipeline import tokenizer as tokenizer_lib

COLUMN_SETS = (("messages",), ("prompt", "completion"), ("question", "answer"))
PREFERENCE_COLUMN_SETS = (("prompt", "chosen", "rejected"), ("chosen", "rejected"))


def check_preference_columns(columns, key: str) -> tuple[str, ...]:
  columns = tuple(columns)
  if columns not in PREFERENCE_COLUMN_SETS:
    sets = " or ".join(str(list(s)) for s in PREFERENCE_COLUMN_SETS)
    raise ConfigError(f"{key}={list(columns)} does not name preference pairs for objective=dpo; give {sets}")
  return columns


def check_columns(columns, key: str, use_chat_template: bool) -> tuple[str, ...]:
  columns = tuple(columns)
  if not any(sorted(columns) == sorted(s) for s in COLUMN_SETS):
    sets = " or ".join(str(list(s)) for s in COLUMN_SETS)
    raise ConfigError(f"{key}={list(columns)} does not name a conversation for objective=sft; give {sets}")
  if columns == ("messages",) and not use_chat_template:
    raise ConfigError(f"{key}=['messages'] needs a chat template to render its turns; set use_chat_template=true")
  return columns


def _common_prefix(a: list[int], b: list[int]) -> int:
  n = min(len(a), len(b))
  differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
  return int(differ[0]) if len(differ) else n


@dataclasses.dataclass
class Conversation:
  """A picklable Grain transform: a record (a dict, or UTF-8 JSON bytes) -> {"tokens", "mask"} int32 arrays."""

  tokenizer_path: str
  tokenizer_type: str
  columns: tuple[str, ...]
  key: str  # the config key naming the columns, for errors
  template: str | None  # None: plain prompt + completion
  completion_only: bool
  add_bos: bool
  add_eos: bool

  def __post_init__(self):
    self._loaded = None  # (tokenizer, compiled template or None), set at once: Grain maps from several threads

  def __getstate__(self):
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._loaded = None

  def _load(self) -> None:
    if self._loaded is None:
      tokenizer = tokenizer_lib.load(self.tokenizer_path, self.tokenizer_type)
      self._loaded = (tokenizer, compile_template(self.template) if self.template is not None else None)

  def _tokens_of(self, turns: list[dict], add_generation_prompt: bool) -> list[int]:
    return render(self._loaded[1], self._loaded[0], turns, add_generation_prompt)

  def __call__(self, record) -> dict[str, np.ndarray]:
    self._load()
    turns = self.turns(record)
    if self.template is None:
      tokens, mask = self._plain(turns)
    elif self.completion_only:
      tokens, mask = self._templated(turns)
    else:  # every token in the loss: no prefix renderings needed
      tokens = self._tokens_of(turns, add_generation_prompt=False)
    if not self.completion_only:
      mask = [1] * len(tokens)
    return {"tokens": np.asarray(tokens, np.int32), "mask": np.asarray(mask, np.int32)}

  def values(self, record) -> dict:
    """The record's columns (bytes decoded); raises ConfigError."""
    if isinstance(record, bytes):
      try:
        record = json.loads(record)
      except (ValueError, RecursionError):  # RecursionError: nested deeper than Python's stack
        raise ConfigError(f"{self.key}: a record is not a JSON object; write each record as UTF-8 JSON") from None
    if not isinstance(record, dict):
      raise ConfigError(f"{self.key}: a record is a {type(record).__name__}, not an object of columns")
    missing = [c for c in self.columns if c not in record]
    if missing:
      raise ConfigError(
        f"{self.key}={list(self.columns)}: a record has no column {missing[0]!r} (it has {sorted(record)}); "
        f"set {self.key} to the record's columns"
      )
    return {c: decoded(record[c]) for c in self.columns}

  def turns(self, record) -> list[dict]:
    """The record's conversation as validated {"role", "content"} turns; raises ConfigError."""
    values = self.values(record)
    if self.columns == ("messages",):
      turns = values["messages"]
    else:
      prompt, completion = self.columns if self.columns[0] in ("prompt", "question") else self.columns[::-1]
      for column in (prompt, completion):
        if not isinstance(values[column], str):
          raise ConfigError(f"{self.key}: a record's column {column!r} is {quoted(values[column])}, not a string")
      turns = [{"role": "user", "content": values[prompt]}, {"role": "assistant", "content": values[completion]}]
    return check_turns(turns, self.key)

  def _plain(self, turns: list[dict]) -> tuple[list[int], list[int]]:
    tok = self._loaded[0]
    prompt, completion = tok.encode(turns[0]["content"]), tok.encode(turns[1]["content"])
    bos, eos = [tok.bos_id] * self.add_bos, [tok.eos_id] * self.add_eos
    return bos + prompt + completion + eos, [0] * (len(bos) + len(prompt)) + [1] * (len(completion) + len(eos))

  def _templated(self, turns: list[dict]) -> tuple[list[int], list[int]]:
    tokens_of = self._tokens_of
    tokens = tokens_of(turns, add_generation_prompt=False)
    mask = [0] * len(tokens)
    for k, turn in enumerate(turns):
      if turn["role"] != "assistant":
        continue
      start = _common_prefix(tokens, tokens_of(turns[:k], add_generation_prompt=True))
      end = _common_prefix(tokens, tokens_of(turns[: k + 1], add_generation_prompt=False))
      if end <= start:
        raise ConfigError(
          f"the chat template renders nothing for assistant turn {k} of a conversation; "
          "give a template that writes each assistant turn after its generation prompt"
        )
      mask[start:end] = [1] * (end - start)
    return tokens, mask


@dataclasses.dataclass
class Preference(Conversation):
  """DPO's transform: a record -> {"chosen_tokens", "chosen_mask", "rejected_tokens", "rejected_mask"}, each mask
  covering its response (the tokens after the prompt, its end-of-turn or EOS included).

  Columns: prompt, chosen, rejected (strings, or with a chat template lists of turns: the prompt's, then each
  response's assistant turns), or chosen, rejected alone: two whole conversations whose common tokens are the prompt.
  """

  def __call__(self, record) -> dict[str, np.ndarray]:
    self._load()
    values = self.values(record)
    if "prompt" in values:
      prompt = self._as_turns(values["prompt"], "user", "prompt")
      pairs = [self._after_prompt(prompt, self._as_turns(values[c], "assistant", c)) for c in ("chosen", "rejected")]
    else:
      whole = [self._whole(values[c], c) for c in ("chosen", "rejected")]
      start = _common_prefix(*whole)
      pairs = [(tokens, start) for tokens in whole]
    out = {}
    for name, (tokens, start) in zip(("chosen", "rejected"), pairs, strict=True):
      if start >= len(tokens):
        raise ConfigError(
          f"{self.key}: a record's {name} response has no tokens after its prompt ({quoted(values[name])}); "
          "give chosen and rejected responses that differ from the prompt"
        )
      out[f"{name}_tokens"] = np.asarray(tokens, np.int32)
      out[f"{name}_mask"] = (np.arange(len(tokens)) >= start).astype(np.int32)
    return out

  def _as_turns(self, value, role: str, column: str) -> list[dict] | str:
    if isinstance(value, str):
      return value if self.template is None else [{"role": role, "content": value}]
    if not isinstance(value, list):
      turns = " or a list of turns" if self.template is not None else ""
      raise ConfigError(f"{self.key}: a record's column {column!r} is {quoted(value)}, not a string{turns}")
    if self.template is None:
      raise ConfigError(f"{self.key}: column {column!r} holds turns, which need a chat template; set use_chat_template=true")
    return check_turns(value, self.key, need_assistant=role == "assistant")

  def _after_prompt(self, prompt, response) -> tuple[list[int], int]:
    tok = self._loaded[0]
    if self.template is None:
      head = [tok.bos_id] * self.add_bos + tok.encode(prompt)
      return head + tok.encode(response) + [tok.eos_id] * self.add_eos, len(head)
    tokens = self._tokens_of(prompt + response, add_generation_prompt=False)
    return tokens, _common_prefix(tokens, self._tokens_of(prompt, add_generation_prompt=True))

  def _whole(self, value, column: str) -> list[int]:
    tok = self._loaded[0]
    if self.template is not None:
      return self._tokens_of(self._as_turns(value, "assistant", column), add_generation_prompt=False)
    if not isinstance(value, str):
      self._as_turns(value, "assistant", column)  # raises: turns need a template
    return [tok.bos_id] * self.add_bos + tok.encode(value) + [tok.eos_id] * self.add_eos


def decoded(value):
  """Bytes (TFDS) -> str, through lists and dicts."""
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, dict):
    return {k: decoded(v) for k, v in value.items()}
  if isinstance(value, (list, tuple, np.ndarray)):
    return [decoded(v) for v in value]
  return value
