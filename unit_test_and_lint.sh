#!/usr/bin/env bash
# Format check, lint, then the unit tests (CPU, 8 simulated devices; see MaxText/tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash unit_test_and_lint.sh -k sharding`.
#   bash unit_test_and_lint.sh                  # everything (CI): the compute-only files on two workers, then the
#                                               # rest in four pytest processes in turn
#   bash unit_test_and_lint.sh -m "not slow"    # the edit-test loop, on two pytest-xdist workers
# Only the quick loop runs on two workers (a test file per worker at a time): the slow tests start processes
# that watch each other's heartbeats and time their steps, and want the cores to themselves.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
# The test stack is not part of the runtime that `bash setup.sh` installs.
if ! "$PYTHON" -c "import pytest, xdist, ruff" 2>/dev/null; then
  echo "error: the tests and lint tools are not installed in $PYTHON; run: bash setup.sh --dev" >&2
  exit 2
fi
LINTED=(MaxText end_to_end multihost_runner.py multihost_job.py multihost_flags.py MaxText/tests/fake_cloud/gcloud MaxText/tests/fake_cloud/gsutil)
"$PYTHON" -m ruff format --check "${LINTED[@]}"
"$PYTHON" -m ruff check "${LINTED[@]}"
for arg in "$@"; do
  case "$arg" in *"not slow"*) exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=40 -n 2 --dist loadfile MaxText/tests "$@" ;; esac
done
# The whole suite: four pytest processes in turn, each over a quarter of the test files. One process for all of them
# grew with every compiled program and model it kept, until XLA aborted the process ~700 tests in (pipeline_test,
# twice); each quarter alone passes.
# Files whose tests only compile and compute (no processes, no timing, nothing shared on disk) run first, on two
# workers, a test at a time each: XLA compiles on one core, so two workers halve their time (the engine's per-family
# matrix compiles three engines per case). Each worker takes about half of them, as many as one quarter below.
COMPUTE=(MaxText/tests/engine_test.py)
for name in attention_kernels build_demo_dataset build_finetune_demo_data build_rl_demo_data checkpointing \
  context_parallel convert deepseek families family_parallelism gemma3 gpt_oss grouped_matmul hf_checkpoint imports \
  integrity kimi kv_quant llama4 logit_checker model moe optimizers pipeline quantization quantized_inference qwen2 \
  rl_loss rl_rewards sharding_rules sharding state tokenizer; do
  COMPUTE+=("MaxText/tests/${name}_test.py")
done
mapfile -t FILES < <(ls MaxText/tests/*_test.py | sort | grep -v -x -F "${COMPUTE[@]/#/-e}")
PARTS=4
SIZE=$(((${#FILES[@]} + PARTS - 1) / PARTS))
STATUS=0
RAN=0
CODE=0
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 -n 2 --dist load "${COMPUTE[@]}" "$@" || CODE=$?
case $CODE in
  0) RAN=1 ;;
  5) ;;
  *) STATUS=$CODE ;;
esac
for ((i = 0; i < ${#FILES[@]}; i += SIZE)); do
  CODE=0
  "$PYTHON" -m pytest -q -p no:cacheprovider --durations=20 "${FILES[@]:i:SIZE}" "$@" || CODE=$?
  case $CODE in
    0) RAN=1 ;;
    5) ;; # no test of this quarter selected (-k, -m)
    *) STATUS=$CODE ;;
  esac
done
if [ "$STATUS" = 0 ] && [ "$RAN" = 0 ]; then
  echo "error: no test selected" >&2
  exit 5
fi
exit "$STATUS"
