"""What the completion and chat responses share: logprobs in OpenAI's shapes (`Pieces`, over the engine's output
processor, inference/output.LogprobText), usage, server-sent events and the response head."""

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import responses
from starlette.background import BackgroundTask

from MaxText.inference import output as output_lib
from MaxText.server.bridge import ABORTED, Choice, Submission


class Pieces:
  """Token texts and logprob entries in OpenAI's shapes, following the tokens as they are generated: a token's text
  is what it adds after the tokens before it (output.LogprobText, the engine's decoding of the choice's text), so
  the chosen tokens' texts join to the text and `text_offset`s point at them; an alternative's text is what it would
  add."""

  def __init__(self, tokenizer, context: list[int], offset: int = 0):
    self.text = output_lib.LogprobText(tokenizer.decode, context, offset)

  def completion(self, ids: list[int], entries: list, final: bool) -> dict:
    """Completions' logprobs for `ids`: tokens, token_logprobs, top_logprobs ({text: logprob}), text_offset."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, entry, alternatives, offset in self.text.walk(ids, entries, final):
      top = None
      if entry is not None:
        top = {alt: lp for alt, (_, lp) in zip(alternatives, entry.top, strict=True)}
        top.setdefault(text, entry.logprob)  # OpenAI's (and vLLM's): the chosen token is always there.
      out["tokens"].append(text)
      out["token_logprobs"].append(None if entry is None else entry.logprob)
      out["top_logprobs"].append(top)
      out["text_offset"].append(offset)
    return out

  def chat(self, ids: list[int], entries: list, final: bool) -> list[dict]:
    """Chat's logprobs content entries for `ids`."""
    out = []
    for text, entry, alternatives, _ in self.text.walk(ids, entries, final):
      top = [self._entry(alt, lp) for alt, (_, lp) in zip(alternatives, entry.top, strict=True)]
      out.append({**self._entry(text, entry.logprob), "top_logprobs": top})
    return out

  @staticmethod
  def _entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def join_logprobs(parts: list[dict]) -> dict:
  return {
    key: [v for part in parts for v in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
  }


def usage(choices: list[Choice], prompts: list[list[int]]) -> dict:
  prompt_tokens = sum(len(p) for p in prompts)
  completion_tokens = sum(len(c.tokens) for c in choices)
  return {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
  }


def sse(payload: dict | str) -> str:
  return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


def streaming(events: AsyncIterator[str], submission: Submission) -> responses.StreamingResponse:
  # The background task also cancels when the client left before the first event (the generator never ran).
  return responses.StreamingResponse(
    events, media_type="text/event-stream", background=BackgroundTask(submission.cancel_unfinished)
  )


def aborted_event() -> str:
  return sse({"error": {"message": ABORTED, "type": "server_error", "param": None, "code": "engine_aborted"}})


def response_head(kind: str, model: str) -> dict:
  prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
  return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": model}
