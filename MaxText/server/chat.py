"""POST /v1/chat/completions: a conversation rendered by the chat template (MaxText/chat_template.py, as
fine-tuning renders it, with the generation prompt) -> choices, whole or streamed, with logprobs."""

from collections.abc import AsyncIterator

import fastapi
from fastapi import responses

from MaxText import chat_template
from MaxText.common_types import ConfigError
from MaxText.server.bridge import Choice, Submission
from MaxText.server.protocol import APIError, ChatBody, Message
from MaxText.server.service import Server
from MaxText.server.views import Pieces, aborted_event, response_head, sse, streaming, usage


def chat_prompt(server: Server, messages: list[Message]) -> list[int]:
  """The conversation's tokens through the chat template, with the generation prompt (as fine-tuning renders it)."""
  turns = []
  for i, message in enumerate(messages):
    content = message.content or ""
    if not isinstance(content, str):
      if any(part.type != "text" or part.text is None for part in content):
        raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
      content = "".join(part.text for part in content)
    role = "system" if message.role == "developer" else message.role
    if role not in chat_template.ROLES:
      raise APIError(400, f"messages[{i}].role={message.role!r}; give one of {list(chat_template.ROLES)}", param="messages")
    turns.append({"role": role, "content": content})
  try:
    return chat_template.render(server.template, server.tokenizer, turns, add_generation_prompt=True)
  except ConfigError as e:
    raise APIError(400, f"messages: {e}", param="messages") from None


def plan_chat(server: Server, body: ChatBody) -> tuple[list[int], list]:
  """(the conversation's tokens, the engine Requests of its n choices), prepared on a worker thread."""
  server.check_model(body)
  if body.top_logprobs is not None and not body.logprobs:
    raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
  ids = chat_prompt(server, body.messages)
  limit = body.max_completion_tokens or body.max_tokens or server.room(ids)
  logprobs = (body.top_logprobs or 0) if body.logprobs else None
  return ids, server.requests([ids], body, [limit], logprobs=logprobs, stream=body.stream)


async def chat_completions(server: Server, request: fastapi.Request):
  body = await server.body(request, ChatBody)
  ids, requests = await server.run(plan_chat, server, body)
  submission = Submission(server.engine)
  await server.run(submission.submit, requests)
  choices = [Choice(ids) for _ in range(body.n)]
  view = ChatView(server, body, choices)
  if body.stream:
    return streaming(view.events(submission), submission)
  await submission.collect(request, choices)
  return await server.run(lambda: responses.JSONResponse(view.response()))


class ChatView:
  """Chat completions' response, whole or as `chat.completion.chunk` events."""

  def __init__(self, server: Server, body: ChatBody, choices: list[Choice]):
    self.server, self.body, self.choices = server, body, choices
    self.pieces = [Pieces(server.tokenizer, c.prompt_ids) for c in choices]
    self.model = server.options.model_name

  def _logprobs(self, index: int, choice: Choice) -> dict | None:
    if not self.body.logprobs:
      return None
    return {"content": self.pieces[index].chat(choice.tokens, choice.logprobs, choice.finish_reason is not None)}

  def response(self) -> dict:
    out = [
      {
        "index": i,
        "message": {"role": "assistant", "content": c.text},
        "logprobs": self._logprobs(i, c),
        "finish_reason": c.finish_reason,
      }
      for i, c in enumerate(self.choices)
    ]
    return {
      **response_head("chat.completion", self.model),
      "choices": out,
      "usage": usage(self.choices, [self.choices[0].prompt_ids]),
    }

  async def events(self, submission: Submission) -> AsyncIterator[str]:
    head = response_head("chat.completion.chunk", self.model)
    try:
      for i in range(len(self.choices)):
        role = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        yield sse({**head, "choices": [role]})
      async for index, update in submission.updates():
        delta = self.choices[index].take(update)
        if delta.finish_reason == "abort":
          yield aborted_event()
          return
        if not delta.text and not delta.tokens and delta.finish_reason is None:
          continue
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        logprobs = await self.server.run(self._logprobs, index, delta) if self.body.logprobs else None
        part = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}
        yield sse({**head, "choices": [part]})
      if self.body.stream_options is not None and self.body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(self.choices, [self.choices[0].prompt_ids])})
      yield sse("[DONE]")
    finally:
      submission.cancel_unfinished()
