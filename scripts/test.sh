#!/usr/bin/env bash
# Sets up .venv (scripts/setup.sh) and runs the whole test suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest tests "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
exit $rc
