"""Prompts as token ids, the way every consumer of the engine builds them (decode.py, the server, evaluation, RL)."""

import functools

from MaxText import chat_template
from MaxText.common_types import Config
from MaxText.input_pipeline import tokenizer as tokenizer_lib


def text_tokens(config: Config, tokenizer: tokenizer_lib.Tokenizer, text: str) -> list[int]:
  """A plain prompt: [BOS] (with add_bos) and the text's tokens."""
  return ([tokenizer.bos_id] if config.add_bos else []) + tokenizer.encode(text)


def chat_tokens(config: Config, tokenizer: tokenizer_lib.Tokenizer, messages: list[dict]) -> list[int]:
  """A conversation rendered by the chat template as fine-tuning renders it (MaxText/chat_template.py: the template
  of chat_template, chat_template_path or the tokenizer's folder), followed by the generation prompt."""
  template, _ = chat_template.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
  return chat_template.render(_compiled(template), tokenizer, messages, add_generation_prompt=True)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
  """A template compiled once (every chat prompt of a run renders with it)."""
  return chat_template.compile_template(template)


def prompt_tokens(config: Config, tokenizer: tokenizer_lib.Tokenizer, prompts: list[str]) -> list[list[int]]:
  """Each prompt's tokens: [BOS] prompt, or with use_chat_template a user turn and the generation prompt."""
  if not config.use_chat_template:
    return [text_tokens(config, tokenizer, p) for p in prompts]
  return [chat_tokens(config, tokenizer, [{"role": "user", "content": p}]) for p in prompts]
