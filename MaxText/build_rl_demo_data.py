"""Builds the RL demo's task, arithmetic with a checkable answer: `python3 MaxText/build_rl_demo_data.py OUT_DIR`.

Every problem is "A+B=" or "A-B=" with A and B drawn from 0..--max_operand, and its answer is the exact integer
("12+35=" -> "47", "3-15=" -> "-12"). The task needs no download and no corpus: a reward is exact match, and a
model of a few layers learns it only partly in a few hundred supervised steps, which leaves RL something to do.

The held-out problems are drawn first from all of them, with `--seed`, and no training problem is one of them
(nor is "B+A=" of a held-out "A+B=": addition commutes, so that would be the same question). Written to OUT_DIR:

  tokenizer.model                     a SentencePiece model of single characters (the digits, "+", "-", "=") with
                                      pad=0, eos=1, bos=2, unk=3 as train_tokenizer.py's: one token per digit
                                      is what lets a tiny model learn carries
  sft_train.jsonl, sft_heldout.jsonl  {"prompt", "completion"}: the warm-up (objective=sft, use_chat_template=false)
  rl_train.jsonl, rl_heldout.jsonl    {"prompt", "answer"}: RL prompts, and the answer the reward checks
  heldout_prompts.txt, heldout_answers.txt   one held-out problem (decode_prompts_file) and its answer per line
"""

import argparse
import io
import json
import os
import sys

import numpy as np

OPERATORS = ("+", "-")
SPECIAL_IDS = {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3}  # as MaxText/train_tokenizer.py's


def problem(a: int, op: str, b: int) -> tuple[str, str]:
  """(prompt, answer) of one problem: ("12+35=", "47")."""
  return f"{a}{op}{b}=", str(a + b if op == "+" else a - b)


def _key(a: int, op: str, b: int) -> tuple[int, str, int]:
  """The same key for problems that are one question: "A+B=" and "B+A="."""
  return (min(a, b), op, max(a, b)) if op == "+" else (a, op, b)


def build(max_operand: int, num_heldout: int, num_train: int, seed: int = 0) -> dict[str, list[tuple[str, str]]]:
  """{"train": [(prompt, answer)], "heldout": [...]}: num_heldout problems drawn with `seed`, then up to num_train
  (0: all) of the others whose question is none of the held-out ones, each list in a random order."""
  everything = [(a, op, b) for a in range(max_operand + 1) for op in OPERATORS for b in range(max_operand + 1)]
  if not 0 < num_heldout < len(everything):
    raise ValueError(f"--num_heldout={num_heldout} must be between 1 and {len(everything) - 1} for this --max_operand")
  rng = np.random.default_rng(seed)
  order = rng.permutation(len(everything))
  heldout = [everything[i] for i in order[:num_heldout]]
  taken = {_key(*p) for p in heldout}
  train = [everything[i] for i in order[num_heldout:] if _key(*everything[i]) not in taken]
  train = train[:num_train] if num_train > 0 else train
  return {"train": [problem(*p) for p in train], "heldout": [problem(*p) for p in heldout]}


def train_tokenizer(texts: list[str], output: str) -> None:
  """A character-level SentencePiece model of every character of `texts`, written to `output`. No dummy prefix:
  "47" is two tokens, the same alone (a completion) as after "12+35=" (what the model generates)."""
  import sentencepiece as spm  # Lazy, as the tokenizer loaders import it.

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=model,
    model_type="char",
    vocab_size=len(set("".join(texts))) + len(SPECIAL_IDS),
    character_coverage=1.0,
    add_dummy_prefix=False,
    normalization_rule_name="identity",
    num_threads=1,
    minloglevel=2,
    **SPECIAL_IDS,
  )
  with open(output, "wb") as f:
    f.write(model.getvalue())


def write(out_dir: str, sets: dict[str, list[tuple[str, str]]]) -> None:
  os.makedirs(out_dir, exist_ok=True)
  for split, rows in sets.items():
    for name, column in (("sft", "completion"), ("rl", "answer")):
      with open(os.path.join(out_dir, f"{name}_{split}.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"prompt": q, column: a}) + "\n" for q, a in rows)
  with open(os.path.join(out_dir, "heldout_prompts.txt"), "w", encoding="utf-8") as f:
    f.writelines(q + "\n" for q, _ in sets["heldout"])
  with open(os.path.join(out_dir, "heldout_answers.txt"), "w", encoding="utf-8") as f:
    f.writelines(a + "\n" for _, a in sets["heldout"])
  train_tokenizer([q + a for rows in sets.values() for q, a in rows], os.path.join(out_dir, "tokenizer.model"))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("out_dir")
  parser.add_argument("--max_operand", type=int, default=99, help="operands are 0..max_operand")
  parser.add_argument("--num_heldout", type=int, default=200)
  parser.add_argument("--num_train", type=int, default=0, help="training problems (0: all the others)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.max_operand < 1:
    print(f"error: --max_operand={args.max_operand} must be at least 1", file=sys.stderr)
    return 2
  try:
    sets = build(args.max_operand, args.num_heldout, args.num_train, args.seed)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  write(args.out_dir, sets)
  print(f"Wrote {args.out_dir}: {len(sets['train'])} training and {len(sets['heldout'])} held-out problems", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
