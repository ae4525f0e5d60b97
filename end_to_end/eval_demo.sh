#!/usr/bin/env bash
# Evaluation with lm-evaluation-harness, offline: MaxText/serve.py serves a checkpoint on loopback and lm-eval's own
# API models score it on the fine-tuning demo's held-out questions (end_to_end/lm_eval_tasks/): finetune_heldout_gen
# (generate-until, exact match: the fine-tuning demo's score) through local-chat-completions, and
# finetune_heldout_mc (multiple choice by log-likelihood among every answer of the question's kind) through
# local-completions. decode.py then answers the same questions greedily, as finetune_demo.sh scores them: its exact
# match equals lm-eval's, generation for generation.
#   bash end_to_end/eval_demo.sh [--quick] [OUTPUT_DIR] [CHECKPOINT]       (about 90 s on 2 CPU cores)
# CHECKPOINT: a checkpoint's items folder (load_parameters_path) or a run folder (its latest checkpoint) of
# demo.yml's model, full weights; it defaults to ~/maxtext_runs/demo, the quick start's run, which is trained first
# if it holds no checkpoint. A fine-tuned one: /tmp/maxtext_finetune_demo/runs/sft_full after finetune_demo.sh.
# --quick (CI, about 45 s): the first 8 of 110 held-out questions (a quick start of 20 steps if it must run
# one): checks that every part still runs and agrees; its accuracies mean nothing.
# Summary in OUTPUT_DIR/eval/accuracy.json; lm-eval's results and samples in OUTPUT_DIR/lm_eval/.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_eval_demo}
CKPT=${ARGS[1]:-$HOME/maxtext_runs/demo}
PER_HELDOUT=2 LIMIT=() BASE_STEPS=()
if [ "$QUICK" = 1 ]; then PER_HELDOUT=1 LIMIT=(--limit 8) BASE_STEPS=(steps=20 eval_interval=-1); fi
rm -rf "$OUT"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # lm_eval runs in $OUT/eval, where the task YAMLs find their data
TASKS="$PWD/end_to_end/lm_eval_tasks"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 \
  HF_DATASETS_CACHE="$OUT/hf_datasets" NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}"
start=$(date +%s)

latest() { ls "$1/checkpoints" | grep -E '^[0-9]+$' | sort -n | tail -1; }
if [ ! -d "$CKPT" ] || [ -d "$CKPT/checkpoints" ]; then  # a run folder
  if [ ! -d "$CKPT/checkpoints" ] || [ -z "$(latest "$CKPT")" ]; then
    echo "== no checkpoint in $CKPT: the quick start first"
    python3 MaxText/train.py MaxText/configs/demo.yml run_name="$(basename "$CKPT")" \
      base_output_directory="$(dirname "$CKPT")" ${BASE_STEPS[@]+"${BASE_STEPS[@]}"}
  fi
  CKPT="$CKPT/checkpoints/$(latest "$CKPT")/items"
fi
echo "== the questions, the task data and a Hugging Face copy of the tokenizer (checkpoint $CKPT)"
python3 MaxText/build_finetune_demo_data.py "$OUT/data" --per_heldout_document "$PER_HELDOUT"
python3 end_to_end/lm_eval_tasks/finetune_heldout.py prepare "$OUT/data" "$OUT/eval" ${LIMIT[@]+"${LIMIT[@]}"}

# decode.py's settings in finetune_demo.sh: the chat template, prompts up to 128 tokens, 16 generated at most. The
# server and decode.py run the same engine, 8 slots in batch-invariant mode: a question's greedy answer is then the
# same bits whatever else runs beside it (how many lm-eval sends at once, in which order); engines of other slot
# counts round their matmuls differently and can flip a near-tie (docs/guides/decoding.md).
MODEL=(MaxText/configs/demo.yml run_name=eval_demo base_output_directory="$OUT/runs" load_parameters_path="$CKPT"
  use_chat_template=true max_prefill_predict_length=128 max_target_length=144 per_device_batch_size=8
  decode_batch_invariant=true)
echo "== serve.py on a free loopback port (8 decode slots)"
python3 MaxText/serve.py "${MODEL[@]}" server_port=0 > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2> /dev/null || true' EXIT
BASE=
for _ in $(seq 600); do  # 5 minutes at most for loading and compiling
  kill -0 "$SERVER" 2> /dev/null || { tail -20 "$OUT/serve.log"; echo "error: serve.py exited" >&2; exit 1; }
  BASE=$(sed -n "s|^Serving '.*' at \(http://[^ ]*\)/v1 .*|\1|p" "$OUT/serve.log" | head -1)
  if [ -n "$BASE" ] && curl -sf "$BASE/health" > /dev/null; then break; fi
  BASE=
  sleep 0.5
done
[ -n "$BASE" ] || { tail -20 "$OUT/serve.log"; echo "error: serve.py did not answer /health in 5 minutes" >&2; exit 1; }
echo "serving at $BASE"

# lm-eval records `git describe` of the folder it runs in, where git prints "fatal: not a git repository": in a git
# checkout it records this repository's commit instead (GIT_DIR), which says what code was evaluated.
GIT_DIR_OF_REPO=$(git rev-parse --absolute-git-dir 2>/dev/null || true)
lm_eval() {  # the task data is read from the folder lm_eval runs in
  (cd "$OUT/eval" && ${GIT_DIR_OF_REPO:+env GIT_DIR="$GIT_DIR_OF_REPO"} python3 -m lm_eval run --include_path "$TASKS" \
    --apply_chat_template --output_path "$OUT/lm_eval" --log_samples "$@")
}
echo "== lm-eval: finetune_heldout_gen through local-chat-completions"
lm_eval --model local-chat-completions --tasks finetune_heldout_gen --model_args \
  "model=eval_demo,base_url=$BASE/v1/chat/completions,num_concurrent=8,max_retries=3,tokenized_requests=False"
echo "== lm-eval: finetune_heldout_mc through local-completions"
lm_eval --model local-completions --tasks finetune_heldout_mc --model_args \
  "model=eval_demo,base_url=$BASE/v1/completions,tokenizer_backend=huggingface,tokenizer=$OUT/eval/hf_tokenizer,num_concurrent=8,max_retries=3"
kill "$SERVER"
wait "$SERVER" 2> /dev/null || true

echo "== decode.py on the same questions (greedy, as finetune_demo.sh)"
python3 MaxText/decode.py "${MODEL[@]}" decode_prompts_file="$OUT/eval/prompts.txt" decode_sampling_strategy=greedy \
  > "$OUT/decode.txt"
python3 end_to_end/lm_eval_tasks/finetune_heldout.py compare "$OUT/eval" "$OUT/decode.txt" "$OUT/lm_eval"
echo "wall time: $(($(date +%s) - start)) s"
