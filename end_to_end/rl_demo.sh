#!/usr/bin/env bash
# Reinforcement learning with a verifiable reward, offline and from nothing: two-digit sums and differences
# ("12+35=" -> "47", "3-15=" -> "-12", MaxText/build_rl_demo_data.py), a 0.5M-parameter model warmed up by SFT until
# it gets some of the held-out problems right, then GRPO and GSPO with exact match as the reward, with held-out
# accuracy (greedy, exact match, problems no stage trained on) before and after.
#   bash end_to_end/rl_demo.sh [--quick] [--check] [OUTPUT_DIR]
# Needs no corpus and no download (the task writes its own character tokenizer). --quick: every stage for a few
# steps, to check that each still runs; its accuracies mean nothing. --check (CI runs the full demo with it): exit 1
# unless the start has not collapsed (at least MIN_START% held-out), GRPO raises it by GRPO_GAIN points and GSPO by
# GSPO_GAIN (GSPO learns more slowly here: the paper's clip range clips most of its second update; docs/guides/rl.md).
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
CHECK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; --check) CHECK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_rl_demo}
# The warm-up trains up to SFT_MAX steps of a SFT_SCHEDULE-step schedule, with a checkpoint and an evaluation every
# SFT_EVERY steps; RL starts from the first checkpoint whose held-out loss is at most START_LOSS: midway through
# learning the task (about 30% of the held-out problems right, greedy). Learning this task is a sudden
# transition whose timing moves by hundreds of steps with any change of the arithmetic (dtype, kernel, RoPE's
# formulation), so the start is chosen by how much the model has learned, not by a step count.
SFT_MAX=1000 SFT_SCHEDULE=2000 SFT_EVERY=50 START_LOSS=0.60 RL_STEPS=400 EVERY=50 MIN_START=15 GRPO_GAIN=10 GSPO_GAIN=3
if [ "$QUICK" = 1 ]; then SFT_MAX=10 SFT_EVERY=5 START_LOSS=100 RL_STEPS=2 EVERY=2; fi
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
DATA="$OUT/data"

echo "== the problems and the tokenizer"
python3 MaxText/build_rl_demo_data.py "$DATA"

# The model of every stage: 2 layers, width 128, over the task's 17-token tokenizer (vocab_size rounds it up), in
# float32: the sampler's and the trainer's log-probabilities then agree to 1e-5, so GSPO's clip range of 3e-4 acts on
# how the policy moved, not on bfloat16's rounding (and the data pipeline, not the dtype, sets the pace here).
MODEL=(dtype=float32 base_emb_dim=128 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=512
  base_num_decoder_layers=2 head_dim=32 vocab_size=32 tokenizer_path="$DATA/tokenizer.model" use_chat_template=false)
COMMON=(base_output_directory="$OUT/runs" dataset_type=hf hf_path=json eval_steps=-1)
latest() { ls "$1/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1; }

# accuracy STAGE CHECKPOINT: greedy answers of the parameters in CHECKPOINT (a checkpoint's items folder) to the
# held-out problems, scored by exact match, sums and differences apart.
accuracy() {
  local stage=$1 checkpoint=$2 began
  began=$(date +%s)
  echo "== accuracy: $stage (decode.py, greedy)"
  python3 MaxText/decode.py MaxText/configs/base.yml run_name=accuracy "${MODEL[@]}" base_output_directory="$OUT/runs" \
    load_parameters_path="$checkpoint" decode_prompts_file="$DATA/heldout_prompts.txt" per_device_batch_size=64 \
    max_prefill_predict_length=8 max_target_length=16 decode_sampling_strategy=greedy > "$OUT/$stage.decode.txt"
  python3 - "$OUT/$stage.decode.txt" "$DATA" "$stage" "$(($(date +%s) - began))" <<'PY' | tee -a "$OUT/accuracy.txt"
import re, sys
outputs = re.findall(r"^Input `.*` -> `(.*)`$", open(sys.argv[1], encoding="utf-8").read(), re.M)
answers = open(f"{sys.argv[2]}/heldout_answers.txt", encoding="utf-8").read().splitlines()
prompts = open(f"{sys.argv[2]}/heldout_prompts.txt", encoding="utf-8").read().splitlines()
assert len(outputs) == len(answers) == len(prompts), (len(outputs), len(answers), len(prompts))
right = [o.strip() == a for o, a in zip(outputs, answers)]
parts = [(name, [r for r, p in zip(right, prompts) if op in p]) for name, op in (("sums", "+"), ("differences", "-"))]
print(f"{sys.argv[3]:<12} exact match {sum(right)}/{len(right)} = {100 * sum(right) / len(right):.1f}% ("
      + ", ".join(f"{name} {sum(r)}/{len(r)}" for name, r in parts) + f"; decode {sys.argv[4]} s)")
PY
}

echo "== SFT warm-up (up to $SFT_MAX steps, until the held-out loss is at most $START_LOSS)"
python3 MaxText/train.py MaxText/configs/sft.yml run_name=sft "${MODEL[@]}" "${COMMON[@]}" \
  train_data_columns="['prompt','completion']" eval_data_columns="['prompt','completion']" \
  hf_train_files="$DATA/sft_train.jsonl" hf_eval_files="$DATA/sft_heldout.jsonl" max_target_length=64 \
  per_device_batch_size=16 steps="$SFT_MAX" learning_rate_schedule_steps="$SFT_SCHEDULE" learning_rate=3e-3 \
  eval_interval="$SFT_EVERY" checkpoint_period="$SFT_EVERY" log_period=50 metrics_file= | tee "$OUT/sft.log" \
  | grep -E "^eval|^Done"
# "eval after step S" evaluates the parameters of checkpoint S + 1.
STEP=$(python3 - "$OUT/sft.log" "$START_LOSS" <<'PY'
import re, sys
evals = [(int(s) + 1, float(loss)) for s, loss in re.findall(r"^eval after step (\d+): loss ([0-9.]+)", open(sys.argv[1]).read(), re.M)]
reached = [step for step, loss in evals if loss <= float(sys.argv[2])]
if not reached:
  sys.exit(f"error: the warm-up's held-out loss never reached {sys.argv[2]} (last {evals[-1][1]:.4f} after {evals[-1][0]} steps)")
print(reached[0])
PY
)
echo "start: the warm-up's checkpoint $STEP (the first with a held-out loss at most $START_LOSS)" | tee "$OUT/start.txt"
START="$OUT/runs/sft/checkpoints/$STEP/items"
accuracy "start" "$START"

# RL from the warm-up, exact match against each problem's answer as the reward: 16 prompts x 8 completions a step (a
# prompt is at most 7 tokens with BOS, an answer at most 4 and EOS; an update averages twice the groups of 8 prompts,
# which from this start gained 7.5 points in 400 steps: docs/guides/rl.md), train.py's own greedy evaluation of the held-out
# problems every EVERY steps (the accuracy curve), then decode.py's. GRPO takes one update per batch of rollouts;
# GSPO (its sequence-level ratio, the paper's clip range 3e-4 / 4e-4) two, so that its ratio and clip act.
rl() {
  local name=$1; shift
  echo "== RL: $name ($RL_STEPS steps)"
  python3 MaxText/train.py MaxText/configs/rl.yml run_name="$name" load_parameters_path="$START" "${MODEL[@]}" \
    "${COMMON[@]}" hf_train_files="$DATA/rl_train.jsonl" hf_eval_files="$DATA/rl_heldout.jsonl" \
    reward_functions="['exact_match']" num_generations=8 per_device_batch_size=128 max_prefill_predict_length=8 \
    max_target_length=16 steps="$RL_STEPS" learning_rate=3e-4 eval_interval="$EVERY" checkpoint_period=1000 \
    log_period=10 metrics_file="$OUT/$name.jsonl" "$@" \
    | tee "$OUT/$name.log" | grep -E "^eval|^Done"
  python3 - "$OUT/$name.log" "$name" "$OUT/$name.jsonl" >> "$OUT/curve.txt" <<'PY'
import json, re, statistics, sys
# "eval before training" is after 0 steps; "eval after step S" (S counts from 0) after S + 1.
evals = re.findall(r"^eval (?:before training|after step (\d+)): reward ([0-9.]+)", open(sys.argv[1]).read(), re.M)
print(f"{sys.argv[2]:<6}" + "  ".join(f"{int(s) + 1 if s else 0}: {100 * float(r):.1f}%" for s, r in evals))
logged = [m for m in map(json.loads, open(sys.argv[3])) if "rl/rollout_seconds" in m and m["step"] > 0]
if logged:  # per logged step after the first (which compiles): medians
  med = {k: statistics.median(m[k] for m in logged) for k in
         ("rl/rollout_seconds", "rl/train_seconds_per_update", "rl/rollout_tokens_per_sec", "rl/completion_length_mean")}
  print(f"{'':<6}per step (median of {len(logged)} logged): rollout {1000 * med['rl/rollout_seconds']:.1f} ms "
        f"({med['rl/rollout_tokens_per_sec']:.0f} completion tokens/s, {med['rl/completion_length_mean']:.1f} tokens "
        f"each), update {1000 * med['rl/train_seconds_per_update']:.1f} ms")
PY
  accuracy "$name" "$OUT/runs/$name/checkpoints/$(latest "$OUT/runs/$name")/items"
}
rl grpo loss_algo=grpo
rl gspo loss_algo=gspo-token num_iterations=2 grpo_epsilon=3e-4 epsilon_high=4e-4
# ---- end of RL ----

echo "wall time: $(($(date +%s) - start)) s"
cat "$OUT/accuracy.txt"
echo "accuracy curves (train.py's greedy evaluation, exact match after N steps):"
cat "$OUT/curve.txt"
if [ "$CHECK" = 1 ]; then  # a demo that stops learning fails here, not only in a reader's eyes
  python3 - "$OUT/accuracy.txt" "$MIN_START" "$GRPO_GAIN" "$GSPO_GAIN" <<'PY'
import re, sys
accuracy = {name: float(pct) for name, pct in re.findall(r"^(\w+) +exact match \d+/\d+ = ([0-9.]+)%", open(sys.argv[1]).read(), re.M)}
start, least = accuracy["start"], float(sys.argv[2])
gains = {"grpo": float(sys.argv[3]), "gspo": float(sys.argv[4])}
failed = [f"the start has collapsed ({start:.1f}% < {least:.0f}%)"] if start < least else []
failed += [f"{name} gained {accuracy[name] - start:+.1f} points (< {gain:.0f})" for name, gain in gains.items() if accuracy[name] - start < gain]
if failed:
  sys.exit("error: the RL demo stopped learning: " + "; ".join(failed))
print(f"check: start {start:.1f}% >= {least:.0f}%; " + ", ".join(f"{name.upper()} {accuracy[name] - start:+.1f} points (>= {gain:.0f})" for name, gain in gains.items()))
PY
fi
