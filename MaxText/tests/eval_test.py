"""lm-eval on the fine-tuning demo's held-out questions (end_to_end/lm_eval_tasks/): the task data, the Hugging Face
tokenizer folder against MaxText's SentencePiece tokenizer, the task YAMLs in lm-eval's TaskManager, and lm-eval's
own CLI against a fake OpenAI-compatible server that answers a known share of the questions right.

The real server and engine (end_to_end/eval_demo.sh --quick) run in end_to_end_scripts_test.py.
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from MaxText import build_finetune_demo_data as demo_data
from MaxText import chat_template as template_lib
from MaxText import train_tokenizer
from MaxText.decode import visible
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.tests.helpers import REPO_ROOT

TASKS_DIR = os.path.join(REPO_ROOT, "end_to_end", "lm_eval_tasks")
_spec = importlib.util.spec_from_file_location("finetune_heldout", os.path.join(TASKS_DIR, "finetune_heldout.py"))
heldout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout)

# Passages with what SentencePiece's normalization changes: runs of spaces, a tab, NFKC ligatures and fractions,
# curly quotes and dashes, accents.
PASSAGES = {
  "Genesis": ["In the beginning God created the heaven and the earth.", "And God said,  Let there be light: and there was."],
  "1 John": ["Beloved, let us love one another:\tfor love is of God.", "My little children, let us not love in word."],
  "John": ["In the beginning was the Word, and the Word was with God.", "Jesus wept — and the ﬁrst ½ hour passed."],
  "Hamlet": ["To be, or not to be: that is the question.", "O, that this too too solid ﬂesh would melt."],
  "Macbeth": ["Is this a dagger which I see before me?", "Out, damned spot! out, I say! — ’tis naïve."],
  "King Lear": ["How sharper than a serpent’s tooth it is", "Nothing will come of nothing: speak again."],
}
BIBLE = ("Genesis", "1 John", "John")
N = 12  # held-out questions; the fake answers a known subset of them right
GEN_RIGHT = {i for i in range(N) if i % 3 == 0}
MC_RIGHT = {i for i in range(N) if i % 4 == 1}


def _questions(title: str, passage: str) -> list[dict]:
  source = "the Bible" if title in BIBLE else "Shakespeare"
  ask = demo_data.BIBLE_QUESTION if title in BIBLE else demo_data.PLAY_QUESTION
  return [
    {"prompt": demo_data.SOURCE_QUESTION + passage, "completion": source},
    {"prompt": ask + passage, "completion": title},
  ]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
  """(eval dir, tokenizer path, rows): a small tokenizer trained on the passages, the demo's files of questions
  (build_finetune_demo_data.py's sft_*.jsonl), and finetune_heldout.py prepare's output from them."""
  root = tmp_path_factory.mktemp("eval")
  texts = [
    q["prompt"] + " " + q["completion"]
    for title, passages in PASSAGES.items()
    for p in passages
    for q in _questions(title, p)
  ]
  train_tokenizer.train(texts * 5, vocab_size=350, output=str(root / "tok.model"))
  rows = [q for title, passages in PASSAGES.items() for p in passages for q in _questions(title, p)]
  random.Random(0).shuffle(rows)
  (root / "data").mkdir()
  for name, part in (("sft_train.jsonl", rows[N:]), ("sft_heldout.jsonl", rows[:N])):
    (root / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
  out = heldout.prepare(str(root / "data"), str(root / "eval"), str(root / "tok.model"))
  return root / "eval", str(root / "tok.model"), out


def test_exact_match_is_the_demos_score():
  """finetune_demo.sh: `o.strip() == a`, nothing else forgiven."""
  doc = {"answer": "the Bible"}
  assert heldout.exact_match(doc, [" the Bible\n"]) == {"exact_match": 1.0}
  assert heldout.exact_match(doc, ["the Bible"]) == {"exact_match": 1.0}
  for wrong in ("the bible", "the Bible.", "the  Bible", "Bible", ""):
    assert heldout.exact_match(doc, [wrong]) == {"exact_match": 0.0}, wrong


def test_rows_choose_among_the_answers_of_their_kind(task):
  _, _, rows = task
  assert [r["question"] for r in rows] == (task[0] / "prompts.txt").read_text(encoding="utf-8").splitlines()
  assert [r["answer"] for r in rows] == (task[0] / "answers.txt").read_text(encoding="utf-8").splitlines()
  expected = {"source": ["Shakespeare", "the Bible"], "bible": sorted(BIBLE), "play": ["Hamlet", "King Lear", "Macbeth"]}
  for r in rows:
    assert r["choices"] == expected[r["kind"]] and r["choices"][r["label"]] == r["answer"]
    # The fallback template's generation prompt ends at "Assistant:"; a reply is "Assistant: " + content.
    assert r["continuations"] == [" " + c for c in r["choices"]]
  assert len(rows) == N and {r["kind"] for r in rows} == set(expected)


def test_decode_outputs_reads_what_decode_prints():
  """Answers as decode.py prints them (visible(): a tab escaped, a line break kept), a backtick and a line break
  inside one included; the demo's one-line pattern could not read the second."""
  questions = ["Which play is this line from? O\tRomeo", "Which book of the Bible is this verse from? Jesus wept."]
  answers = [" Hamlet ", "John`\n`Input"]
  text = "".join(f"Input `{visible(q)}` -> `{visible(a)}`\n" for q, a in zip(questions, answers, strict=True))
  text = f"Parameters from somewhere\n{text}Prefill: 1.0 ms for 2 prompt(s)\n"
  assert heldout.decode_outputs(text, questions) == answers
  with pytest.raises(ValueError, match="question 2"):
    heldout.decode_outputs(text.replace("Prefill", "Compile"), questions)


def test_reply_prefix_follows_the_template():
  chatml = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
  )
  assert heldout.reply_prefix(chatml, {}) == ""
  assert heldout.reply_prefix(template_lib.FALLBACK_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}) == " "


def test_hf_tokenizer_folder_tokenizes_like_ours(task):
  """The folder lm-eval loads gives MaxText's tokens on every text of the task and on a seeded fuzz of texts with
  the special tokens, whitespace runs, tabs, newlines, NFKC-changed and byte-fallback characters."""
  from transformers import AutoTokenizer

  eval_dir, tokenizer_path, rows = task
  hf = AutoTokenizer.from_pretrained(str(eval_dir / "hf_tokenizer"))
  ours = tokenizer_lib.load(tokenizer_path)
  compiled = template_lib.compile_template(template_lib.FALLBACK_TEMPLATE)
  for r in rows:
    turns = [{"role": "user", "content": r["question"]}]
    context = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert hf(context, add_special_tokens=False).input_ids == decode_prompt(compiled, ours, r["question"])
    for c in r["continuations"]:
      assert hf(context + c, add_special_tokens=False).input_ids == ours.encode_with_specials(context + c)
  pieces = [*"ab Ec  d,.:;!?'\n\t\r<>/", "<s>", "</s>", "<pad>", "ﬁ", "½", "é", "’", "—", "日本", "🙂", "\u00a0", "\u3000"]
  rng = random.Random(0)
  for _ in range(2000):
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
    assert hf(text, add_special_tokens=False).input_ids == ours.encode_with_specials(text), repr(text)
  assert hf.decode(ours.encode("Jesus wept — the ﬁrst")) == ours.decode(ours.encode("Jesus wept — the ﬁrst"))


def decode_prompt(compiled, ours, question: str) -> list[int]:
  """decode.py's prompt tokens with use_chat_template=true (decode.prompt_tokens, without a Config)."""
  return template_lib.render(compiled, ours, [{"role": "user", "content": question}], add_generation_prompt=True)


def test_tokenizer_check_refuses_a_text_split_otherwise(task):
  """SentencePiece never reads the text "<unk>" as its unknown piece; tokenizers' Unigram does. prepare's check
  catches such a text before lm-eval scores the wrong tokens."""
  from transformers import AutoTokenizer

  eval_dir, tokenizer_path, rows = task
  hf = AutoTokenizer.from_pretrained(str(eval_dir / "hf_tokenizer"))
  ours = tokenizer_lib.load(tokenizer_path)
  heldout.check_tokenizer(hf, ours, template_lib.FALLBACK_TEMPLATE, rows)
  bad = {**rows[0], "question": rows[0]["question"] + " <unk>"}
  with pytest.raises(ValueError, match="splits"):
    heldout.check_tokenizer(hf, ours, template_lib.FALLBACK_TEMPLATE, [bad])


def test_tasks_load_offline_in_lm_evals_task_manager(task, monkeypatch, tmp_path):
  import datasets
  from lm_eval.tasks import TaskManager, get_task_dict

  eval_dir, _, rows = task
  monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
  monkeypatch.chdir(eval_dir)  # the YAMLs read heldout_eval.jsonl from the folder lm_eval runs in
  tasks = get_task_dict([heldout.GEN_TASK, heldout.MC_TASK], TaskManager(include_path=TASKS_DIR))
  gen, mc = tasks[heldout.GEN_TASK], tasks[heldout.MC_TASK]
  for t in (gen, mc):
    docs = list(t.test_docs())
    assert [t.doc_to_text(d) for d in docs] == [r["question"] for r in rows]
  assert [gen.doc_to_target(d) for d in gen.test_docs()] == [r["answer"] for r in rows]
  assert gen.config.generation_kwargs == {"until": [], "max_gen_toks": 16, "do_sample": False, "temperature": 0.0}
  assert gen.process_results(rows[0], [f" {rows[0]['answer']} "]) == {"exact_match": 1.0}
  assert [mc.doc_to_choice(d) for d in mc.test_docs()] == [r["continuations"] for r in rows]
  assert [mc.doc_to_target(d) for d in mc.test_docs()] == [r["label"] for r in rows]


class FakeServer:
  """An OpenAI-compatible server on loopback that answers deterministically: chat completions with the right
  answer (padded with whitespace, which the score strips) for the questions in GEN_RIGHT and a wrong one otherwise;
  completions with echo give the last prompt token log-probability -0.1 where the continuation is the right answer
  of a question in MC_RIGHT or a wrong answer of another, -5 otherwise (every other token 0), so lm-eval's
  multiple-choice pick is right exactly for MC_RIGHT. It records what does not match decode.py's prompt."""

  def __init__(self, rows, tokenizer_path):
    self.rows, ours = rows, tokenizer_lib.load(tokenizer_path)
    compiled = template_lib.compile_template(template_lib.FALLBACK_TEMPLATE)
    self.scored = {}  # every prompt lm-eval must send: the chat-templated question and a continuation, MaxText's tokens
    for i, r in enumerate(rows):
      context = compiled.render(
        messages=[{"role": "user", "content": r["question"]}], add_generation_prompt=True, **ours.special_tokens
      )
      for k, c in enumerate(r["continuations"]):
        self.scored[tuple(ours.encode_with_specials(context + c))] = (i, k)
    self.problems, self.calls = [], {"chat": 0, "completions": 0}
    server = self

    class Handler(BaseHTTPRequestHandler):
      def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = server.chat(body) if self.path == "/v1/chat/completions" else server.completions(body)
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

      def log_message(self, *args):
        pass

    self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def chat(self, body) -> dict:
    self.calls["chat"] += 1
    questions = [r["question"] for r in self.rows]
    turns = body["messages"]
    if len(turns) != 1 or turns[0]["role"] != "user" or turns[0]["content"] not in questions:
      self.problems.append(f"chat messages {turns}")
      return {"choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}]}
    if (body.get("max_tokens"), body.get("temperature"), body.get("stop")) != (16, 0.0, []):
      self.problems.append(f"chat sampling {body}")
    i = questions.index(turns[0]["content"])
    reply = f" {self.rows[i]['answer']}\n" if i in GEN_RIGHT else "Leviticus"
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}]}

  def completions(self, body) -> dict:
    self.calls["completions"] += 1
    if not (body.get("echo") and body.get("logprobs") and body.get("max_tokens") == 1):
      self.problems.append(f"completions {body}")
    choices = []
    for index, ids in enumerate(body["prompt"]):  # token ids: lm-eval tokenizes with the folder's tokenizer
      if tuple(ids) not in self.scored:
        self.problems.append(f"prompt {ids} is no question and continuation as MaxText tokenizes them")
      i, k = self.scored.get(tuple(ids), (0, -1))
      last = -0.1 if (k == self.rows[i]["label"]) == (i in MC_RIGHT) else -5.0
      logprobs = [None] + [0.0] * (len(ids) - 2) + [last, -1.0]  # the prompt's, then the one generated token's
      top = [None] + [{"t": lp} for lp in logprobs[1:]]
      choices.append({"index": index, "text": "x", "logprobs": {"token_logprobs": logprobs, "top_logprobs": top}})
    return {"choices": choices}

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def lm_eval(args: list[str], cwd, tmp_path) -> str:
  env = {
    **os.environ,
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_CACHE": str(tmp_path / "datasets"),
    "NO_PROXY": "127.0.0.1,localhost",
  }
  command = [sys.executable, "-m", "lm_eval", "run", *args, "--include_path", TASKS_DIR, "--apply_chat_template"]
  proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
  return proc.stdout + proc.stderr


@pytest.mark.slow
def test_lm_eval_cli_scores_a_fake_server(task, tmp_path):
  """lm-eval's CLI, both tasks, against FakeServer: the accuracies are the shares the fake answers right, every
  request carries decode.py's prompt (as messages, or as the exact token ids), and `compare` reports lm-eval's
  generations beside a decode.py output of the same answers (about 30 s; the fast checks above cover the parts)."""
  eval_dir, tokenizer_path, rows = task
  fake = FakeServer(rows, tokenizer_path)
  out = tmp_path / "lm_eval"
  common = ["--output_path", str(out), "--log_samples"]
  try:
    lm_eval(
      ["--model", "local-chat-completions", "--tasks", heldout.GEN_TASK, *common, "--model_args",
       f"model=demo,base_url={fake.url}/chat/completions,num_concurrent=4,max_retries=1,tokenized_requests=False"],
      eval_dir, tmp_path,
    )  # fmt: skip
    lm_eval(
      ["--model", "local-completions", "--tasks", heldout.MC_TASK, *common, "--model_args",
       f"model=demo,base_url={fake.url}/completions,tokenizer_backend=huggingface,"
       f"tokenizer={eval_dir / 'hf_tokenizer'},num_concurrent=4,max_retries=1"],
      eval_dir, tmp_path,
    )  # fmt: skip
  finally:
    fake.close()
  assert fake.problems == [], fake.problems[:3]
  assert fake.calls == {"chat": N, "completions": sum(len(r["choices"]) for r in rows)}
  gen, samples = heldout.lm_eval_result(str(out), heldout.GEN_TASK)
  mc, _ = heldout.lm_eval_result(str(out), heldout.MC_TASK)
  # Means of N zeros and ones: k / N as the float division gives it (lm-eval sums then divides, as here).
  assert gen == pytest.approx(len(GEN_RIGHT) / N, abs=1e-12) and mc == pytest.approx(len(MC_RIGHT) / N, abs=1e-12)
  assert [s["doc"]["question"] for s in samples] == [r["question"] for r in rows]

  # decode.py's lines for the same answers, the last one different: compare counts it out.
  replies = [f" {r['answer']}\n" if i in GEN_RIGHT else "Leviticus" for i, r in enumerate(rows)]
  replies[-1] = rows[-1]["answer"] if N - 1 not in GEN_RIGHT else "Leviticus"
  lines = [f"Input `{visible(r['question'])}` -> `{visible(reply)}`" for r, reply in zip(rows, replies, strict=True)]
  lines.append("Prefill: 1.0 ms for 12 prompt(s); generate: ...")
  (tmp_path / "decode.txt").write_text("Parameters from ...\n" + "\n".join(lines) + "\n", encoding="utf-8")
  script = os.path.join(TASKS_DIR, "finetune_heldout.py")
  proc = subprocess.run(
    [sys.executable, script, "compare", str(eval_dir), str(tmp_path / "decode.txt"), str(out)],
    env={**os.environ, "PYTHONPATH": REPO_ROOT}, capture_output=True, text=True, timeout=120, check=False,
  )  # fmt: skip
  assert proc.returncode == 0, proc.stderr
  summary = json.loads((eval_dir / "accuracy.json").read_text())
  decode_right = len(GEN_RIGHT) + (N - 1 not in GEN_RIGHT)
  assert summary == {
    "questions": N,
    "lm_eval_gen_exact_match": gen,
    "lm_eval_mc_acc": mc,
    "decode_exact_match": decode_right / N,
    "identical_generations": N - 1,
  }
  assert f"identical in lm-eval and decode.py: {N - 1}/{N}" in proc.stdout
