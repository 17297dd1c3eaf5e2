#!/usr/bin/env bash
# The project's test command: installs what it needs (.venv, idempotent), then runs every tier.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -x); a run that names no test
# path runs the type checker first (scripts/typecheck.sh), then every test. Two pytest-xdist workers
# (TEST_WORKERS), each in a network namespace of its own: whatever starts vLLM engines runs one
# test at a time on one of them (tests/conftest.py), every other module beside it; `-n 0` runs
# everything in one process.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=$("$root/scripts/venv.sh" | tail -n 1)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# A whole run (no test path named, no help asked) type-checks the product first; a failed check
# fails the run.
partial=0
for arg in "$@"; do case "$arg" in tests|tests/*|./tests*|-h|--help) partial=1 ;; esac; done
if [ "$partial" = 0 ]; then
  echo "type check (scripts/typecheck.sh):"
  PYTHON="$python" "$root/scripts/typecheck.sh"
  set -- "$@" tests
fi
# The project's bytecode once (0.5 s): where PYTHONDONTWRITEBYTECODE is set, as on these
# machines, each of the hundreds of processes a run starts would compile it again (~0.1 s each).
"$python" -m compileall -q -j 0 core ports adapters wiring support >/dev/null || true
# Inside a private network namespace (loopback only): Ray's daemons bind every interface.
exec unshare -n -- sh -c 'ip link set lo up && exec "$@"' sh \
  "$python" -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 -ra \
  -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
