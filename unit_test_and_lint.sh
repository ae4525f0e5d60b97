#!/usr/bin/env bash
# Format check, lint, then the unit tests (CPU, 8 simulated devices; see MaxText/tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash unit_test_and_lint.sh -k sharding`.
#   bash unit_test_and_lint.sh                  # everything (CI): the quick tests on two pytest-xdist workers,
#                                               # then the slow ones in one process
#   bash unit_test_and_lint.sh -m "not slow"    # the edit-test loop, on two pytest-xdist workers
# The slow tests run one at a time (never on two workers): they start processes that watch each other's heartbeats
# and time their steps, and want the cores to themselves. Workers take a test file at a time.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
LINTED=(MaxText end_to_end multihost_runner.py multihost_job.py MaxText/tests/fake_cloud/gcloud MaxText/tests/fake_cloud/gsutil)
"$PYTHON" -m ruff format --check "${LINTED[@]}"
"$PYTHON" -m ruff check "${LINTED[@]}"
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider --durations=30)
if [ $# -eq 0 ]; then
  status=0
  "${PYTEST[@]}" -n 2 --dist loadfile -m "not slow" MaxText/tests || status=$?
  "${PYTEST[@]}" -m slow MaxText/tests || status=$?
  exit "$status"
fi
WORKERS=()
for arg in "$@"; do
  case "$arg" in *"not slow"*) WORKERS=(-n 2 --dist loadfile) ;; esac
done
"${PYTEST[@]}" ${WORKERS[@]+"${WORKERS[@]}"} MaxText/tests "$@"
