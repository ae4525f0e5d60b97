"""POST /v1/completions: prompts (text or token ids) -> choices, whole or streamed, with echo and logprobs."""

import dataclasses
from collections.abc import AsyncIterator

import fastapi
from fastapi import responses

from MaxText.server.bridge import Choice, Submission
from MaxText.server.protocol import APIError, CompletionBody, check_ids
from MaxText.server.service import Server
from MaxText.server.views import Pieces, aborted_event, join_logprobs, response_head, sse, streaming, usage


def completion_prompts(server: Server, prompt) -> tuple[list[list[int]], list[str]]:
  """(token ids, text) of each prompt of a completions request: its text as its tokens decode (for echo, so that
  the text is what the logprobs' tokens join to: the prompt's text as it was sent, unless the tokenizer
  normalizes it)."""
  if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
    prompt = [prompt]
  if not prompt:
    raise APIError(400, "prompt is an empty list; give a prompt", param="prompt")
  ids, texts = [], []
  for i, p in enumerate(prompt):
    if len(p) == 0:
      raise APIError(400, f"prompt[{i}] is empty; give at least one character or token", param="prompt")
    if isinstance(p, str):
      ids.append(server.text_prompt(p))
    else:
      check_ids(p, server.tokenizer.vocab_size, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
      ids.append(list(p))
    texts.append(server.tokenizer.decode(ids[-1]))
  return ids, texts


@dataclasses.dataclass
class CompletionPlan:
  """What a completions request asks of the engine, prepared on a worker thread."""

  prompts: list[list[int]]  # token ids of each prompt
  texts: list[str]  # the text of each choice's prompt (echo)
  requests: list  # engine Requests, n per prompt
  wanted: list[int]  # max_tokens of each prompt (0: the prompt's logprobs only)


def plan_completion(server: Server, body: CompletionBody) -> CompletionPlan:
  server.check_model(body)
  prompts, texts = completion_prompts(server, body.prompt)
  wanted = [body.max_tokens] * len(prompts)
  echo_logprobs = body.echo and body.logprobs is not None
  fields = {"logprobs": body.logprobs, "echo": echo_logprobs, "stream": body.stream}
  if echo_logprobs and body.max_tokens <= 1:
    # Scoring (lm-eval's log-likelihood): the one generated token is always returned, EOS or not, so the response's
    # last logprob is the generated token's, as lm-eval expects.
    fields |= {"ignore_eos": True, "stop": (), "stop_token_ids": ()}
  requests = server.requests(prompts, body, [max(m, 1) for m in wanted], **fields)
  return CompletionPlan(prompts, [texts[i // body.n] for i in range(len(requests))], requests, wanted)


async def completions(server: Server, request: fastapi.Request):
  body = await server.body(request, CompletionBody)
  plan = await server.run(plan_completion, server, body)
  submission = Submission(server.engine)
  await server.run(submission.submit, plan.requests)
  choices = [
    Choice(plan.prompts[i // body.n], keep_generated=plan.wanted[i // body.n] > 0) for i in range(len(plan.requests))
  ]
  view = CompletionView(server, body, choices, plan.texts)
  if body.stream:
    return streaming(view.events(submission), submission)
  await submission.collect(request, choices)
  return await server.run(lambda: responses.JSONResponse(view.response(plan.prompts)))


class CompletionView:
  """Completions' response, whole or as server-sent events."""

  def __init__(self, server: Server, body: CompletionBody, choices: list[Choice], texts: list[str]):
    self.server, self.body, self.choices, self.texts = server, body, choices, texts
    self.logprobs = body.logprobs is not None
    self.head = response_head("text_completion", server.options.model_name)
    echo_len = [len(t) if body.echo else 0 for t in texts]
    self.pieces = [Pieces(server.tokenizer, [], 0) for _ in choices]
    self.generated = [Pieces(server.tokenizer, c.prompt_ids, n) for c, n in zip(choices, echo_len, strict=True)]

  def delta(self, index: int, delta: Choice) -> dict:
    """One choice's new part: the prompt first (with echo), then what was generated."""
    first = not delta.started
    text = (self.texts[index] if first and self.body.echo else "") + delta.text
    logprobs = None
    if self.body.logprobs is not None:
      parts = []
      if first and self.body.echo:
        parts.append(self.pieces[index].completion(delta.prompt_ids, delta.prompt_logprobs or [], final=True))
      final = delta.finish_reason is not None
      parts.append(self.generated[index].completion(delta.tokens, delta.logprobs, final))
      logprobs = join_logprobs(parts)
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

  def response(self, prompts: list[list[int]]) -> dict:
    out = []
    for index, choice in enumerate(self.choices):
      whole = Choice(choice.prompt_ids, tokens=choice.tokens, text=choice.text, logprobs=choice.logprobs)
      whole.prompt_logprobs, whole.finish_reason = choice.prompt_logprobs, choice.finish_reason
      out.append(self.delta(index, whole))
    return {**self.head, "choices": out, "usage": usage(self.choices, prompts)}

  async def events(self, submission: Submission) -> AsyncIterator[str]:
    try:
      async for index, update in submission.updates():
        delta = self.choices[index].take(update)
        if delta.finish_reason == "abort":
          yield aborted_event()
          return
        if delta.started and not delta.tokens and not delta.text and delta.finish_reason is None:
          continue
        # With logprobs, each token's text and its alternatives' are decoded: a worker's job.
        part = await self.server.run(self.delta, index, delta) if self.logprobs else self.delta(index, delta)
        yield sse({**self.head, "choices": [part]})
      if self.body.stream_options is not None and self.body.stream_options.include_usage:
        prompts = [c.prompt_ids for c in self.choices[:: self.body.n]]
        yield sse({**self.head, "choices": [], "usage": usage(self.choices, prompts)})
      yield sse("[DONE]")
    finally:
      submission.cancel_unfinished()
