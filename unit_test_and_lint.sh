#!/usr/bin/env bash
# Format check, lint, then the unit tests (CPU, 8 simulated devices; see MaxText/tests/conftest.py).
# Extra arguments go to pytest, e.g. `bash unit_test_and_lint.sh -k sharding`.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
LINTED=(MaxText end_to_end multihost_runner.py multihost_job.py MaxText/tests/fake_cloud/gcloud MaxText/tests/fake_cloud/gsutil)
"$PYTHON" -m ruff format --check "${LINTED[@]}"
"$PYTHON" -m ruff check "${LINTED[@]}"
"$PYTHON" -m pytest -q -p no:cacheprovider MaxText/tests "$@"
