#!/usr/bin/env bash
# Llama 2 7B on one node of 8 GPUs (e.g. H100 80GB): NVIDIA's MaxText llama2-7b command, key for key, on
# synthetic data. One process drives all 8 GPUs (ici_fsdp_parallelism=-1 fills them: FSDP over 8).
#   bash end_to_end/gpu/llama2_7b_1node.sh [key=value ...]     # other keys, e.g. profiler=xplane
#   STEPS=50 ATTENTION=cudnn_flash_jax bash end_to_end/gpu/llama2_7b_1node.sh   # cuDNN flash attention instead
# (train.py refuses a key given twice, so the keys set here are changed through these variables.)
# hardware=gpu makes train.py add NVIDIA's recommended XLA flags (MaxText/cli.py GPU_XLA_FLAGS) unless XLA_FLAGS
# sets them. Output goes to ./local_train/<run_name> (RUN_NAME, default llama2_7b_1node).
set -euo pipefail
cd "$(dirname "$0")/../.."
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
exec "${PYTHON:-python3}" MaxText/train.py MaxText/configs/base.yml \
  run_name="${RUN_NAME:-llama2_7b_1node}" hardware=gpu base_output_directory="$PWD/local_train" \
  model_name=llama2-7b per_device_batch_size=2 max_target_length=4096 steps="${STEPS:-30}" enable_checkpointing=false \
  remat_policy=minimal use_iota_embed=true logits_dot_in_fp32=false dataset_type=synthetic attention="${ATTENTION:-dot_product}" \
  "$@"
