#!/usr/bin/env bash
# The README quick start as a check: trains MaxText/configs/demo.yml on the demo corpus (built by setup.sh),
# then requires the final eval loss to be at least 40% below ln(vocab_size), plots the loss curves and
# samples from the trained model with decode.py.
#   bash end_to_end/quickstart_demo.sh [OUTPUT_DIR]       (about 8 minutes on 2 CPU cores)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/maxtext_quickstart}
rm -rf "$OUT"
start=$(date +%s)
python3 MaxText/train.py MaxText/configs/demo.yml run_name=demo base_output_directory="$OUT" \
  metrics_file="$OUT/metrics.jsonl"
echo "wall time: $(( $(date +%s) - start )) s"
python3 end_to_end/plot_metrics.py "$OUT/metrics.jsonl" "$OUT/loss.png" --title "demo.yml on the demo corpus"
python3 - "$OUT/metrics.jsonl" <<'PY'
import json, math, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if "eval/avg_loss" in r]
final, limit = evals[-1]["eval/avg_loss"], 0.6 * math.log(1024)
print(f"final eval loss {final:.4f} at step {evals[-1]['step']}; limit 0.6 * ln(1024) = {limit:.4f}")
sys.exit(0 if final <= limit else 1)
PY
# Sample from the trained model: the KV-cache decoder on the run's latest checkpoint.
python3 MaxText/decode.py MaxText/configs/demo.yml run_name=demo base_output_directory="$OUT" \
  prompt="And God said" decode_sampling_strategy=greedy
