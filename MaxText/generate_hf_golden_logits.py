"""Writes golden logits of a Hugging Face model for MaxText/tests/forward_pass_logit_checker.py:

    python3 MaxText/generate_hf_golden_logits.py --hf_model_path=DIR --output_path=FILE \
      [--prompts "I love to" "Today is a"] [--token_ids "1,2,3" "4,5" ...]

Loads DIR with transformers (AutoModelForCausalLM) in float32 on the CPU and runs each prompt as one unpadded
row; writes one JSON line per prompt: {"prompt": str, "tokens": [int], "logits": [[float]]}, logits
[len(tokens), vocab]. --prompts are tokenized with DIR's tokenizer (AutoTokenizer, special tokens such as BOS
included); --token_ids lists are used as they are (random test models have no tokenizer), with prompt "".
A user mistake (no such folder, no tokenizer, token out of range) is one line and exit code 2.
"""

import argparse
import json
import os
import sys


def token_lists(text: str) -> list[int]:
  try:
    return [int(t) for t in text.split(",")]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids, e.g. 1,2,3") from None


def parse_args(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hf_model_path", required=True, help="Hugging Face model folder (config.json + weights)")
  parser.add_argument("--output_path", required=True, help="JSON-lines file to write")
  inputs = parser.add_mutually_exclusive_group(required=True)
  inputs.add_argument("--prompts", nargs="+", help="texts, tokenized with the folder's tokenizer")
  inputs.add_argument("--token_ids", nargs="+", type=token_lists, help="comma-separated token ids, one list a prompt")
  return parser.parse_args(argv)


def golden_rows(args) -> list[dict]:
  """One {"prompt", "tokens", "logits"} per prompt; raises ValueError for a user mistake."""
  if not os.path.isfile(os.path.join(args.hf_model_path, "config.json")):
    raise ValueError(f"--hf_model_path={args.hf_model_path} has no config.json; give a Hugging Face model folder")
  try:
    import torch
    import transformers
  except ImportError as e:  # The reference's packages come with the test stack, not the runtime.
    raise ValueError(
      f"{e.name} is not installed (it comes with the test stack); run: bash setup.sh --dev (PyTorch: on Python 3.11)"
    ) from None

  if args.prompts:
    try:
      tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf_model_path)
    except (OSError, ValueError) as e:
      raise ValueError(f"--hf_model_path={args.hf_model_path} has no usable tokenizer ({e}); pass --token_ids") from None
    inputs = [(p, tokenizer(p)["input_ids"]) for p in args.prompts]
  else:
    inputs = [("", ids) for ids in args.token_ids]
  model = transformers.AutoModelForCausalLM.from_pretrained(args.hf_model_path).float().eval()
  vocab = model.get_input_embeddings().num_embeddings
  rows = []
  for prompt, ids in inputs:
    if not ids or min(ids) < 0 or max(ids) >= vocab:
      raise ValueError(f"prompt {prompt!r}: token ids {ids} must be non-empty and in [0, {vocab})")
    with torch.no_grad():
      logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    rows.append({"prompt": prompt, "tokens": list(ids), "logits": logits.tolist()})
  return rows


def main(argv) -> int:
  args = parse_args(argv[1:])
  try:
    rows = golden_rows(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 2
  os.makedirs(os.path.dirname(os.path.abspath(args.output_path)), exist_ok=True)
  with open(args.output_path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  print(f"Wrote the logits of {len(rows)} prompts to {args.output_path}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
