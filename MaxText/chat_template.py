"""Chat templates: finding a tokenizer's, compiling it as transformers does, and rendering conversations to tokens.

The one rendering of conversations, beside the tokenizer (input_pipeline/tokenizer.py): fine-tuning data
(input_pipeline/sft.py), RL prompts and decode.py (inference/prompts.py) and the server's chat route all render
through `render`, so a model is served exactly as it was fine-tuned.

The template is `chat_template` (its text), else the file `chat_template_path` (a .jinja file, or a JSON file with a
"chat_template" entry), else the tokenizer's own (TEMPLATE_FILES beside tokenizer_path: chat_template.jinja,
chat_template.json or tokenizer_config.json), else FALLBACK_TEMPLATE. A run prints which, once: "chat template:
<source>". Rendering is transformers' apply_chat_template(tokenize=True): the text of special tokens in the
rendering ("<|im_end|>", "</s>") becomes those tokens, and BOS and EOS are the template's business.

This module imports neither jax nor the data pipeline: the tokenizer is any object with `special_tokens` (the names
a template reads: bos_token, eos_token, ...) and `encode_with_specials`.
"""

import json
import os
import unicodedata
from datetime import datetime

from MaxText import storage
from MaxText.common_types import ConfigError

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
    found = FALLBACK_TEMPLATE, "the fallback template (MaxText/chat_template.py)"
    names = " or ".join(TEMPLATE_FILES[:2]) + " or tokenizer_config.json with one"
    said = f"the fallback template (MaxText/chat_template.py): no {names} beside tokenizer_path={tokenizer_path}"
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


def render(compiled, tokenizer, turns: list[dict], add_generation_prompt: bool) -> list[int]:
  """The tokens of `turns` through a compiled chat template, as transformers' apply_chat_template(tokenize=True)."""
  import jinja2

  try:
    text = compiled.render(messages=turns, add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens)
  except jinja2.exceptions.TemplateError as e:
    raise ConfigError(
      f"the chat template refuses a conversation ({e}; {quoted(turns)}); fix the data or the template"
    ) from None
  return tokenizer.encode_with_specials(text)


def check_turns(turns, key: str, need_assistant: bool = True) -> list[dict]:
  """`turns` as a template renders them (a list of {"role", "content"} turns, a system turn only first; with
  `need_assistant`, one assistant turn at least); ConfigError naming `key` otherwise."""
  if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
    raise ConfigError(f"{key}: a conversation is {quoted(turns)}, not a list of {{'role', 'content'}} turns")
  for i, turn in enumerate(turns):
    if turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
      raise ConfigError(
        f"{key}: turn {i} of a conversation is {quoted(turn)}; each turn needs a role in {list(ROLES)} and a string content"
      )
    if turn["role"] == "system" and i > 0:
      raise ConfigError(f"{key}: a conversation has a system turn at position {i}; only the first turn may be one")
  if need_assistant and not any(t["role"] == "assistant" for t in turns):
    raise ConfigError(f"{key}: a conversation has no assistant turn ({quoted(turns)}); SFT trains on assistant turns")
  return [{k: v for k, v in t.items() if v is not None} for t in turns]  # transformers drops None values too


def quoted(value) -> str:
  """`value` as JSON cut to 80 characters, its control characters escaped (json.dumps leaves DEL and C1)."""
  text = json.dumps(value, ensure_ascii=False, default=repr)
  text = text if len(text) <= 80 else text[:77] + "..."
  return "".join(f"\\u{ord(c):04x}" if unicodedata.category(c) == "Cc" else c for c in text)
