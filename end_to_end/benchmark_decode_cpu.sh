#!/usr/bin/env bash
# The decoding issue's CPU benchmark: the core benchmark's tiny model (random weights: one training step
# from a random init), prompt padded to 64, 192 generated tokens, batch 1, greedy, one device.
#   bash end_to_end/benchmark_decode_cpu.sh [OUTPUT_DIR]      (about 1 minute on 2 CPU cores)
# Reference: maxtext 0.2.5 took about 28.5 ms per generated token (35 tokens/s) on this config here.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/maxtext_decode_bench}
rm -rf "$OUT"
MODEL="base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 base_num_decoder_layers=4
  head_dim=64 vocab_size=32000 scan_layers=true base_output_directory=$OUT log_config=false jax_cache_dir="
# shellcheck disable=SC2086
python3 MaxText/train.py MaxText/configs/base.yml run_name=random $MODEL steps=1 max_target_length=256 \
  per_device_batch_size=1 dataset_type=synthetic enable_tensorboard=false >/dev/null
DECODE="max_prefill_predict_length=64 max_target_length=256 per_device_batch_size=1 decode_sampling_strategy=greedy"
# shellcheck disable=SC2086
python3 MaxText/decode.py MaxText/configs/base.yml run_name=random $MODEL $DECODE \
  tokenizer_path="${TOKENIZER:-$HOME/maxtext_data/demo/tokenizer.model}" prompt="I love to"
# shellcheck disable=SC2086
python3 MaxText/inference_microbenchmark.py MaxText/configs/base.yml run_name=random $MODEL $DECODE \
  load_parameters_path="$OUT/random/checkpoints/1/items" inference_microbenchmark_prefill_lengths=64 \
  inference_microbenchmark_batch_sizes=1,4 inference_microbenchmark_log_file_path="$OUT/microbenchmark.json"
