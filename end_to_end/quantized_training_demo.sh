#!/usr/bin/env bash
# Quantized training on the demo corpus (MaxText/configs/demo.yml, built by setup.sh): the same model, data and steps in
# bfloat16 (dtype=bfloat16, as a real run) without quantization, and with quantization=int8, fp8 and fp8_full (their
# default quantization_targets: attention, mlp, moe), then each one's eval loss and its difference from bfloat16's.
# The margin is measured in the same script: a second unquantized run with another init_weights_seed gives the
# spread that the seed alone makes; a quantization passes when its loss is within MARGIN_FACTOR (2) times that
# spread, and never less than MARGIN_FLOOR (0.01 nats), of bfloat16's. It exits 1 when one is not.
#   bash end_to_end/quantized_training_demo.sh [--quick] [OUTPUT_DIR]
# 200 steps and 16 eval batches per run: 7 min 12 s on 2 CPU cores (2026-11-27, load average 1.8 from other work).
# --quick (CI, about 3 min): 40 steps and 4 eval batches per run, far enough into training (the loss falls from 7.4 to
# 4.90; the two seeds end 0.033 apart, 2026-11-28) that a quantized matmul that trains worse than bfloat16 shows
# past the margin.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_quantized_training}
STEPS=200 EVAL_STEPS=16
if [ "$QUICK" = 1 ]; then
  STEPS=40 EVAL_STEPS=4
fi
rm -rf "$OUT"
mkdir -p "$OUT"
start=$(date +%s)
# name quantization init_weights_seed
RUNS=("bf16 '' 0" "bf16_seed1 '' 1" "int8 int8 0" "fp8 fp8 0" "fp8_full fp8_full 0")
for run in "${RUNS[@]}"; do
  eval "set -- $run"
  echo "== $1 (quantization=${2:-none}, init_weights_seed=$3)"
  python3 MaxText/train.py MaxText/configs/demo.yml run_name="$1" base_output_directory="$OUT" dtype=bfloat16 \
    quantization="$2" init_weights_seed="$3" steps="$STEPS" eval_interval="$STEPS" eval_steps="$EVAL_STEPS" \
    log_period="$STEPS" enable_checkpointing=false metrics_file="$OUT/$1.jsonl" > "$OUT/$1.log" 2>&1 \
    || { tail -20 "$OUT/$1.log"; exit 1; }
done
echo "wall time: $(( $(date +%s) - start )) s for 5 runs of $STEPS steps"
python3 - "$OUT" <<'PY'
import json, math, os, sys

MARGIN_FACTOR, MARGIN_FLOOR = 2.0, 0.01


def eval_loss(name):
  with open(os.path.join(sys.argv[1], f"{name}.jsonl")) as f:
    return [r for r in map(json.loads, f) if "eval/avg_loss" in r][-1]["eval/avg_loss"]


losses = {name: eval_loss(name) for name in ("bf16", "bf16_seed1", "int8", "fp8", "fp8_full")}
for name, loss in losses.items():
  print(f"eval loss {name}: {loss:.6f}")
spread = abs(losses["bf16_seed1"] - losses["bf16"])
margin = max(MARGIN_FACTOR * spread, MARGIN_FLOOR)
print(f"seed spread (bf16 seed 1 - seed 0): {spread:.6f}; margin max({MARGIN_FACTOR} x spread, {MARGIN_FLOOR}) = {margin:.6f}")
failed = []
for name in ("int8", "fp8", "fp8_full"):
  difference = losses[name] - losses["bf16"]
  ok = math.isfinite(difference) and abs(difference) <= margin
  print(f"difference {name} - bf16: {difference:+.6f} ({'within' if ok else 'BEYOND'} the margin {margin:.6f})")
  failed += [] if ok else [name]
sys.exit(1 if failed else 0)
PY
