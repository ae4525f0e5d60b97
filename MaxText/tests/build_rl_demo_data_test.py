"""The RL demo's arithmetic: right answers, held-out questions no training problem repeats, the same files from the
same seed, and a tokenizer with one token per character."""

import json
import re

import pytest

from MaxText import build_rl_demo_data as demo
from MaxText.input_pipeline import tokenizer as tokenizer_lib

_PROBLEM = re.compile(r"^(\d+)([+-])(\d+)=$")


def _question(prompt: str) -> tuple[int, str, int]:
  """(a, op, b) of "a op b=", with "a+b" and "b+a" the same question."""
  a, op, b = _PROBLEM.match(prompt).groups()
  a, b = int(a), int(b)
  return (min(a, b), op, max(a, b)) if op == "+" else (a, op, b)


def test_answers_are_the_integers_of_the_problems():
  sets = demo.build(max_operand=20, num_heldout=50, num_train=0, seed=3)
  for prompt, answer in sets["train"] + sets["heldout"]:
    a, op, b = _PROBLEM.match(prompt).groups()
    assert answer == str(eval(f"{int(a)}{op}{int(b)}"))  # noqa: S307 (Python's own arithmetic is the reference)


def test_held_out_questions_are_never_trained_on():
  sets = demo.build(max_operand=20, num_heldout=50, num_train=0, seed=3)
  heldout = {_question(p) for p, _ in sets["heldout"]}
  assert len(sets["heldout"]) == 50 and not heldout & {_question(p) for p, _ in sets["train"]}
  # Every problem is in one split or the other, but for the commuted twins of held-out sums.
  assert len(sets["train"]) + len(sets["heldout"]) <= 2 * 21 * 21
  trained = {p for p, _ in sets["train"]}
  held = {p for p, _ in sets["heldout"]}
  for a in range(21):
    for op in "+-":
      for b in range(21):
        prompt = f"{a}{op}{b}="
        assert prompt in trained or prompt in held or _question(prompt) in heldout, prompt
  assert {op for p, _ in sets["train"] for op in "+-" if op in p} == {"+", "-"}
  assert len(demo.build(20, 50, num_train=100, seed=3)["train"]) == 100


def test_a_seed_gives_the_same_problems_and_another_seed_others():
  assert demo.build(20, 50, 0, seed=3) == demo.build(20, 50, 0, seed=3)
  assert demo.build(20, 50, 0, seed=3)["heldout"] != demo.build(20, 50, 0, seed=4)["heldout"]
  with pytest.raises(ValueError, match="num_heldout"):
    demo.build(2, 18, 0)


def test_files_and_tokenizer(tmp_path):
  assert demo.main([str(tmp_path / "a"), "--max_operand", "30", "--num_heldout", "40", "--seed", "5"]) == 0
  assert demo.main([str(tmp_path / "b"), "--max_operand", "30", "--num_heldout", "40", "--seed", "5"]) == 0
  for name in ("sft_train.jsonl", "rl_heldout.jsonl", "heldout_prompts.txt", "tokenizer.model"):
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
  out = tmp_path / "a"
  sft = [json.loads(line) for line in open(out / "sft_heldout.jsonl", encoding="utf-8")]
  rl = [json.loads(line) for line in open(out / "rl_heldout.jsonl", encoding="utf-8")]
  assert [(r["prompt"], r["completion"]) for r in sft] == [(r["prompt"], r["answer"]) for r in rl]
  assert (out / "heldout_prompts.txt").read_text().splitlines() == [r["prompt"] for r in rl]
  assert (out / "heldout_answers.txt").read_text().splitlines() == [r["answer"] for r in rl]
  assert len(rl) == 40 and set(json.loads(open(out / "rl_train.jsonl").readline())) == {"prompt", "answer"}

  tok = tokenizer_lib.load(str(out / "tokenizer.model"))
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2) and tok.vocab_size == 4 + 13  # the 13 characters
  for text in ("12+35=47", "3-15=-12", "0-0=0"):
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text  # one token per character, no dummy prefix
    assert ids[-2:] == tok.encode(text[-2:])  # an answer's tokens alone are those it has after its prompt
  assert demo.main([str(tmp_path / "c"), "--max_operand", "0"]) == 2
