#!/usr/bin/env bash
# Format check, lint, then the tests in tiers (CPU; MaxText/tests/conftest.py gives each pytest process its devices):
#   unit  tests not marked mesh or slow, on one device
#   mesh  tests marked mesh (sharding, parallelism, multi-device engines), on 8 simulated devices
#   slow  tests marked slow (processes, scripts, kill -9, the demos' checks), on 8 simulated devices
#   bash unit_test_and_lint.sh                  # everything (CI): the three tiers in turn
#   bash unit_test_and_lint.sh -m "not slow"    # the edit-test loop: unit and mesh
# Other arguments go to pytest (`bash unit_test_and_lint.sh -k sharding`); a -m expression narrows every tier.
# Each tier runs on two pytest-xdist workers, a test file per worker at a time (the slow tier splits one file's demos).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
# The test stack is not part of the runtime that `bash setup.sh` installs.
if ! "$PYTHON" -c "import pytest, xdist, ruff" 2>/dev/null; then
  echo "error: the tests and lint tools are not installed in $PYTHON; run: bash setup.sh --dev" >&2
  exit 2
fi
LINTED=(MaxText end_to_end docs multihost_runner.py multihost_job.py multihost_flags.py MaxText/tests/fake_cloud/gcloud MaxText/tests/fake_cloud/gsutil)
"$PYTHON" -m ruff format --check "${LINTED[@]}"
"$PYTHON" -m ruff check "${LINTED[@]}"
# The caller's -m expression (if any) is joined to each tier's.
SELECT="" ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -m) SELECT="$2"; shift 2 ;;
    -m*) SELECT="${1#-m}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
STATUS=0
RAN=0
tier() {  # tier NAME MARKER-EXPRESSION PYTEST-XDIST-OPTIONS...
  local name="$1" expression="$2" code=0 start=$SECONDS
  shift 2
  if [ -n "$SELECT" ]; then expression="($SELECT) and ($expression)"; fi
  echo "== tier $name: -m \"$expression\""
  "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 -n 2 "$@" -m "$expression" MaxText/tests \
    ${ARGS[@]+"${ARGS[@]}"} || code=$?
  echo "== tier $name: exit $code after $((SECONDS - start)) s"
  case $code in
    0) RAN=1 ;;
    5) ;; # no test of this tier selected (-k, -m)
    *) STATUS=$code ;;
  esac
}
tier unit "not mesh and not slow" --dist loadfile
tier mesh "mesh and not slow" --dist loadfile
# A file per worker at a time, except the demos' checks, each a group of its own (conftest.py), in file order.
tier slow "slow" --dist loadgroup --no-loadscope-reorder
if [ "$STATUS" = 0 ] && [ "$RAN" = 0 ]; then
  echo "error: no test selected" >&2
  exit 5
fi
exit "$STATUS"
