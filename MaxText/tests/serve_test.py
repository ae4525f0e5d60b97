"""serve.py: the OpenAI-compatible server, driven through the `openai` client and raw HTTP.

The engine here is FakeEngine, which honours inference/engine.py's interface (check, submit, cancel, start, stop,
the Update stream) with a rule simple enough to be the tests' reference: generated token i is the prompt's token
(offset + i) mod its length (offset 0 greedily, the seed when sampling), and each token's logprob follows from
its id (`fake_logprob`), with k - 1 alternatives (whole words) each a nat less likely. Its text is what the
engine promises: the completion's tokens decoded after the prompt's (`after`). Expected texts come from
SentencePiece itself, not from the server's code.
"""

import contextlib
import http.client
import json
import os
import random
import socket
import threading
import time

import pytest

from MaxText import serve
from MaxText.common_types import ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.server import app as server_app
from MaxText.server import options as server_options
from MaxText.server import run as server_run
from MaxText.tests.helpers import BASE_YML, FUZZ_PARTS, config, deadline, fuzz_part, overrides

MODEL = "tiny-demo"
TEXT = "The sun of the sea is 3."
SECONDS = 20  # the longest any wait in these tests may take


# ------------------------------------------------------------------------------------------ the fake engine
def after(decode, prompt, tokens) -> str:
  """The text `tokens` add after `prompt`: decode(prompt + tokens) after the part of decode(prompt) it starts with
  (inference/detokenize.py's promise, computed from whole decodes)."""
  full, before = decode([*prompt, *tokens]), decode(list(prompt))
  return full[len(os.path.commonprefix([before, full])) :]


def fake_logprob(token: int) -> float:
  return -0.25 * (1 + token % 5)


class FakeEngine:
  """inference/engine.py's interface over the echo rule of the module docstring, one token per slot per step."""

  def __init__(self, tokenizer, slots=4, max_queue=8, max_prompt_length=48, max_length=64, delay=0.002):
    self.tokenizer, self.slots, self.max_queue, self.delay = tokenizer, slots, max_queue, delay
    self.max_prompt_length, self.max_length = max_prompt_length, max_length
    self.lock = threading.Condition()
    self.waiting, self.active, self.cancelled, self.submitted = [], {}, [], []
    self.paused = threading.Event()  # set: no request leaves the queue
    self.thread, self.stopping, self.next_id = None, False, 0
    words = [t for w in ("sun", "moon", "sky", "sea", "The", "of") for t in tokenizer.encode(" " + w)]
    self.alternatives = list(dict.fromkeys(words))

  def entry(self, token: int, k: int) -> engine_lib.TokenLogprob:
    """`token` as the most likely, then k - 1 alternatives, each a nat less likely."""
    lp = fake_logprob(token)
    others = [a for a in self.alternatives if a != token][: k - 1]
    return engine_lib.TokenLogprob(lp, [(token, lp)][:k] + [(a, lp - j) for j, a in enumerate(others, 1)])

  def check(self, request):
    n = len(request.prompt)
    if n == 0:
      raise engine_lib.RequestError("prompt: the prompt is empty")
    if n > self.max_prompt_length:
      raise engine_lib.RequestError(f"prompt: {n} tokens, more than {self.max_prompt_length}")
    if request.max_tokens < 1 or n + request.max_tokens > self.max_length:
      raise engine_lib.RequestError(f"max_tokens={request.max_tokens}: over the cache's {self.max_length} tokens")
    if any(not 0 <= t < self.tokenizer.vocab_size for t in request.prompt):
      raise engine_lib.RequestError("prompt: token ids out of range")
    if request.echo and request.logprobs is None:
      raise engine_lib.RequestError("echo: needs logprobs")

  def submit(self, request, on_update):
    self.check(request)
    with self.lock:
      if len(self.waiting) >= self.max_queue:
        raise engine_lib.QueueFull(f"{len(self.waiting)} wait")
      request_id, self.next_id = self.next_id, self.next_id + 1
      self.waiting.append((request_id, request, on_update))
      self.submitted.append(request)
      self.lock.notify()
    return request_id

  def cancel(self, request_id):
    with self.lock:
      self.cancelled.append(request_id)
      self.waiting = [w for w in self.waiting if w[0] != request_id]
      self.active.pop(request_id, None)

  def running(self):
    return self.thread is not None and self.thread.is_alive()

  def start(self):
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def stop(self):
    with self.lock:
      self.stopping = True
      self.lock.notify()
    self.thread.join(SECONDS)

  def _run(self):
    while True:
      with self.lock:
        while not self.stopping and not self.active and (self.paused.is_set() or not self.waiting):
          self.lock.wait(0.05)
        if self.stopping:
          return
        while not self.paused.is_set() and self.waiting and len(self.active) < self.slots:
          request_id, request, on_update = self.waiting.pop(0)
          self.active[request_id] = {"request": request, "on_update": on_update, "tokens": [], "sent": "", "first": True}
        rows = list(self.active.items())
      for request_id, row in rows:
        update = self._step(row)
        with self.lock:
          if request_id not in self.active:  # cancelled meanwhile: no update after a cancel
            continue
          if update.finish_reason is not None:
            del self.active[request_id]
        row["on_update"](update)
      time.sleep(self.delay)

  def _step(self, row) -> engine_lib.Update:
    request = row["request"]
    prompt = request.prompt
    offset = (request.seed or 0) % len(prompt) if request.temperature > 0 else 0
    token = prompt[(offset + len(row["tokens"])) % len(prompt)]
    finish = "stop" if token in request.stop_token_ids else None
    tokens = [] if finish else [token]
    row["tokens"] += tokens
    text = after(self.tokenizer.decode, prompt, row["tokens"])
    cuts = [text.find(s) for s in request.stop if s in text]
    if cuts:
      text, finish = text[: min(cuts)], "stop"
    if finish is None and len(row["tokens"]) >= request.max_tokens:
      finish = "length"
    if finish is None and request.stop:  # holds back what may be the start of a stop string
      text = text[: len(text) - max(map(len, request.stop)) + 1]
    new, row["sent"] = text[len(row["sent"]) :], row["sent"] + text[len(row["sent"]) :]
    k = request.logprobs
    update = engine_lib.Update(tokens, new, None if k is None else [self.entry(t, k) for t in tokens])
    if row["first"] and request.echo:
      update.prompt_logprobs = [None] + [self.entry(t, k) for t in prompt[1:]]
    row["first"] = False
    update.finish_reason = finish
    return update


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def spm_path(tmp_path_factory):
  from MaxText import train_tokenizer

  root = tmp_path_factory.mktemp("serve")
  pairs = [("sun", "sea"), ("moon", "sky"), ("System", "User"), ("Assistant", "brief")]
  texts = [f"The {w} of the {v} is {n}, hi." for n in range(40) for w, v in pairs]
  train_tokenizer.train(texts * 3, vocab_size=296, output=str(root / "tok.model"))
  return str(root / "tok.model")


@pytest.fixture(scope="module")
def sp(spm_path):
  """SentencePiece itself: the reference for what the server encodes and decodes."""
  import sentencepiece as spm

  return spm.SentencePieceProcessor(model_file=spm_path)


@pytest.fixture(scope="module")
def tokenizer(spm_path):
  return tokenizer_lib.load(spm_path)


@contextlib.contextmanager
def running(app):
  """The app served by uvicorn in a thread on a free loopback port; yields its base URL, shuts it down after."""
  import uvicorn

  sock = server_run.listen("127.0.0.1", 0)
  server = uvicorn.Server(server_run.uvicorn_config(app, log_level="warning"))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    deadline = time.monotonic() + SECONDS
    while not server.started:
      assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
      time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
  finally:
    server.should_exit = True
    thread.join(SECONDS)
    sock.close()
    assert not thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def started(tokenizer, api_key="", **engine_kw):
  """(FakeEngine, base URL) of a running server over a started fake engine."""
  engine = FakeEngine(tokenizer, **engine_kw)
  engine.start()
  try:
    with running(server_app.create_app(engine, tokenizer, server_options.Options(MODEL, api_key=api_key))) as url:
      yield engine, url
  finally:
    engine.stop()


@pytest.fixture
def server(tokenizer):
  with started(tokenizer) as (engine, url):
    yield engine, url


def client(url, key="none"):
  import openai

  return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=SECONDS)


def post(url, path, body, headers=None, method="POST"):
  """(status, parsed JSON or the raw text) of one HTTP request; `body` bytes, str or a JSON value."""
  host, port = url.removeprefix("http://").split(":")
  connection = http.client.HTTPConnection(host, int(port), timeout=SECONDS)
  data = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
  try:
    connection.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    raw = response.read().decode()
  finally:
    connection.close()
  try:
    return response.status, json.loads(raw)
  except ValueError:
    return response.status, raw


def assert_error(status, body, want_status, names):
  """`body` is OpenAI's error shape with status `want_status` and a message naming `names`."""
  assert status == want_status, (status, body)
  assert isinstance(body, dict) and set(body) == {"error"}, body
  assert set(body["error"]) == {"message", "type", "param", "code"}, body
  assert names in body["error"]["message"], body


def ids_of(sp, text, bos=True):
  return ([sp.bos_id()] if bos else []) + sp.encode(text)


# ------------------------------------------------------------------------------------------ completions
def test_completion_text_and_usage_follow_the_engine(server, sp):
  engine, url = server
  ids = ids_of(sp, TEXT)
  out = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=5, temperature=0)
  assert out.choices[0].text == after(sp.decode, ids, ids[:5])
  assert out.choices[0].finish_reason == "length" and out.choices[0].index == 0
  assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 5)
  assert engine.submitted[-1].prompt == tuple(ids)  # BOS first (add_bos), then the text's tokens
  whole = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=len(ids), temperature=0)
  assert whole.choices[0].text == " " + TEXT  # every prompt token again, after the prompt: "▁The" keeps its space


def test_batch_of_prompts_and_token_ids_with_n_and_seeds(server, sp):
  engine, url = server
  prompts = [TEXT, "The moon of the sky is 7."]
  out = client(url).completions.create(model=MODEL, prompt=prompts, max_tokens=4, n=2, temperature=0.7, seed=3)
  assert [c.index for c in out.choices] == [0, 1, 2, 3]
  for i, choice in enumerate(out.choices):
    ids = ids_of(sp, prompts[i // 2])
    seed = 3 + i % 2  # choice j of a prompt samples with seed + j
    assert choice.text == after(sp.decode, ids, [ids[(seed + t) % len(ids)] for t in range(4)]), i
  assert [r.seed for r in engine.submitted[-4:]] == [3, 4, 3, 4]
  token_ids = [sp.encode("The sea"), sp.encode("is 3.")]
  out = client(url).completions.create(model=MODEL, prompt=token_ids, max_tokens=2, temperature=0)
  assert [c.text for c in out.choices] == [after(sp.decode, t, t[:2]) for t in token_ids]
  assert [r.prompt for r in engine.submitted[-2:]] == [tuple(t) for t in token_ids]  # token ids as sent, no BOS


def test_streamed_completion_equals_the_whole_one(server, sp):
  _, url = server
  chunks = list(
    client(url).completions.create(
      model=MODEL, prompt=TEXT, max_tokens=7, temperature=0, stream=True, stream_options={"include_usage": True}
    )
  )
  assert len(chunks) >= 3  # streamed as it is generated, not all at once
  ids = ids_of(sp, TEXT)
  assert "".join(c.choices[0].text for c in chunks if c.choices) == after(sp.decode, ids, ids[:7])
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
  assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_stop_strings_and_stop_token_ids(server, sp):
  _, url = server
  ids = ids_of(sp, TEXT)
  out = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=len(ids), temperature=0, stop=["sea"])
  whole = after(sp.decode, ids, ids)
  assert out.choices[0].text == whole[: whole.index("sea")] and out.choices[0].finish_reason == "stop"
  out = client(url).completions.create(
    model=MODEL, prompt=TEXT, max_tokens=len(ids), temperature=0, extra_body={"stop_token_ids": [ids[3]]}
  )
  assert out.choices[0].text == after(sp.decode, ids, ids[:3]) and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_with_logprobs_is_what_lm_eval_parses(server, sp, max_tokens):
  """lm-eval's loglikelihood request (token ids, echo, logprobs=1, max_tokens=1; or 0: the prompt alone)."""
  from lm_eval.models.openai_completions import LocalCompletionsAPI

  _, url = server
  context, continuation = sp.encode("The sun of the"), sp.encode(" sea is 3.")
  ids = [sp.bos_id(), *context, *continuation]
  body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "echo": True}
  status, out = post(url, "/v1/completions", body)
  assert status == 200, out
  logprobs = out["choices"][0]["logprobs"]
  generated = ids[:max_tokens]  # the echo rule's first token: the prompt's first
  assert logprobs["token_logprobs"] == [None] + [fake_logprob(t) for t in ids[1:]] + [fake_logprob(t) for t in generated]
  assert logprobs["top_logprobs"][0] is None and all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
  assert out["choices"][0]["text"] == sp.decode(ids + generated)
  offsets, text = logprobs["text_offset"], out["choices"][0]["text"]
  assert offsets == sorted(offsets) and "".join(logprobs["tokens"]) == text
  assert all(text[o:].startswith(t) for o, t in zip(offsets, logprobs["tokens"], strict=True))
  assert out["usage"]["completion_tokens"] == max_tokens
  if max_tokens == 1:  # lm-eval drops the last entry: the generated token
    ctxlen = 1 + len(context)
    ((total, greedy),) = LocalCompletionsAPI.parse_logprobs(out, tokens=[ids], ctxlens=[ctxlen])
    assert total == pytest.approx(sum(fake_logprob(t) for t in continuation)) and greedy


def test_generated_logprobs_with_alternatives(server, sp):
  _, url = server
  out = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0, logprobs=3)
  ids, logprobs = ids_of(sp, TEXT)[:3], out.choices[0].logprobs
  assert logprobs.token_logprobs == [fake_logprob(t) for t in ids]
  assert [sorted(top.values(), reverse=True) for top in logprobs.top_logprobs] == [
    [fake_logprob(t) - j for j in range(3)] for t in ids
  ]


# ------------------------------------------------------------------------------------------ chat
def test_chat_renders_the_fallback_template_and_streams_the_same(server, sp, tokenizer):
  _, url = server
  # MaxText/chat_template.py's FALLBACK_TEMPLATE, written out: BOS, then "User: ...\n", then the generation prompt
  # (which this SentencePiece model reads back with the line break as a space).
  rendered = "User: hi sun\nAssistant:"
  ids = [sp.bos_id(), *sp.encode(rendered)]
  messages = [{"role": "user", "content": "hi sun"}]
  out = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=len(ids), temperature=0)
  assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == after(sp.decode, ids, ids)
  assert out.usage.prompt_tokens == len(ids) and out.choices[0].finish_reason == "length"
  stream = client(url).chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True, temperature=0)
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks) == after(sp.decode, ids, ids[:5])
  assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].object == "chat.completion.chunk"


def test_chat_n_logprobs_and_stop(server, sp):
  _, url = server
  messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "sea"}]}]
  out = client(url).chat.completions.create(
    model=MODEL, messages=messages, max_completion_tokens=4, n=2, logprobs=True, top_logprobs=2, temperature=0
  )
  ids = [sp.bos_id(), *sp.encode("System: be brief\nUser: sea\nAssistant:")]
  for i, choice in enumerate(out.choices):
    assert choice.index == i and choice.message.content == after(sp.decode, ids, ids[:4])
    assert [e.logprob for e in choice.logprobs.content] == [fake_logprob(t) for t in ids[:4]]
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
  out = client(url).chat.completions.create(
    model=MODEL, messages=messages, max_tokens=64 - len(ids), stop="brief", temperature=0
  )
  assert out.choices[0].message.content == " System: be " and out.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------------------------------ info routes
def test_models_health_and_tokenizer_routes(tokenizer, sp):
  with started(tokenizer) as (engine, url):
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert post(url, "/health", b"", method="GET") == (200, {})
    status, out = post(url, "/tokenize", {"prompt": TEXT})
    assert status == 200 and out["tokens"] == ids_of(sp, TEXT)
    eos = sp.id_to_piece(sp.eos_id())
    assert post(url, "/tokenize", {"prompt": eos, "add_special_tokens": False})[1]["tokens"] == [sp.eos_id()]
    assert post(url, "/detokenize", {"tokens": sp.encode(TEXT)}) == (200, {"prompt": TEXT})
    info = post(url, "/tokenizer_info", b"", method="GET")[1]
    assert info["eos_token"] == sp.id_to_piece(sp.eos_id()) and "Assistant" in info["chat_template"]
    engine.stop()
    assert_error(*post(url, "/health", b"", method="GET"), 503, "not running")


# ------------------------------------------------------------------------------------------ bad input
LONG = " ".join(["sun"] * 60)
BAD = [
  ("/v1/completions", b'{"prompt": "x", ', 400, "not valid JSON"),
  ("/v1/completions", b"[1, 2]", 400, "JSON object"),
  ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "not valid JSON"),
  ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
  ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
  ("/v1/completions", {"prompt": 5}, 400, "prompt must be"),
  ("/v1/completions", {"prompt": [[1, "a"]]}, 400, "prompt must be"),
  ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
  ("/v1/completions", {"prompt": ""}, 400, "prompt"),
  ("/v1/completions", {"prompt": []}, 400, "prompt"),
  ("/v1/completions", {"prompt": [[]]}, 400, "prompt"),
  ("/v1/completions", {"prompt": [10**6]}, 400, "prompt"),
  ("/v1/completions", {"prompt": LONG}, 400, "prompt"),
  ("/v1/completions", {"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
  ("/v1/completions", {"prompt": "x", "max_tokens": 10**40}, 400, "max_tokens"),
  ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
  ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
  ("/v1/completions", {"prompt": "x", "logprobs": 6}, 400, "logprobs"),
  ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
  ("/v1/completions", {"prompt": "x", "echo": "yes"}, 400, "echo"),
  ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
  ("/v1/completions", {"prompt": "x", "stop": 7}, 400, "stop must be"),
  ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
  ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model='gpt-4'"),
  ("/v1/chat/completions", {"messages": []}, 400, "messages"),
  ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
  ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
  ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content must be"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "prompt"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 99}, 400, "max_tokens"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "m"}, 404, "model='m'"),
  ("/v1/nothing", {}, 404, "/v1/nothing"),
]


def test_bad_requests_get_openai_errors_naming_the_field_and_the_server_goes_on(server):
  engine, url = server
  for path, body, status, names in BAD:
    got_status, got = post(url, path, body)
    assert_error(got_status, got, status, names)
  assert post(url, "/v1/completions", {"prompt": "x"}, method="GET")[0] == 405
  assert not engine.submitted  # a bad request reaches no engine
  status, out = post(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, "unknown": {"a": [1]}, "user": 3})
  assert status == 200 and out["choices"][0]["finish_reason"] == "length"  # unknown fields are ignored
  assert post(url, "/v1/models", b"", method="GET")[1]["data"][0]["id"] == MODEL


def _random_value(rng: random.Random, depth: int = 0):
  kinds = ["null", "bool", "int", "huge", "float", "str", "list", "dict"]
  kind = rng.choice(kinds if depth < 3 else kinds[:6])
  if kind == "list":
    return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
  if kind == "dict":
    return {
      rng.choice(["role", "content", "a", "type", "text"]): _random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))
    }
  return {
    "null": None,
    "bool": rng.random() < 0.5,
    "int": rng.randint(-3, 70),
    "huge": rng.choice([10**30, -(10**30), 2**63, 1e308]),
    "float": rng.uniform(-2, 2),
    "str": rng.choice(["", "sun", "x" * 200, "\u202e\x00", "</s>"]),
  }[kind]


# Values each field might plausibly take (valid or near it), so that fuzzed requests also reach the engine.
PLAUSIBLE = {
  "prompt": ["sun", ["sun", "sea"], [5, 6], [[5], [6, 7]], "", None],
  "messages": [[{"role": "user", "content": "sun"}], [{"role": "assistant", "content": [{"type": "text", "text": "x"}]}]],
  "max_tokens": [0, 1, 3, 40, None],
  "temperature": [0, 0.5, None],
  "top_p": [0.5, 1],
  "top_k": [0, -1, 3],
  "n": [1, 2, 3],
  "seed": [0, 7, None],
  "stop": ["s", ["a", "b"], None],
  "stop_token_ids": [[5], []],
  "echo": [True, False],
  "logprobs": [0, 1, 5, True, None],
  "top_logprobs": [0, 2],
  "stream": [True, False],
  "model": [MODEL, "other", None],
  "max_completion_tokens": [1, 4],
  "stream_options": [{"include_usage": True}, {}],
  "tokens": [[5, 6], []],
}


def _fuzz_request(rng: random.Random) -> tuple[str, bytes, str]:
  path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
  good = {"prompt": "sun", "messages": [{"role": "user", "content": "sun"}], "max_tokens": 3, "tokens": [5]}
  body = {k: v for k, v in good.items() if rng.random() < 0.9}
  for field in rng.sample(sorted(PLAUSIBLE), rng.randint(1, 4)):
    body[field] = rng.choice(PLAUSIBLE[field]) if rng.random() < 0.6 else _random_value(rng)
  raw = json.dumps(body).encode()
  if rng.random() < 0.1:
    raw = raw[: rng.randint(0, len(raw))]
  content_type = rng.choice(["application/json", "text/plain", "application/x-www-form-urlencoded", ""])
  return path, raw, content_type


def test_fuzzed_requests_never_break_the_server(tokenizer):
  """300 malformed requests from a seeded generator: each is answered (an OpenAI error or a valid response, never
  a 500), and a correct request still succeeds after them."""
  rng = random.Random(32)
  with started(tokenizer, delay=0.0005) as (engine, url):
    deadline = time.monotonic() + 120
    for i in range(300):
      assert time.monotonic() < deadline, f"fuzz case {i}: too slow"
      path, raw, content_type = _fuzz_request(rng)
      status, body = post(url, path, raw, {"Content-Type": content_type})
      assert status in (200, 400, 404, 413, 503), (i, path, raw[:200], status, body)
      if status != 200:
        assert_error(status, body, status, "")
    out = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"
    deadline = time.monotonic() + SECONDS
    while engine.active or engine.waiting:  # every fuzzed request finished or was cancelled
      assert time.monotonic() < deadline
      time.sleep(0.01)


# ------------------------------------------------------------------------------------------ key, queue, disconnect
def test_api_key_is_required_when_set(tokenizer):
  import openai

  with started(tokenizer, api_key="s3cret") as (_, url):
    body = {"prompt": "x", "max_tokens": 1}
    assert_error(*post(url, "/v1/completions", body), 401, "API key")
    assert_error(*post(url, "/v1/completions", body, {"Authorization": "Bearer wrong"}), 401, "API key")
    assert_error(*post(url, "/v1/models", b"", {"Authorization": "s3cret"}, method="GET"), 401, "API key")
    assert_error(*post(url, "/v1/completions", b"{bad", {"Authorization": "Bearer nope"}), 401, "API key")
    assert post(url, "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
    assert post(url, "/health", b"", method="GET")[0] == 200  # health checks need no key
    with pytest.raises(openai.AuthenticationError):
      client(url, "wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert client(url, "s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1).choices


def _wait_waiting(engine, count: int) -> None:
  deadline = time.monotonic() + SECONDS
  while len(engine.waiting) != count:
    assert time.monotonic() < deadline, f"{len(engine.waiting)} requests wait, not {count}"
    time.sleep(0.01)


def test_past_the_queue_is_503_and_the_queued_ones_finish(tokenizer):
  with started(tokenizer, max_queue=2) as (engine, url):
    engine.paused.set()  # nothing leaves the queue
    results = []

    def queued():
      thread = threading.Thread(
        target=lambda: results.append(post(url, "/v1/completions", {"prompt": "sun", "max_tokens": 2}))
      )
      thread.start()
      return thread

    first = queued()
    _wait_waiting(engine, 1)  # request 0 waits
    status, body = post(url, "/v1/completions", {"prompt": ["sea", "sky"], "max_tokens": 2})
    assert_error(status, body, 503, "busy")  # its first prompt fitted (request 1), the second did not
    assert body["error"]["code"] == "queue_full" and engine.cancelled == [1]
    _wait_waiting(engine, 1)
    second = queued()
    _wait_waiting(engine, 2)
    assert_error(*post(url, "/v1/completions", {"prompt": "sun", "max_tokens": 2}), 503, "busy")
    engine.paused.clear()
    for thread in (first, second):
      thread.join(SECONDS)
    assert [status for status, _ in results] == [200, 200]


def _open_raw(url, body: dict) -> socket.socket:
  host, port = url.removeprefix("http://").split(":")
  sock = socket.create_connection((host, int(port)), timeout=SECONDS)
  data = json.dumps(body).encode()
  head = (
    f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
  )
  sock.sendall(head.encode() + data)
  return sock


def _wait_cancelled(engine, count: int) -> None:
  deadline = time.monotonic() + SECONDS
  while len(engine.cancelled) < count:
    assert time.monotonic() < deadline, "the engine request of a gone client was not cancelled"
    time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_slot(tokenizer, stream):
  with started(tokenizer, delay=0.02) as (engine, url):
    sock = _open_raw(url, {"prompt": "sun", "max_tokens": 60, "stream": stream})
    if stream:
      received, deadline = b"", time.monotonic() + SECONDS
      while b"data: " not in received:  # the stream has started
        assert time.monotonic() < deadline
        received += sock.recv(65536)
    else:
      deadline = time.monotonic() + SECONDS
      while not engine.active:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    _wait_cancelled(engine, 1)
    assert engine.cancelled == [0] and not engine.active
    out = client(url).completions.create(model=MODEL, prompt="sun", max_tokens=2)  # still serving
    assert out.choices[0].finish_reason == "length"


# ------------------------------------------------------------------------------------------ config
def test_serving_keys_are_checked_and_named():
  """Refused when the config is read (their sections' rules), before any server or engine is built."""
  with pytest.raises(ConfigError, match=r"server_port=70000 is not a TCP port"):
    config("server_port=70000")
  with pytest.raises(ConfigError, match=r"server_max_queue=0 must be at least 1"):
    config("server_max_queue=0")
  with pytest.raises(ConfigError, match=r"server_max_prompt_chars=0 must be at least 1"):
    config("server_max_prompt_chars=0")
  with pytest.raises(ConfigError, match=r"server_read_timeout=0 must be 1 to 86400 seconds"):
    config("server_read_timeout=0")
  with pytest.raises(ConfigError, match=r"stream_interval_ms=-1 is negative"):
    config("stream_interval_ms=-1", "max_prefill_predict_length=32")
  assert server_options.served_name(config("run_name=", "load_parameters_path=/x/runs/demo/checkpoints/5/items")) == "demo"
  assert server_options.served_name(config("run_name=mine")) == "mine"
  assert server_options.served_name(config("served_model_name=m", "run_name=mine")) == "m"
  options = server_options.Options.from_config(config("server_api_key=k", "add_bos=false", "server_read_timeout=7"))
  assert (options.api_key, options.add_bos, options.model_name, options.read_timeout) == ("k", False, "test", 7)


def test_the_command_line_refuses_a_bad_key_in_one_line(capsys):
  assert serve.main(["serve.py", BASE_YML, *overrides("server_port=-1")]) == 2
  err = capsys.readouterr().err
  assert err.strip() == "error: server_port=-1 is not a TCP port; give 1 to 65535 (0: any free port)", err


def test_a_taken_port_is_one_config_error():
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"server_host=127.0.0.1 server_port={port}: cannot listen there"):
      server_run.listen("127.0.0.1", port)


# ------------------------------------------------------------------------------------------ the real engine
def _tiny_model(spm_path):
  """(config, mesh, params) of a tiny random float32 model with the test tokenizer, 4 slots of 4-token pages."""
  import jax
  from flax import linen as nn

  from MaxText import sharding
  from MaxText.layers import models

  cfg = config("override_model_config=true", "vocab_size=320", "dtype=float32", "max_target_length=48",
               "max_prefill_predict_length=32", "per_device_batch_size=4", "pagedattn_tokens_per_page=4",
               f"tokenizer_path={spm_path}")  # fmt: skip
  params = nn.meta.unbox(models.Transformer(cfg).init({"params": jax.random.key(3)}, *models.init_inputs(1, 8)))
  return cfg, sharding.create_mesh(cfg, jax.devices()[:1]), params["params"]


def test_the_real_engine_serves_what_it_generates_alone(tokenizer, sp, spm_path):
  """serve.py over the real engine (a tiny random model, 4 slots): concurrent completions, streamed and not, and a
  chat completion give the tokens, text and logprobs of Engine.generate run on each request alone."""
  import concurrent.futures

  from MaxText.inference import prompts

  cfg, mesh, params = _tiny_model(spm_path)

  def engine():
    kw = {"end_ids": tokenizer.end_ids, "num_tokens": tokenizer.vocab_size, "detokenize": tokenizer.decode}
    return engine_lib.Engine(cfg, mesh, params, **kw)

  texts = [TEXT, "The moon of the sky is 7.", "System", "The sea of the sun is 12, hi. The"]
  alone = [engine().generate([engine_lib.Request(tuple(ids_of(sp, t)), 12, logprobs=2)])[0] for t in texts]
  assert len({tuple(r.tokens) for r in alone}) > 1  # the prompts lead to different outputs
  # The engine's text is its tokens' after the prompt's (before: decoded alone, a first "▁word" lost its space).
  assert [r.text for r in alone] == [after(sp.decode, ids_of(sp, t), r.tokens) for t, r in zip(texts, alone, strict=True)]
  chat_ids = prompts.chat_tokens(cfg, tokenizer, [{"role": "user", "content": "Which sea?"}])
  chat_alone = engine().generate([engine_lib.Request(tuple(chat_ids), 10)])[0]

  served = engine()
  served.start()
  try:
    with running(server_app.create_app(served, tokenizer, server_options.Options(MODEL))) as url:

      def ask(i):
        kw = {"model": MODEL, "prompt": texts[i], "max_tokens": 12, "temperature": 0, "logprobs": 2}
        if i % 2:
          chunks = list(client(url).completions.create(stream=True, **kw))
          return "".join(c.choices[0].text for c in chunks if c.choices), None
        out = client(url).completions.create(**kw)
        return out.choices[0].text, out.choices[0].logprobs

      with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(len(texts))))
      for (text, logprobs), want in zip(answers, alone, strict=True):
        assert text == want.text
        if logprobs is not None:
          assert logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
      chat = client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Which sea?"}], max_tokens=10, temperature=0
      )
      assert chat.choices[0].message.content == chat_alone.text == after(sp.decode, chat_ids, chat_alone.tokens)
      # With echo (the issue's 'The king saidg* I'): the text is the prompt's and the completion's tokens' text, the
      # logprobs' tokens join to it and each text_offset points at its token.
      for stream in (False, True):
        body = {"model": MODEL, "prompt": TEXT, "max_tokens": 12, "temperature": 0, "logprobs": 1, "echo": True}
        out = client(url).completions.create(stream=stream, **body)
        chunks = list(out) if stream else [out]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = sum((c.choices[0].logprobs.tokens for c in chunks), [])
        offsets = sum((c.choices[0].logprobs.text_offset for c in chunks), [])
        assert text == sp.decode(ids_of(sp, TEXT) + alone[0].tokens) == TEXT + alone[0].text, stream
        assert "".join(tokens) == text and all(text[o:].startswith(t) for o, t in zip(offsets, tokens, strict=True))
  finally:
    served.stop()


def test_lm_eval_scores_a_continuation_whose_next_token_is_eos(tokenizer, sp, spm_path):
  """lm-eval's log-likelihood request (max_tokens=1, echo, logprobs=1) sums token_logprobs[ctxlen:-1], taking the
  last entry for the generated token: it must be there even when that token is EOS (a fine-tuned model after its
  answer), or lm-eval would drop the continuation's last token instead. Reference: the engine's prompt logprobs
  with no EOS at all."""
  from lm_eval.models.openai_completions import LocalCompletionsAPI

  cfg, mesh, params = _tiny_model(spm_path)
  ids, ctxlen = [sp.bos_id(), *sp.encode(TEXT)], 4
  kw = {"num_tokens": tokenizer.vocab_size, "detokenize": tokenizer.decode}
  request = engine_lib.Request(tuple(ids), 1, logprobs=1, echo=True)
  reference = engine_lib.Engine(cfg, mesh, params, **kw).generate([request])[0]
  served = engine_lib.Engine(cfg, mesh, params, end_ids=[reference.tokens[0]], **kw)  # EOS is the greedy next token
  served.start()
  try:
    with running(server_app.create_app(served, tokenizer, server_options.Options(MODEL))) as url:
      body = {"model": MODEL, "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "echo": True}
      status, out = post(url, "/v1/completions", body)
  finally:
    served.stop()
  assert status == 200, out
  assert len(out["choices"][0]["logprobs"]["token_logprobs"]) == len(ids) + 1
  ((total, _),) = LocalCompletionsAPI.parse_logprobs(out, tokens=[ids], ctxlens=[ctxlen])
  assert total == pytest.approx(sum(e.logprob for e in reference.prompt_logprobs[ctxlen:]), abs=1e-4)


def test_more_choices_than_the_queue_holds_is_a_400_naming_n(tokenizer):
  with started(tokenizer, max_queue=8) as (engine, url):
    status, out = post(url, "/v1/completions", {"model": MODEL, "prompt": "The sun", "max_tokens": 2, "n": 13})
    assert_error(status, out, 400, "n:")
    assert not engine.submitted  # none of its choices reached the engine
    assert post(url, "/v1/completions", {"model": MODEL, "prompt": "The sun", "max_tokens": 2, "n": 8})[0] == 200


class AbortingEngine(FakeEngine):
  """Ends every request with "abort", as the real engine does when it stops or fails."""

  def submit(self, request, on_update):
    request_id = super().submit(request, lambda update: None)
    self.cancel(request_id)
    on_update(engine_lib.Update([], "", None, finish_reason="abort"))
    return request_id


@pytest.mark.parametrize("stream", [False, True])
def test_an_aborted_request_is_an_error_not_a_short_answer(tokenizer, stream):
  engine = AbortingEngine(tokenizer)
  engine.start()
  try:
    with running(server_app.create_app(engine, tokenizer, server_options.Options(MODEL))) as url:
      body = {"model": MODEL, "prompt": "The sun", "max_tokens": 4, "stream": stream}
      status, out = post(url, "/v1/completions", body)
      if stream:  # the stream's only event is the error
        assert status == 200 and '"code": "engine_aborted"' in out.replace('":"', '": "') and "choices" not in out
      else:
        assert_error(status, out, 500, "the engine stopped or failed")
  finally:
    engine.stop()


# ------------------------------------------------------------------------------------------ one client, everyone
def _health_latencies(url, busy: threading.Thread) -> list[float]:
  """Seconds each GET /health took, asked one after another while `busy` runs (at least 3 times)."""
  latencies = []
  while busy.is_alive() or len(latencies) < 3:
    start = time.perf_counter()
    assert post(url, "/health", b"", method="GET")[0] == 200
    latencies.append(time.perf_counter() - start)
    time.sleep(0.01)
  return latencies


@pytest.mark.slow  # seconds of parsing on purpose
def test_a_huge_request_does_not_stall_the_others(tokenizer, sp):
  """A 9 MB completions body of 3M token ids and a /tokenize text of 900k characters (both under the body limit):
  while the server parses, checks and tokenizes them, /health answers within 0.5 s every time (before: the event
  loop did that work, and /health waited seconds), and they get their answers: a 400 naming the prompt and its
  size limit (before any validation), and the text's tokens."""
  with started(tokenizer) as (engine, url):
    results = {}
    text = "The sun of the sea is 3. " * 36_000
    # Encoded here, first: the test's client shares the server's process (and GIL).
    huge = json.dumps({"model": MODEL, "prompt": [5] * 3_000_000, "max_tokens": 1}).encode()
    long = json.dumps({"prompt": text}).encode()
    jobs = {"ids": lambda: post(url, "/v1/completions", huge), "text": lambda: post(url, "/tokenize", long)}
    for name, job in jobs.items():
      busy = threading.Thread(target=lambda name=name, job=job: results.update({name: job()}))
      with deadline(120):
        busy.start()
        latencies = _health_latencies(url, busy)
        busy.join()
      assert max(latencies) < 0.5, (name, len(latencies), sorted(latencies)[-5:])
    assert_error(*results["ids"], 400, "prompt: 3000000 token ids, more than 48 (the longest prompt")
    status, out = results["text"]
    assert status == 200 and out["tokens"] == ids_of(sp, text) and out["count"] == len(out["tokens"])
    assert not engine.submitted


SIZES = [  # (path, body, the message's start): each over a bound, refused before validation or tokenization
  ("/v1/completions", {"prompt": [5] * 49}, "prompt: 49 token ids, more than 48"),
  ("/v1/completions", {"prompt": [[5], [5] * 49]}, "prompt[1]: 49 token ids, more than 48"),
  ("/v1/completions", {"prompt": ["sun"] * 9}, "prompt: 9 prompts, more than 8 (server_max_queue"),
  ("/v1/completions", {"prompt": "s" * 1001}, "prompt: 1001 characters, more than 1000 (server_max_prompt_chars"),
  ("/v1/completions", {"prompt": ["sun", "s" * 1001]}, "prompt[1]: 1001 characters"),
  ("/v1/completions", {"prompt": "sun", "stop": ["x" * 257]}, "stop[0]: 257 characters, more than 256"),
  ("/v1/completions", {"prompt": "sun", "stop": ["x"] * 65}, "stop: 65 stop strings, more than 64"),
  ("/v1/completions", {"prompt": "sun", "stop_token_ids": [5] * 65}, "stop_token_ids: 65 token ids, more than 64"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "s" * 600}] * 2}, "messages: 1200 characters"),
  ("/v1/chat/completions", {"messages": [{"role": "user"}] * 4097}, "messages: 4097 messages, more than 4096"),
  ("/tokenize", {"prompt": "s" * 1001}, "prompt: 1001 characters, more than 1000"),
  ("/detokenize", {"tokens": [5] * 65}, "tokens: 65 token ids, more than 64 (max_target_length)"),
]


def test_fields_over_their_size_are_refused_first_naming_the_bound(tokenizer):
  engine = FakeEngine(tokenizer)
  engine.start()
  try:
    with running(server_app.create_app(engine, tokenizer, server_options.Options(MODEL, max_prompt_chars=1000))) as url:
      for path, body, message in SIZES:
        status, out = post(url, path, body)
        assert_error(status, out, 400, message)
        assert out["error"]["message"].startswith(message), out
      assert post(url, "/tokenize", {"prompt": "s" * 1000})[0] == 200  # the bound itself is fine
  finally:
    engine.stop()
  assert not engine.submitted


def _read_until_closed(sock: socket.socket, seconds: float) -> tuple[bytes, float]:
  """(what the server sent until it closed the connection, seconds it took); fails after `seconds`."""
  start, data = time.perf_counter(), b""
  sock.settimeout(seconds)
  while True:
    try:
      chunk = sock.recv(65536)
    except TimeoutError:
      pytest.fail(f"the server held the connection for {seconds} s")
    if not chunk:
      return data, time.perf_counter() - start
    data += chunk


def test_slow_headers_and_bodies_are_cut_after_the_read_timeout(tokenizer):
  """server_read_timeout=1: a client that connects and sends nothing, one that sends half its headers, one that
  sends half its body, and one whose second request on a kept-alive connection stops mid-headers are each answered
  408 and disconnected within 3 s (before: held forever); the server goes on serving."""
  engine = FakeEngine(tokenizer)
  engine.start()
  try:
    with running(server_app.create_app(engine, tokenizer, server_options.Options(MODEL, read_timeout=1))) as url:
      host, port = url.removeprefix("http://").split(":")
      head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
      body = json.dumps({"prompt": "sun", "max_tokens": 1}).encode()
      whole = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
      clients = {
        "nothing": b"",
        "half the headers": head.encode(),
        "half the body": f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body[:5],
        "kept alive, then half the headers": whole + head.encode(),
      }
      socks = {name: socket.create_connection((host, int(port)), timeout=SECONDS) for name in clients}
      for name, data in clients.items():
        socks[name].sendall(data)
      for name, sock in socks.items():
        with sock:
          got, seconds = _read_until_closed(sock, 5)
        assert seconds < 3, (name, seconds)
        assert got.count(b"HTTP/1.1 408") == 1, (name, got)
        if name == "half the body":
          assert b"did not arrive within 1 s (server_read_timeout)" in got, got
        if name.startswith("kept alive"):
          assert got.startswith(b"HTTP/1.1 200"), got
      out = client(url).completions.create(model=MODEL, prompt="sun", max_tokens=2)
      assert out.choices[0].finish_reason == "length"
  finally:
    engine.stop()


SURROGATES = [  # (path, body with a lone surrogate, the field the 400 names)
  ("/v1/completions", {"prompt": "The \ud800 sun"}, "prompt"),
  ("/v1/completions", {"prompt": ["sun", "\udfff"]}, "prompt[1]"),
  ("/v1/completions", {"prompt": "sun", "stop": "\ud800"}, "stop"),
  ("/v1/completions", {"prompt": "sun", "stop": ["a", "b\ud800"]}, "stop[1]"),
  ("/v1/completions", {"prompt": "sun", "model": "\ud800"}, "model"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
  (
    "/v1/chat/completions",
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
    "messages[0].content[0].text",
  ),
  ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "x"}]}, "messages[0].role"),
  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "\ud800": 1}]}, "messages[0] (a key)"),
  ("/tokenize", {"prompt": "\ud800"}, "prompt"),
]


def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(server):
  """JSON's "\\ud800" parses to a lone surrogate, which no tokenizer or response can encode (before: a 500 and a
  traceback for prompts, chat content and /tokenize)."""
  engine, url = server
  for path, body, field in SURROGATES:
    raw = json.dumps(body).encode()
    assert b"\\ud" in raw or b"\\udfff" in raw  # sent as JSON's escape, as a client would
    status, out = post(url, path, raw)
    assert_error(status, out, 400, f"{field} holds a lone surrogate")
    assert out["error"]["param"] == field.split("[")[0].split(" ")[0].split(".")[0], out
  assert post(url, "/tokenize", {"prompt": "\ud83d\ude00"})[0] == 200  # an escaped pair is one character: fine
  assert not engine.submitted


# ------------------------------------------------------------------------------------------ wrong shapes
BASES = {  # a valid body of each route, every field of it present
  "/v1/completions": {
    "model": MODEL, "prompt": "sun", "max_tokens": 2, "temperature": 0.5, "top_p": 1, "top_k": 0, "n": 1, "seed": 3,
    "stop": ["zz"], "stop_token_ids": [7], "echo": False, "logprobs": 1, "stream": False,
    "stream_options": {"include_usage": True},
  },
  "/v1/chat/completions": {
    "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "sun"}]}], "max_tokens": 2,
    "logprobs": True, "top_logprobs": 1, "stop": "zz", "n": 1,
  },
  "/tokenize": {"prompt": "sun", "add_special_tokens": True},
  "/detokenize": {"tokens": [5, 6]},
}  # fmt: skip


def _nest(value, depth: int):
  for _ in range(depth):
    value = [value]
  return value


# (name, value -> the value put in its place); "body" ones break the whole body, so the 400 names the body.
WRONG_SHAPES = [
  ("a list", lambda v: [v]),
  ("an object", lambda v: {"a": v}),
  ("null", lambda v: None),
  ("nested nulls", lambda v: [None, {"x": None}]),
  ("a number as a string", lambda v: str(v) if isinstance(v, int | float) else "5"),
  ("a huge int", lambda v: 10**30),
  ("a huge negative int", lambda v: -(10**30)),
  ("a 4000-digit int", lambda v: 10**4000),
  ("a huge float", lambda v: 1e308),
  ("a float", lambda v: 2.5),
  ("a bool", lambda v: True),
  ("-1", lambda v: -1),
  ("an empty string", lambda v: ""),
  ("an empty list", lambda v: []),
  ("an empty object", lambda v: {}),
  ("a lone surrogate", lambda v: "a\ud800b"),
  ("a huge list", lambda v: [v] * 20_000),
  ("nested 100 deep", lambda v: _nest(v, 100)),
]
BODY_SHAPES = [  # the raw body: (name, bytes)
  ("a list", b"[{}]"),
  ("a string", b'"x"'),
  ("null", b"null"),
  ("nested 100000 deep", b"[" * 100_000 + b"]" * 100_000),
  ("a 5000-digit int", b'{"max_tokens": 1' + b"0" * 5000 + b"}"),
  ("not UTF-8", b'{"prompt": "\xff"}'),
]


def _paths(value, path=()):
  """Every path into `value` (keys and list indices), the root first."""
  yield path
  if isinstance(value, dict):
    for key, item in value.items():
      yield from _paths(item, (*path, key))
  elif isinstance(value, list):
    for i, item in enumerate(value):
      yield from _paths(item, (*path, i))


def _replaced(value, path, fn):
  if not path:
    return fn(value)
  copy = dict(value) if isinstance(value, dict) else list(value)
  copy[path[0]] = _replaced(value[path[0]], path[1:], fn)
  return copy


def _shape_cases() -> list[tuple[str, str, bytes, str]]:
  """(route, what, body, the field its 400 names): each field at each depth of each route's valid body replaced
  by each wrong shape, and whole bodies of the wrong shape."""
  cases = []
  for route, base in BASES.items():
    for path in _paths(base):
      if not path:
        continue
      for name, fn in WRONG_SHAPES:
        what = ".".join(map(str, path)) + f" = {name}"
        cases.append((route, what, json.dumps(_replaced(base, path, fn)).encode(), str(path[0])))
    cases += [(route, f"the body = {name}", raw, "request body") for name, raw in BODY_SHAPES]
  return cases


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_wrong_shapes_are_4xx_naming_the_field(tokenizer, part):
  """Valid JSON of the wrong shape at every level of every route's body (lists for objects, nested nulls, numbers
  as strings, huge numbers, deep nesting, lone surrogates, huge lists, empty strings, ...): each ends within 5 s in
  a 200 (a shape the API takes, such as null for a default) or a 4xx whose message or param names the field (the
  request body, for a body that is no object), never a 500; and the server serves after them."""
  cases = fuzz_part(_shape_cases(), part)
  assert len(cases) > 50
  with started(tokenizer, delay=0.0005) as (engine, url):
    for i, (route, what, raw, field) in cases:
      start = time.perf_counter()
      with deadline(20):
        status, out = post(url, route, raw)
      assert time.perf_counter() - start < 5, (i, route, what)
      assert status == 200 or 400 <= status < 500, (i, route, what, status, out)
      if status != 200:
        assert_error(status, out, status, "")
        message, param = out["error"]["message"], out["error"]["param"]
        assert field in message or param == field, (i, route, what, out)
    out = client(url).completions.create(model=MODEL, prompt=TEXT, max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"


@pytest.mark.slow  # compiles three programs: about 20 s on 2 busy cores
def test_start_up_says_what_it_compiles_and_how_far_it_got(spm_path, capsys):
  """serve.py compiles before it listens (35 s on the demo model, silent before): it first prints how many programs
  of each kind, a count warmup then compiles exactly, and ends with how far it got and the time."""
  import re

  cfg, mesh, params = _tiny_model(spm_path)
  engine = engine_lib.Engine(cfg, mesh, params, num_slots=1)
  server_run.compile_programs(engine)
  lines = capsys.readouterr().out.splitlines()
  first = re.fullmatch(
    r"Compiling the engine's programs before serving: (\d+) prefill sizes? and (\d+) generate shapes? \(rows x pages "
    r"read\), (\d+) programs?",
    lines[0],
  )
  assert first, lines
  prefill, generate, total = map(int, first.groups())
  assert total == prefill + generate == len(engine.runner.executables) and prefill > 1 and generate == 1
  assert lines[-2].startswith(f"  compiled {total}/{total} (") and lines[-1].startswith("Compiled the engine's programs")
