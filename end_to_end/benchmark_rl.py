"""RL benchmark: per step, the rollouts (the engine) against the policy updates (the train step), through train.py.

    python3 end_to_end/benchmark_rl.py [--quick] [--out DIR] [--steps N] [--prompts P] [--generations G]

The serving benchmark's model and settings (end_to_end/benchmark_serving.py): the demo model (configs/demo.yml's
shape) from a random init, float32, prompts up to 128 tokens and 256 in all (so completions up to 128), the engine's
16-token pages and decode_steps_per_dispatch=16, on one device. Its own offline data: the demo tokenizer when
`bash setup.sh` built it (else a byte-level BPE trained here), prompts of random token ids (8 to 96) decoded to text,
and a reward that needs no answer (shorter completions score higher, written to OUT/bench_rl_rewards.py).

Each step of configs/rl.yml (GRPO, grpo_beta 0.04: the step also runs the reference model) samples G completions of
P prompts (default 16 x 4 = 64 rows, all decoded at once: the engine has a slot per row), temperature 1, up to EOS
or 128 tokens, then takes num_iterations policy updates on them. Two runs: num_iterations=1, then 2 (one rollout
per two updates: its cost amortised). From train.py's metrics_file (log_period=1, so every step is timed alone and
ends synchronised with the device), for each step after the first (which compiles) and, with num_iterations=2,
each batch of rollouts after the first:
  rollout seconds     rl/rollout_seconds: generating the batch's completions (the engine)
  update seconds      (the steps' perf/step_time_seconds - rollout seconds - rl/reward_seconds) / num_iterations
  rollout share       rollout seconds / the steps' time
  rollout tokens/s    rl/rollout_tokens_per_sec: completion tokens (EOS included) / rollout seconds
  update tokens/s     rows x max_target_length (the positions each update computes, padding included) / update s
(log_period=1: each step timed alone, so a batch's rollout and updates are told apart; train.py's own
rl/train_seconds_per_update, the lap's time less its rollouts per step, averages to the update seconds over a batch.)
Then a plain pretraining step of the same model and rows (configs/base.yml, synthetic data): an update's cost
without RL. Results also go to OUT/rl.json. --quick (CI, about 15 s): 4 prompts x 2, 32 tokens in all, 2 and 4
steps, and 2 plain steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_TOKENIZER = os.path.expanduser("~/maxtext_data/demo/tokenizer.model")
# The demo model's shape: the keys of configs/demo.yml that define it.
MODEL_KEYS = ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim", "base_num_decoder_layers",
              "head_dim", "vocab_size")  # fmt: skip
REWARDS = '''"""benchmark_rl.py's reward: it needs no answer, and gives even a random model's completions a signal."""


def shorter(prompts, completions, **columns):
  return [1.0 / (1 + len(c)) for c in completions]
'''


def tokenizer(out: str) -> tuple[str, str]:
  """(tokenizer_path, tokenizer_type): the demo tokenizer, or a byte-level BPE with EOS <|im_end|> trained here."""
  if os.path.isfile(DEMO_TOKENIZER):
    return DEMO_TOKENIZER, "sentencepiece"
  import tokenizers  # noqa: PLC0415 (only without the demo tokenizer)
  from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

  folder = os.path.join(out, "hf")
  os.makedirs(folder, exist_ok=True)
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=1024,
    special_tokens=["<|endoftext|>", "<|im_end|>", "<s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  hf.train_from_iterator([" ".join(f"{a}+{b}={a + b}" for a in range(40) for b in range(40))] * 3, trainer)
  hf.save(os.path.join(folder, "tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}
  with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({**settings, "pad_token": "<|endoftext|>"}, f)
  return os.path.join(folder, "tokenizer.json"), "huggingface"


def prompts(out: str, path: str, kind: str, n: int, lengths: tuple[int, int]) -> str:
  """n json lines {"prompt"} of random token ids (`lengths`: the fewest and most) decoded to text; their file."""
  sys.path.insert(0, REPO)
  from MaxText.input_pipeline import tokenizer as tokenizer_lib  # noqa: PLC0415 (the repository is on the path now)

  tok = tokenizer_lib.load(path, kind)
  rng = np.random.default_rng(0)
  file = os.path.join(out, "prompts.jsonl")
  with open(file, "w", encoding="utf-8") as f:
    for _ in range(n):
      ids = rng.integers(3, tok.vocab_size, int(rng.integers(lengths[0], lengths[1] + 1))).tolist()
      f.write(json.dumps({"prompt": " ".join(tok.decode(ids).split()) or "x"}) + "\n")
  return file


def train(out: str, name: str, keys: list[str]) -> list[dict]:
  """train.py with `keys` (the config file first): the records of its metrics_file, one per step."""
  metrics = os.path.join(out, f"{name}.jsonl")
  if os.path.exists(metrics):
    os.remove(metrics)
  args = [sys.executable, "MaxText/train.py", *keys, f"run_name={name}", f"base_output_directory={out}",
          f"metrics_file={metrics}", "log_period=1", "eval_interval=-1", "enable_checkpointing=false",
          "enable_tensorboard=false", "log_config=false"]  # fmt: skip
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [out, os.environ.get("PYTHONPATH")]))}
  result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, check=False)
  with open(os.path.join(out, f"{name}.log"), "w", encoding="utf-8") as f:
    f.write(result.stdout + result.stderr)
  if result.returncode != 0:
    sys.exit(f"error: train.py failed ({name}):\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
  with open(metrics, encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return sorted((r for r in records if "perf/step_time_seconds" in r), key=lambda r: r["step"])


def batches(records: list[dict], iterations: int, rows: int, length: int) -> list[dict]:
  """Each batch of rollouts after the first: its rollout, its updates and their shares (see the docstring)."""
  out = []
  for first in range(iterations, len(records) - iterations + 1, iterations):
    steps = records[first : first + iterations]
    seconds = sum(r["perf/step_time_seconds"] for r in steps)
    rollout, scoring = steps[0]["rl/rollout_seconds"], steps[0]["rl/reward_seconds"]
    update = (seconds - rollout - scoring) / iterations
    out.append({"step": steps[0]["step"], "steps_seconds": seconds, "rollout_seconds": rollout, "reward_seconds": scoring,
                "update_seconds": update, "rollout_share": rollout / seconds,
                "rollout_tokens_per_s": steps[0]["rl/rollout_tokens_per_sec"],
                "completion_length_mean": steps[0]["rl/completion_length_mean"],
                "reward_mean": steps[0]["rl/reward_mean"], "update_tokens_per_s": rows * length / update,
                "reported_train_seconds_per_update": [r["rl/train_seconds_per_update"] for r in steps]})  # fmt: skip
  return out


def show(name: str, rows: list[dict]) -> dict:
  """Prints a run's batches and their medians; the medians."""
  for b in rows:
    print(
      f"{name} step {b['step']:>2}: rollout {b['rollout_seconds']:6.2f} s ({b['rollout_tokens_per_s']:7.1f} tokens/s, "
      f"mean length {b['completion_length_mean']:5.1f}), update {b['update_seconds']:6.2f} s "
      f"({b['update_tokens_per_s']:7.1f} tokens/s), rollout share {100 * b['rollout_share']:4.1f}%",
      flush=True,
    )
  keys = (
    "steps_seconds",
    "rollout_seconds",
    "update_seconds",
    "rollout_share",
    "rollout_tokens_per_s",
    "update_tokens_per_s",
  )
  median = {k: statistics.median(b[k] for b in rows) for k in keys}
  print(
    f"{name} median: rollout {median['rollout_seconds']:.2f} s ({median['rollout_tokens_per_s']:.1f} tokens/s), "
    f"update {median['update_seconds']:.2f} s ({median['update_tokens_per_s']:.1f} tokens/s), rollout share "
    f"{100 * median['rollout_share']:.1f}%, {median['steps_seconds']:.2f} s per batch of rollouts",
    flush=True,
  )
  return median


def plain_step(out: str, shape: list[str], steps: int, tokens: int) -> dict:
  """A pretraining step of the same model and batch shape (synthetic data): what an update costs without RL."""
  print("== plain: a pretraining step of the same rows (configs/base.yml, synthetic data)", flush=True)
  records = train(out, "plain", ["MaxText/configs/base.yml", *shape, "dataset_type=synthetic", f"steps={steps}"])
  seconds = statistics.median(r["perf/step_time_seconds"] for r in records[1:])
  print(f"plain step: {seconds:.2f} s ({tokens / seconds:.1f} tokens/s)", flush=True)
  return {"steps": steps, "step_seconds": seconds, "tokens_per_s": tokens / seconds}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default="/tmp/maxtext_rl_bench")
  parser.add_argument(
    "--steps", type=int, default=6, help="steps of the num_iterations=1 run (the other runs twice as many)"
  )
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--generations", type=int, default=4)
  args = parser.parse_args()
  steps, prompt_count, generations = args.steps, args.prompts, args.generations
  longest_prompt, length, lengths = 128, 256, (8, 96)  # the serving benchmark's
  if args.quick:
    steps, prompt_count, generations, longest_prompt, length, lengths = 2, 4, 2, 16, 32, (2, 8)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "bench_rl_rewards.py"), "w", encoding="utf-8") as f:
    f.write(REWARDS)
  path, kind = tokenizer(args.out)
  file = prompts(args.out, path, kind, prompt_count * steps * 2 + 64, lengths)
  with open(os.path.join(REPO, "MaxText/configs/demo.yml"), encoding="utf-8") as f:
    demo = yaml.safe_load(f)
  rows = prompt_count * generations
  # The model and the batch's shape, shared with the plain step; then the rollouts' data and engine.
  shape = [*(f"{k}={demo[k]}" for k in MODEL_KEYS), "dtype=float32", f"max_target_length={length}",
           f"per_device_batch_size={rows}"]  # fmt: skip
  data = [*shape, f"tokenizer_path={path}", f"tokenizer_type={kind}", "hf_path=json", f"hf_train_files={file}",
          "use_chat_template=false", f"max_prefill_predict_length={longest_prompt}", "pagedattn_tokens_per_page=16",
          "decode_steps_per_dispatch=16", f"num_generations={generations}",
          "reward_functions=['bench_rl_rewards:shorter']"]  # fmt: skip
  report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_average_before": os.getloadavg(), "prompts": prompt_count,
            "generations": generations, "max_target_length": length, "tokenizer": path, "runs": {}}  # fmt: skip
  for iterations, count in ((1, steps), (2, 2 * steps)):
    name = f"rl_iterations_{iterations}"
    print(f"== {name}: num_iterations={iterations}, {count} steps", flush=True)
    records = train(args.out, name, ["MaxText/configs/rl.yml", *data, f"steps={count}", f"num_iterations={iterations}"])
    measured = batches(records, iterations, rows, length)
    report["runs"][name] = {
      "num_iterations": iterations,
      "steps": count,
      "batches": measured,
      "median": show(name, measured),
    }
  one, two = (report["runs"][f"rl_iterations_{i}"]["median"] for i in (1, 2))
  print(
    f"num_iterations=2: {two['steps_seconds'] / 2:.2f} s per update against {one['steps_seconds']:.2f} s "
    f"({one['steps_seconds'] * 2 / two['steps_seconds']:.2f}x the updates per second), rollout share "
    f"{100 * two['rollout_share']:.1f}% against {100 * one['rollout_share']:.1f}%"
  )
  report["plain"] = plain_step(args.out, shape, steps, rows * length)
  print(f"the RL update takes {one['update_seconds'] / report['plain']['step_seconds']:.2f}x a plain step's time")
  report["load_average_after"] = os.getloadavg()
  with open(os.path.join(args.out, "rl.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
