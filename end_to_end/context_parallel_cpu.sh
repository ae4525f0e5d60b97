#!/usr/bin/env bash
# Context parallelism on the CPU (issue 18): a 131072-token sequence split over 8 simulated devices.
#   bash end_to_end/context_parallel_cpu.sh [--quick] [OUTPUT_DIR]        (about 15 minutes on 2 CPU cores)
# Model: emb 64, 2 heads of 16, 1 layer, vocab 512, one row of 131072 tokens per step, attention=flash (blockwise).
# 1. Memory per device of the compiled step (train_compile.py on this host, nothing run): the whole sequence on one
#    device, and split over ici_context_parallelism=8 with each strategy.
# 2. Both strategies train 2 steps at 131072 tokens on 8 devices: losses (equal), step times, the process's peak RSS.
# --quick (CI, about 20 s): the same at 4096 tokens, checking that every part still runs; its figures mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_context_parallel}
LENGTH=131072
if [ "$QUICK" = 1 ]; then LENGTH=4096; fi
rm -rf "$OUT" && mkdir -p "$OUT"
MODEL="base_emb_dim=64 base_num_query_heads=2 base_num_kv_heads=2 base_mlp_dim=256 base_num_decoder_layers=1
  head_dim=16 vocab_size=512 dataset_type=synthetic jax_cache_dir= attention=flash max_target_length=$LENGTH"
TRAIN="enable_checkpointing=false enable_tensorboard=false log_config=false base_output_directory=$OUT"
CP="per_device_batch_size=0.125 ici_fsdp_parallelism=1 ici_context_parallelism=8"

memory() { grep -E '^  (arguments|temporaries|total|peak) ' "$1" | tr -s ' ' | tr '\n' ';'; }

echo "== 1. memory per device at $LENGTH tokens (compiled, not run)"
# shellcheck disable=SC2086
XLA_FLAGS=--xla_force_host_platform_device_count=1 python3 MaxText/train_compile.py MaxText/configs/base.yml \
  $MODEL per_device_batch_size=1 >"$OUT/compile_one.log" 2>&1
echo "1 device, whole sequence: $(memory "$OUT/compile_one.log")"
for strategy in all_gather ring; do
  # shellcheck disable=SC2086
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python3 MaxText/train_compile.py MaxText/configs/base.yml \
    $MODEL $CP context_parallel_strategy=$strategy >"$OUT/compile_$strategy.log" 2>&1
  echo "8 devices, context=8 $strategy: $(memory "$OUT/compile_$strategy.log")"
done

echo "== 2. 2 training steps at $LENGTH tokens, context=8"
for strategy in all_gather ring; do
  # shellcheck disable=SC2086
  XLA_FLAGS=--xla_force_host_platform_device_count=8 /usr/bin/time -v python3 MaxText/train.py \
    MaxText/configs/base.yml run_name=cp_$strategy $MODEL $TRAIN $CP steps=2 context_parallel_strategy=$strategy \
    metrics_file="$OUT/metrics_$strategy.jsonl" >"$OUT/train_$strategy.log" 2>&1
  grep -E "completed step|^Done|Maximum resident set size" "$OUT/train_$strategy.log" | sed "s/^/$strategy: /"
done
