#!/usr/bin/env bash
# Format check, lint, then the unit tests (CPU, 8 simulated devices; see MaxText/tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash unit_test_and_lint.sh -k sharding`.
#   bash unit_test_and_lint.sh                  # everything (CI), in one pytest process
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
WORKERS=()
for arg in "$@"; do
  case "$arg" in *"not slow"*) WORKERS=(-n 2 --dist loadfile) ;; esac
done
"$PYTHON" -m pytest -q -p no:cacheprovider --durations=40 ${WORKERS[@]+"${WORKERS[@]}"} MaxText/tests "$@"
