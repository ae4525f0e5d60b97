#!/usr/bin/env bash
# Long context on the CPU (issue 14): a tiny model (emb 256, 4 heads, 2 layers, vocab 32000), batch 1, one device.
#   bash end_to_end/long_context_cpu.sh [--quick] [OUTPUT_DIR]        (about 6 minutes on 2 CPU cores)
# 1. What 32768 tokens need per step, from the compiled step's memory analysis (train_compile.py on this host,
#    nothing run): attention=dot_product's [length, length] scores vs blockwise attention=flash, with and
#    without num_vocab_tiling.
# 2. attention=flash trains 2 steps at 32768 tokens; its peak RSS (/usr/bin/time) is reported.
# 3. At 4096 tokens in float32 both kernels train 4 steps: the same losses, and the step-time ratio.
# --quick (CI, about 25 s): the same three parts at 2048 tokens (1, 2) and 256 tokens (3), vocab 4096: checks that
# every part still runs and that its summary parses; its figures mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_long_context}
LONG=32768 SHORT=4096 VOCAB=32000
if [ "$QUICK" = 1 ]; then LONG=2048 SHORT=256 VOCAB=4096; fi
rm -rf "$OUT" && mkdir -p "$OUT"
MODEL="base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 base_num_decoder_layers=2
  head_dim=64 vocab_size=$VOCAB per_device_batch_size=1 dataset_type=synthetic jax_cache_dir="
TRAIN="enable_checkpointing=false enable_tensorboard=false log_config=false base_output_directory=$OUT"

echo "== 1. memory per step at $LONG tokens (compiled, not run)"
for kernel in "attention=dot_product num_vocab_tiling=16" "attention=flash num_vocab_tiling=1" \
  "attention=flash num_vocab_tiling=16"; do
  # shellcheck disable=SC2086
  python3 MaxText/train_compile.py MaxText/configs/base.yml $MODEL max_target_length=$LONG $kernel \
    >"$OUT/compile.log" 2>&1 || true # Exit 1 ("does not fit") is a result here.
  echo "$kernel: $(grep -E '^  (temporaries|total)' "$OUT/compile.log" | tr -s ' ' | tr '\n' ';')"
done

echo "== 2. attention=flash num_vocab_tiling=16 trains at $LONG tokens"
# shellcheck disable=SC2086
/usr/bin/time -v python3 MaxText/train.py MaxText/configs/base.yml run_name=flash_long $MODEL $TRAIN \
  max_target_length=$LONG steps=2 attention=flash num_vocab_tiling=16 >"$OUT/flash_long.log" 2>&1
grep -E "completed step|^Done|Maximum resident set size" "$OUT/flash_long.log"

echo "== 3. $SHORT tokens, float32: flash vs dot_product"
for kernel in flash dot_product; do
  # shellcheck disable=SC2086
  python3 MaxText/train.py MaxText/configs/base.yml run_name="$kernel"_short $MODEL $TRAIN max_target_length=$SHORT \
    steps=4 dtype=float32 attention=$kernel metrics_file="$OUT/$kernel.jsonl" >"$OUT/${kernel}_short.log" 2>&1
  grep -E "^Done" "$OUT/${kernel}_short.log" | sed "s/^/$kernel: /"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
def steps(path):  # The step records only: the file also holds the eval and goodput records.
  records = [json.loads(line) for line in open(path)]
  return [r for r in records if "learning/loss" in r]
rows = {k: steps(f"{sys.argv[1]}/{k}.jsonl") for k in ("flash", "dot_product")}
flash, dot = ([r["learning/loss"] for r in rows[k]] for k in ("flash", "dot_product"))
print("losses flash      :", " ".join(f"{x:.6f}" for x in flash))
print("losses dot_product:", " ".join(f"{x:.6f}" for x in dot))
print(f"largest relative difference: {max(abs(a - b) / abs(b) for a, b in zip(flash, dot, strict=True)):.2e}")
times = {k: statistics.median(r["perf/step_time_seconds"] for r in rows[k][1:]) for k in rows}
print(f"median step time (steps 1-3): flash {times['flash']:.2f} s, dot_product {times['dot_product']:.2f} s, "
      f"ratio dot_product / flash {times['dot_product'] / times['flash']:.2f}")
PY
