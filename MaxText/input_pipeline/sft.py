"""Supervised fine-tuning data (use_sft=true): one record -> its tokens and the mask of those the loss sees.

Columns (train_data_columns / eval_data_columns, as in MaxText), one of COLUMN_SETS:
  messages             a list of {"role", "content"} turns: an optional first system turn, then user and assistant
  prompt, completion   one user turn and one assistant turn (question, answer: the same under other names)

Rendering:
  use_chat_template=true   the turns go through a Jinja chat template exactly as transformers' apply_chat_template
                           renders and tokenizes them: the text of special tokens in the rendering ("<|im_end|>",
                           "</s>") becomes those tokens, and add_bos/add_eos are the template's business. The template
                           is `chat_template` (its text), else the file `chat_template_path` (a .jinja file, or a JSON
                           file with a "chat_template" entry), else the tokenizer's own (TEMPLATE_FILES beside
                           tokenizer_path: chat_template.jinja, chat_template.json or tokenizer_config.json), else
                           FALLBACK_TEMPLATE. A run prints which, once: "chat template: <source>".
  use_chat_template=false  prompt and completion are plain text: [BOS] prompt completion [EOS].

The mask: with sft_train_on_completion_only=true, the tokens of assistant turns (their end-of-turn token included,
so the model learns to stop). The assistant turn k spans from where the rendering of turns[:k] with the generation
prompt stops agreeing with the whole conversation's tokens to where turns[:k+1] does: the tokens are always the
whole conversation's own, never pieces tokenized apart. Otherwise every token is in the loss.
"""

import dataclasses
import json
import os
import unicodedata
from datetime import datetime

import numpy as np

from MaxText import storage
from MaxText.common_types import ConfigError
from MaxText.input_pipeline import tokenizer as tokenizer_lib

COLUMN_SETS = (("messages",), ("prompt", "completion"), ("question", "answer"))
PREFERENCE_COLUMN_SETS = (("prompt", "chosen", "rejected"), ("chosen", "rejected"))
ROLES = ("system", "user", "assistant", "tool")

# For tokenizers without a chat template of their own (SentencePiece and tiktoken files carry none):
#   <s>System: ...\nUser: ...\nAssistant: ...</s>\nUser: ...\nAssistant:
# The generation prompt ends at "Assistant:" and a reply starts with its space, as a SentencePiece piece does.
FALLBACK_TEMPLATE = (
  "{{ bos_token }}"
  "{% for message in messages %}"
  "{% if message['role'] == 'assistant' %}"
  "{{ 'Assistant: ' + message['content'] + eos_token + '\\n' }}"
  "{% else %}"
  "{{ message['role'] | capitalize + ': ' + message['content'] + '\\n' }}"
  "{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def check_preference_columns(columns, key: str) -> tuple[str, ...]:
  columns = tuple(columns)
  if columns not in PREFERENCE_COLUMN_SETS:
    sets = " or ".join(str(list(s)) for s in PREFERENCE_COLUMN_SETS)
    raise ConfigError(f"{key}={list(columns)} does not name preference pairs for use_dpo=true; give {sets}")
  return columns


def check_columns(columns, key: str, use_chat_template: bool) -> tuple[str, ...]:
  columns = tuple(columns)
  if not any(sorted(columns) == sorted(s) for s in COLUMN_SETS):
    sets = " or ".join(str(list(s)) for s in COLUMN_SETS)
    raise ConfigError(f"{key}={list(columns)} does not name a conversation for use_sft=true; give {sets}")
  if columns == ("messages",) and not use_chat_template:
    raise ConfigError(f"{key}=['messages'] needs a chat template to render its turns; set use_chat_template=true")
  return columns


# Where a tokenizer keeps its chat template, beside its file, in the order looked at: transformers 5 saves
# chat_template.jinja; a processor's chat_template.json and transformers 4.x's tokenizer_config.json hold it as JSON.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")

# The sources find_template has named in this process: each is said once (a server looks its template up per request).
_announced: set[str] = set()


def find_template(chat_template: str, chat_template_path: str, tokenizer_path: str) -> tuple[str, str]:
  """(the Jinja template, where it came from) by the precedence in the module docstring; raises ConfigError. The
  first time a source is found in a process, one line on stdout names it ("chat template: ..."), so every run that
  renders chat (fine-tuning, decode.py, serve.py) says which template it uses."""
  if chat_template:
    found, said = (chat_template, "chat_template"), "the chat_template key's text"
  elif chat_template_path:
    path = os.path.expanduser(chat_template_path)
    storage.check_file("chat_template_path", path, "give a .jinja file or a tokenizer_config.json")
    found = _read_template(path, "chat_template_path"), path
    said = f"{path} (chat_template_path)"
  elif (own := tokenizer_template(tokenizer_path)) is not None:
    found, said = own, f"{own[1]} (the tokenizer's)"
  else:
    found = FALLBACK_TEMPLATE, "the fallback template (MaxText/input_pipeline/sft.py)"
    names = " or ".join(TEMPLATE_FILES[:2]) + " or tokenizer_config.json with one"
    said = f"the fallback template (MaxText/input_pipeline/sft.py): no {names} beside tokenizer_path={tokenizer_path}"
  if said not in _announced:
    _announced.add(said)
    print(f"chat template: {said}", flush=True)
  return found


def tokenizer_template(tokenizer_path: str) -> tuple[str, str] | None:
  """(the chat template, its file) that the tokenizer keeps beside `tokenizer_path` (TEMPLATE_FILES), or None."""
  if not tokenizer_path:
    return None
  folder = os.path.dirname(os.path.expanduser(tokenizer_path))
  for name in TEMPLATE_FILES:
    path = os.path.join(folder, name)
    if os.path.isfile(path) and (template := _read_template(path, None)):
      return template, path
  return None


def _read_template(path: str, key: str | None) -> str | None:
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
  if not path.endswith(".json"):
    return text
  try:
    template = json.loads(text).get("chat_template")
  except (ValueError, AttributeError, RecursionError):
    raise ConfigError(f"{path} is not a JSON object; fix it or give a .jinja file") from None
  if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
    template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}.get("default")
  if template is not None and not isinstance(template, str):
    raise ConfigError(f"{path}: its chat_template is a {type(template).__name__}, not the template's text; fix it")
  if template is None and key:
    raise ConfigError(f"{key}={path} holds no chat_template; give a file that does")
  return template


def compile_template(template: str):
  """The Jinja template in the environment transformers renders chat templates in: a sandbox trimming blocks,
  loop controls, a `{% generation %}` block that renders its body, tojson without HTML escapes,
  raise_exception and strftime_now."""
  import jinja2  # Lazy: only chat templates need Jinja.
  import jinja2.ext
  import jinja2.nodes
  import jinja2.sandbox

  class Generation(jinja2.ext.Extension):
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return jinja2.nodes.Scope(body).set_lineno(lineno)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateSyntaxError as e:
    raise ConfigError(f"the chat template does not parse (line {e.lineno}: {e.message}); fix it") from None


def render(compiled, tokenizer: tokenizer_lib.Tokenizer, turns: list[dict], add_generation_prompt: bool) -> list[int]:
  """The tokens of `turns` through a compiled chat template, as transformers' apply_chat_template(tokenize=True)."""
  import jinja2

  try:
    text = compiled.render(messages=turns, add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens)
  except jinja2.exceptions.TemplateError as e:
    raise ConfigError(
      f"the chat template refuses a conversation ({e}; {_short(turns)}); fix the data or the template"
    ) from None
  return tokenizer.encode_with_specials(text)


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
          raise ConfigError(f"{self.key}: a record's column {column!r} is {_short(values[column])}, not a string")
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
          f"{self.key}: a record's {name} response has no tokens after its prompt ({_short(values[name])}); "
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
      raise ConfigError(f"{self.key}: a record's column {column!r} is {_short(value)}, not a string{turns}")
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


def check_turns(turns, key: str, need_assistant: bool = True) -> list[dict]:
  if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
    raise ConfigError(f"{key}: a conversation is {_short(turns)}, not a list of {{'role', 'content'}} turns")
  for i, turn in enumerate(turns):
    if turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
      raise ConfigError(
        f"{key}: turn {i} of a conversation is {_short(turn)}; each turn needs a role in {list(ROLES)} and a string content"
      )
    if turn["role"] == "system" and i > 0:
      raise ConfigError(f"{key}: a conversation has a system turn at position {i}; only the first turn may be one")
  if need_assistant and not any(t["role"] == "assistant" for t in turns):
    raise ConfigError(f"{key}: a conversation has no assistant turn ({_short(turns)}); SFT trains on assistant turns")
  return [{k: v for k, v in t.items() if v is not None} for t in turns]  # transformers drops None values too


def _short(value) -> str:
  """`value` as JSON cut to 80 characters, its control characters escaped (json.dumps leaves DEL and C1)."""
  text = json.dumps(value, ensure_ascii=False, default=repr)
  text = text if len(text) <= 80 else text[:77] + "..."
  return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cc" else c for c in text)
