"""Chat templates (MaxText/chat_template.py): the fallback template written out, and one rendering for serving,
fine-tuning and RL / decode.py, against SentencePiece's own encoding of the text written out by hand."""

import types

import pytest

from MaxText import chat_template
from MaxText.common_types import ConfigError
from MaxText.inference import prompts
from MaxText.input_pipeline import sft
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.server import chat as server_chat
from MaxText.server import protocol
from MaxText.tests.helpers import config

TURNS = [
  {"role": "system", "content": "be brief"},
  {"role": "user", "content": "hi"},
  {"role": "assistant", "content": "hello"},
  {"role": "user", "content": "more"},
]
# FALLBACK_TEMPLATE's rendering of TURNS, written out: BOS, a line per turn, an assistant turn ending in EOS.
WRITTEN = "<s>System: be brief\nUser: hi\nAssistant: hello</s>\nUser: more\n"


class Recording:
  """A tokenizer whose encoding is the rendered text itself (what the template wrote, before any tokenizer)."""

  special_tokens = {"bos_token": "<s>", "eos_token": "</s>"}

  def encode_with_specials(self, text: str) -> list[str]:
    return [text]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
  from MaxText import train_tokenizer

  root = tmp_path_factory.mktemp("chat")
  texts = [f"System: be brief {n}. User: hi, more. Assistant: hello {n}" for n in range(60)]
  train_tokenizer.train(texts * 2, vocab_size=296, output=str(root / "tok.model"))
  return str(root / "tok.model")


def test_the_fallback_template_renders_as_written_out():
  compiled = chat_template.compile_template(chat_template.FALLBACK_TEMPLATE)
  assert chat_template.render(compiled, Recording(), TURNS, add_generation_prompt=False) == [WRITTEN]
  assert chat_template.render(compiled, Recording(), TURNS, add_generation_prompt=True) == [WRITTEN + "Assistant:"]


def test_serving_fine_tuning_and_decoding_render_a_conversation_alike(spm):
  """The server's chat route, decode.py and RL's prompts (inference/prompts.py) and fine-tuning's records
  (input_pipeline/sft.py) give the tokens of the text written out, its special tokens' texts as their ids."""
  import sentencepiece

  sp = sentencepiece.SentencePieceProcessor(model_file=spm)
  body = WRITTEN.removeprefix("<s>").split("</s>")
  conversation = [sp.bos_id(), *sp.encode(body[0]), sp.eos_id(), *sp.encode(body[1])]
  prompt = [sp.bos_id(), *sp.encode(body[0]), sp.eos_id(), *sp.encode(body[1] + "Assistant:")]
  tokenizer = tokenizer_lib.load(spm, "sentencepiece")

  cfg = config(f"tokenizer_path={spm}", "tokenizer_type=sentencepiece", "use_chat_template=true")
  assert prompts.chat_tokens(cfg, tokenizer, TURNS) == prompt
  server = types.SimpleNamespace(
    template=chat_template.compile_template(chat_template.FALLBACK_TEMPLATE), tokenizer=tokenizer
  )
  messages = [protocol.Message(role=t["role"], content=t["content"]) for t in TURNS]
  assert server_chat.chat_prompt(server, messages) == prompt
  records = sft.Conversation(spm, "sentencepiece", ("messages",), "key", chat_template.FALLBACK_TEMPLATE, False, True, True)
  tokens = records({"messages": [*TURNS, {"role": "assistant", "content": "ok"}]})["tokens"]
  assert list(tokens[: len(conversation)]) == conversation


@pytest.mark.parametrize(
  "turns, message",
  [
    ("hi", 'a conversation is "hi", not a list'),
    ([{"role": "robot", "content": "x"}], "each turn needs a role in"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "system turn at position 1"),
    ([{"role": "user", "content": "x"}], "no assistant turn"),
  ],
)
def test_turns_a_template_cannot_render_are_one_line_naming_the_key(turns, message):
  with pytest.raises(ConfigError, match=f"^train_data_columns: .*{message}"):
    chat_template.check_turns(turns, "train_data_columns")


def test_a_template_that_does_not_parse_or_refuses_a_conversation_is_one_line():
  with pytest.raises(ConfigError, match=r"does not parse \(line 1: .*\); fix it"):
    chat_template.compile_template("{% for %}")
  refusing = chat_template.compile_template("{{ raise_exception('no system turns') }}")
  with pytest.raises(ConfigError, match="refuses a conversation \\(no system turns; "):
    chat_template.render(refusing, Recording(), TURNS, add_generation_prompt=True)
