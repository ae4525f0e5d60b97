"""The server's response pieces (server/views.py): logprobs in OpenAI's completion and chat shapes over the engine's
output processor, usage and server-sent events; against texts and offsets written out by hand."""

import json

from MaxText.inference.request import TokenLogprob
from MaxText.server import views
from MaxText.server.bridge import Choice

PIECES = {1: "Hel", 2: "lo", 3: " world", 4: "!", 5: "\xe2", 6: "\x82\xac"}  # 5 + 6: the euro sign's bytes


class Tokenizer:
  """A byte-level decoder over PIECES (latin-1 bytes, so 5 + 6 are € in UTF-8 and alone an incomplete character)."""

  @staticmethod
  def decode(ids) -> str:
    return b"".join(PIECES[int(t)].encode("latin-1") for t in ids).decode("utf-8", "replace")


def test_completion_logprobs_give_each_token_its_text_offset_and_alternatives():
  """After the prompt "Hel": "lo" " world" "!" at offsets 0, 2, 8 (text_offset counts from `offset`: 3 here, the
  echoed prompt's length); an alternative's text is what it adds in the token's place; the chosen token is always
  among the top ones."""
  pieces = views.Pieces(Tokenizer(), [1], offset=3)
  entries = [TokenLogprob(-0.5, [(4, -1.0)]), TokenLogprob(-0.25, [(3, -0.25), (2, -2.0)]), None]
  out = pieces.completion([2, 3, 4], entries, final=True)
  assert out["tokens"] == ["lo", " world", "!"] and out["text_offset"] == [3, 5, 11]
  assert out["token_logprobs"] == [-0.5, -0.25, None]
  assert out["top_logprobs"] == [{"!": -1.0, "lo": -0.5}, {" world": -0.25, "lo": -2.0}, None]


def test_a_character_split_over_two_tokens_is_the_second_tokens_text():
  """The euro sign's first byte adds no text (its character is incomplete); the token completing it adds "€"."""
  pieces = views.Pieces(Tokenizer(), [1])
  entries = [TokenLogprob(-1.0, []), TokenLogprob(-2.0, [])]
  chat = pieces.chat([5, 6], entries, final=True)
  assert [e["token"] for e in chat] == ["", "€"] and chat[1]["bytes"] == [0xE2, 0x82, 0xAC]
  assert [e["logprob"] for e in chat] == [-1.0, -2.0] and chat[0]["top_logprobs"] == []


def test_usage_counts_the_prompts_and_the_choices_tokens():
  choices = [Choice([1, 2], tokens=[3, 4, 5]), Choice([1, 2], tokens=[6])]
  assert views.usage(choices, [[1, 2]]) == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}


def test_an_event_is_one_data_line_of_json_and_a_blank_line():
  assert views.sse("[DONE]") == "data: [DONE]\n\n"
  event = views.sse({"text": "€\n"})
  assert event.startswith("data: ") and event.endswith("\n\n") and json.loads(event[6:]) == {"text": "€\n"}
  assert event.count("\n") == 2  # the newline inside the text is escaped: one line
  head = views.response_head("chat.completion.chunk", "m")
  assert head["id"].startswith("chatcmpl-") and (head["object"], head["model"]) == ("chat.completion.chunk", "m")
