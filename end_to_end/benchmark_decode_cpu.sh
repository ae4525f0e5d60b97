#!/usr/bin/env bash
# The decoding issue's CPU benchmark: the core benchmark's tiny model (random weights: one training step
# from a random init), prompt padded to 64, 192 generated tokens, batch 1, greedy, one device.
#   bash end_to_end/benchmark_decode_cpu.sh [--quick] [OUTPUT_DIR]      (about 1 minute on 2 CPU cores)
# Reference: maxtext 0.2.5 took about 28.5 ms per generated token (35 tokens/s) on this config here.
# --quick (CI, about 15 s): 32 generated tokens and batch 1 only, checking that every part still runs.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_decode_bench}
LENGTH=256 BATCHES=1,4
if [ "$QUICK" = 1 ]; then LENGTH=96 BATCHES=1; fi
rm -rf "$OUT"
MODEL="base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 base_num_decoder_layers=4
  head_dim=64 vocab_size=32000 scan_layers=true base_output_directory=$OUT log_config=false jax_cache_dir="
echo "== a random model: one training step from a random init"
# shellcheck disable=SC2086
python3 MaxText/train.py MaxText/configs/base.yml run_name=random $MODEL steps=1 max_target_length=$LENGTH \
  per_device_batch_size=1 dataset_type=synthetic enable_tensorboard=false >/dev/null
DECODE="max_prefill_predict_length=64 max_target_length=$LENGTH per_device_batch_size=1 decode_sampling_strategy=greedy"
# shellcheck disable=SC2086
python3 MaxText/decode.py MaxText/configs/base.yml run_name=random $MODEL $DECODE \
  tokenizer_path="${TOKENIZER:-$HOME/maxtext_data/demo/tokenizer.model}" prompt="I love to"
# shellcheck disable=SC2086
python3 MaxText/inference_microbenchmark.py MaxText/configs/base.yml run_name=random $MODEL $DECODE \
  load_parameters_path="$OUT/random/checkpoints/1/items" inference_microbenchmark_prefill_lengths=64 \
  inference_microbenchmark_batch_sizes=$BATCHES inference_microbenchmark_log_file_path="$OUT/microbenchmark.json"
