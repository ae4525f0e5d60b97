"""The fine-tuning demo's held-out questions as lm-evaluation-harness tasks (finetune_heldout_gen.yaml and
finetune_heldout_mc.yaml beside this file), and what end_to_end/eval_demo.sh needs around them:

  python3 end_to_end/lm_eval_tasks/finetune_heldout.py prepare DATA_DIR EVAL_DIR [--limit N] [--tokenizer_path P]
      DATA_DIR is MaxText/build_finetune_demo_data.py's output. Writes to EVAL_DIR:
        heldout_eval.jsonl  one held-out question a line: question, answer, kind, choices (every answer of its kind
                            in the demo's data), continuations (each choice as the model's reply starts: after the
                            chat template's generation prompt) and label (the answer's index in choices)
        prompts.txt, answers.txt   the same questions and answers, one a line (decode.py's decode_prompts_file)
        hf_tokenizer/       the SentencePiece tokenizer as a Hugging Face tokenizer folder, with the chat template
                            decode.py and serve.py render: lm-eval's local-completions model tokenizes with it
  python3 end_to_end/lm_eval_tasks/finetune_heldout.py compare EVAL_DIR DECODE_OUTPUT LM_EVAL_OUTPUT_DIR
      Prints lm-eval's two accuracies and decode.py's exact match on the same questions (as finetune_demo.sh
      scores it), with how many generations are identical, and writes them to EVAL_DIR/accuracy.json.

lm-eval imports this file for `process_results: !function finetune_heldout.exact_match`; nothing of MaxText is
imported until a command needs it. Run it with the repository root on PYTHONPATH.
"""

import argparse
import glob
import json
import os
import sys

DATA_FILE = "heldout_eval.jsonl"  # what the task YAMLs read, relative to the folder lm_eval runs in
GEN_TASK = "finetune_heldout_gen"
MC_TASK = "finetune_heldout_mc"
# finetune_demo.sh's question kinds (the start of each question).
KINDS = {"source": "Is this from", "bible": "Which book", "play": "Which play"}


def exact_match(doc: dict, results: list[str]) -> dict:
  """lm-eval's process_results for the generate-until task: the fine-tuning demo's score, the stripped generation
  equal to the answer (lm-eval's own exact_match metric does not strip, and its filters strip only the left)."""
  return {"exact_match": float(results[0].strip() == doc["answer"])}


def kind_of(question: str) -> str:
  for kind, start in KINDS.items():
    if question.startswith(start):
      return kind
  raise ValueError(f"question {question[:60]!r} is of no known kind (starts: {', '.join(KINDS.values())})")


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def reply_prefix(template: str, special_tokens: dict[str, str]) -> str:
  """The text a chat template puts between its generation prompt and an assistant reply's content (" " for the
  fallback template of MaxText/chat_template.py: the prompt ends at "Assistant:"). A multiple-choice continuation
  starts with it, so that the scored tokens are those the model was fine-tuned to give."""
  from MaxText import chat_template as template_lib

  compiled = template_lib.compile_template(template)
  marker = "\x00reply\x00"
  user = [{"role": "user", "content": "question"}]
  prompt = compiled.render(messages=user, add_generation_prompt=True, **special_tokens)
  whole = compiled.render(
    messages=[*user, {"role": "assistant", "content": marker}], add_generation_prompt=False, **special_tokens
  )
  if not whole.startswith(prompt) or marker not in whole[len(prompt) :]:
    raise ValueError("the chat template's rendering of a reply does not start with its generation prompt")
  return whole[len(prompt) : whole.index(marker)]


def task_rows(data_dir: str, prefix: str, limit: int | None = None) -> list[dict]:
  """The held-out questions of build_finetune_demo_data.py's DATA_DIR (in heldout_prompts.txt's order), each with
  the answers of its kind in the training and held-out sets as choices (as its DPO pairs draw wrong answers)."""
  train = read_jsonl(os.path.join(data_dir, "sft_train.jsonl"))
  heldout = read_jsonl(os.path.join(data_dir, "sft_heldout.jsonl"))
  choices = {kind: set() for kind in KINDS}
  for row in train + heldout:
    choices[kind_of(row["prompt"])].add(row["completion"])
  rows = []
  for row in heldout[:limit]:
    mine = sorted(choices[kind_of(row["prompt"])])
    rows.append(
      {
        "question": row["prompt"],
        "answer": row["completion"],
        "kind": kind_of(row["prompt"]),
        "choices": mine,
        "continuations": [prefix + c for c in mine],
        "label": mine.index(row["completion"]),
      }
    )
  return rows


def hf_tokenizer(model_path: str, chat_template: str):
  """A transformers tokenizer that splits text as MaxText's SentencePiece tokenizer does (input_pipeline/tokenizer.py:
  `encode_with_specials`), the export's conversion (MaxText/convert/spm_tokenizer.py) without BOS added: lm-eval
  gives it rendered chat templates, whose "<s>" is the BOS token. One difference remains: SentencePiece never
  matches its byte and unknown pieces in text, where tokenizers' Unigram reads the literal text "<0x41>" or "<unk>"
  as that piece, so `check_tokenizer` compares the two on every text a task tokenizes."""
  from transformers import PreTrainedTokenizerFast

  from MaxText.convert import spm_tokenizer

  if not spm_tokenizer.is_unigram(model_path):
    raise ValueError(f"{model_path} is not a Unigram SentencePiece model; only those are converted here")
  tokenizer, specials = spm_tokenizer.build(model_path, add_bos=False)
  return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=chat_template, **specials)


def check_tokenizer(hf, ours, template: str, rows: list[dict]) -> None:
  """Raises ValueError unless the Hugging Face tokenizer `hf` gives MaxText's tokens (`ours`, a
  tokenizer_lib.Tokenizer) for every text lm-eval's local-completions model tokenizes in the multiple-choice task:
  each question through the chat template (hf's own apply_chat_template against decode.py's rendering), and that
  context followed by each continuation. A different split would score other tokens than the model was given; a
  continuation whose first token merges with the context's last would have lm-eval score part of the context."""
  from MaxText import chat_template as template_lib

  compiled = template_lib.compile_template(template)
  for row in rows:
    turns = [{"role": "user", "content": row["question"]}]
    context = hf.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    prompt = template_lib.render(compiled, ours, turns, add_generation_prompt=True)
    pairs = [(context, prompt)] + [(context + c, ours.encode_with_specials(context + c)) for c in row["continuations"]]
    for text, expected in pairs:
      if hf(text, add_special_tokens=False).input_ids != expected:
        raise ValueError(f"the Hugging Face tokenizer splits {text!r} unlike MaxText's; the task would score wrong tokens")
      if expected[: len(prompt)] != prompt:
        raise ValueError(f"{text!r}: the continuation's tokens do not start where the question's end")


def prepare(data_dir: str, eval_dir: str, tokenizer_path: str, limit: int | None = None) -> list[dict]:
  import transformers

  from MaxText import chat_template as template_lib
  from MaxText.input_pipeline import tokenizer as tokenizer_lib

  tokenizer_path = os.path.expanduser(tokenizer_path)
  ours = tokenizer_lib.load(tokenizer_path, "sentencepiece")
  template, _ = template_lib.find_template("", "", tokenizer_path)  # decode.py's and serve.py's, with no chat_template keys
  rows = task_rows(data_dir, reply_prefix(template, ours.special_tokens), limit)
  os.makedirs(eval_dir, exist_ok=True)
  with open(os.path.join(eval_dir, DATA_FILE), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  for name, key in (("prompts.txt", "question"), ("answers.txt", "answer")):
    with open(os.path.join(eval_dir, name), "w", encoding="utf-8") as f:
      f.writelines(row[key] + "\n" for row in rows)
  folder = os.path.join(eval_dir, "hf_tokenizer")
  hf_tokenizer(tokenizer_path, template).save_pretrained(folder)
  # As lm-eval loads it.
  check_tokenizer(transformers.AutoTokenizer.from_pretrained(folder), ours, template, rows)
  return rows


def lm_eval_result(output_dir: str, task: str) -> tuple[float, list[dict]]:
  """(the task's metric, its logged samples in document order) from `lm_eval --output_path DIR --log_samples`."""
  results = sorted(glob.glob(os.path.join(output_dir, "**", "results_*.json"), recursive=True), key=os.path.getmtime)
  for path in reversed(results):
    with open(path, encoding="utf-8") as f:
      metrics = json.load(f)["results"].get(task)
    if metrics is not None:
      samples = glob.glob(os.path.join(os.path.dirname(path), f"samples_{task}_*.jsonl"))
      logged = sorted(read_jsonl(max(samples, key=os.path.getmtime)), key=lambda s: s["doc_id"]) if samples else []
      return metrics["exact_match,none" if task == GEN_TASK else "acc,none"], logged
  raise ValueError(f"{output_dir} holds no lm-eval results of task {task}")


def decode_outputs(text: str, questions: list[str]) -> list[str]:
  """decode.py's answers, as printed (``Input `QUESTION` -> `ANSWER` `` in the questions' order, then its timing
  line), to each of `questions`: finetune_demo.sh reads the same lines with a one-line pattern, which this agrees
  with wherever that one finds every answer, and an answer holding a line break is read whole here."""
  from MaxText.decode import visible

  markers = [f"Input `{visible(q)}` -> `" for q in questions] + ["Prefill: "]
  outputs, at = [], 0
  for i, question in enumerate(questions):
    start = text.find(markers[i], at)
    end = text.find(f"`\n{markers[i + 1]}", start + len(markers[i])) if start >= 0 else -1
    if end < 0:
      raise ValueError(f"decode.py's output holds no answer to question {i + 1} ({question[:60]!r})")
    outputs.append(text[start + len(markers[i]) : end])
    at = end
  return outputs


def compare(eval_dir: str, decode_output: str, lm_eval_dir: str) -> dict:
  """lm-eval's accuracies and decode.py's exact match on the same questions; see the module docstring."""
  from MaxText.decode import visible

  rows = read_jsonl(os.path.join(eval_dir, DATA_FILE))
  with open(decode_output, encoding="utf-8") as f:
    outputs = decode_outputs(f.read(), [r["question"] for r in rows])
  gen, samples = lm_eval_result(lm_eval_dir, GEN_TASK)
  mc, _ = lm_eval_result(lm_eval_dir, MC_TASK)
  generations = [s["resps"][0][0] for s in samples]
  same = sum(visible(g) == o for g, o in zip(generations, outputs, strict=True)) if len(generations) == len(rows) else 0
  summary = {
    "questions": len(rows),
    "lm_eval_gen_exact_match": gen,
    "lm_eval_mc_acc": mc,
    "decode_exact_match": sum(o.strip() == r["answer"] for o, r in zip(outputs, rows, strict=True)) / len(rows),
    "identical_generations": same,
  }
  with open(os.path.join(eval_dir, "accuracy.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=1)
  return summary


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  p = commands.add_parser("prepare", help="write the task's data and tokenizer folder")
  p.add_argument("data_dir")
  p.add_argument("eval_dir")
  p.add_argument("--limit", type=int, default=None, help="only the first N held-out questions")
  p.add_argument("--tokenizer_path", default="~/maxtext_data/demo/tokenizer.model")
  c = commands.add_parser("compare", help="print lm-eval's accuracies beside decode.py's exact match")
  c.add_argument("eval_dir")
  c.add_argument("decode_output")
  c.add_argument("lm_eval_dir")
  args = parser.parse_args(argv)
  if args.command == "prepare":
    for name in ("sft_train.jsonl", "sft_heldout.jsonl"):
      if not os.path.isfile(os.path.join(args.data_dir, name)):
        print(f"error: {args.data_dir} has no {name}; write it with MaxText/build_finetune_demo_data.py", file=sys.stderr)
        return 2
    rows = prepare(args.data_dir, args.eval_dir, args.tokenizer_path, args.limit)
    print(f"Wrote {args.eval_dir}: {len(rows)} held-out questions and hf_tokenizer/", flush=True)
    return 0
  s = compare(args.eval_dir, args.decode_output, args.lm_eval_dir)
  n = s["questions"]
  print(f"lm-eval {GEN_TASK:<22} exact match {s['lm_eval_gen_exact_match']:.4f} over {n} questions (local-chat-completions)")
  print(f"lm-eval {MC_TASK:<22} acc         {s['lm_eval_mc_acc']:.4f} over {n} questions (local-completions)")
  print(f"decode.py (greedy, as finetune_demo.sh) exact match {s['decode_exact_match']:.4f} over {n} questions")
  print(f"generations identical in lm-eval and decode.py: {s['identical_generations']}/{n}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
