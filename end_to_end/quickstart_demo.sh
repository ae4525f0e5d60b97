#!/usr/bin/env bash
# The README quick start as a check: trains MaxText/configs/demo.yml on the demo corpus (built by setup.sh),
# then requires the final eval loss to be at least 40% below ln(vocab_size), plots the loss curves and
# samples from the trained model with decode.py (greedy).
#   bash end_to_end/quickstart_demo.sh [--quick] [OUTPUT_DIR]       (4 to 7 minutes on 2 CPU cores)
# --quick (CI, about 15 s): 20 steps and an evaluation over 8 batches; the eval loss must be below 90% of
# ln(vocab_size) (a model that learnt something), not 60%.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_quickstart}
SHORT=() LIMIT=0.6
if [ "$QUICK" = 1 ]; then
  SHORT=(steps=20 log_period=5 eval_interval=20 eval_steps=8 checkpoint_period=20) LIMIT=0.9
fi
rm -rf "$OUT"
start=$(date +%s)
echo "== 1. train (MaxText/configs/demo.yml)"
python3 MaxText/train.py MaxText/configs/demo.yml run_name=demo base_output_directory="$OUT" \
  metrics_file="$OUT/metrics.jsonl" ${SHORT[@]+"${SHORT[@]}"}
echo "wall time: $(( $(date +%s) - start )) s"
echo "== 2. plot the loss curves"
python3 end_to_end/plot_metrics.py "$OUT/metrics.jsonl" "$OUT/loss.png" --title "demo.yml on the demo corpus"
python3 - "$OUT/metrics.jsonl" "$LIMIT" <<'PY'
import json, math, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "eval/avg_loss" in r]
fraction = float(sys.argv[2])
final, limit = evals[-1]["eval/avg_loss"], fraction * math.log(1024)
print(f"final eval loss {final:.4f} at step {evals[-1]['step']}; limit {fraction} * ln(1024) = {limit:.4f}")
sys.exit(0 if final <= limit else 1)
PY
echo "== 3. sample from the trained model: the KV-cache decoder on the run's latest checkpoint"
python3 MaxText/decode.py MaxText/configs/demo.yml run_name=demo base_output_directory="$OUT" \
  prompt="And God said" per_device_batch_size=1 decode_sampling_strategy=greedy
