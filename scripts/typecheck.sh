#!/usr/bin/env bash
# The type checker over the product (mypy; its settings in pyproject.toml: strict on core/ and
# ports/, mypy's defaults elsewhere). The four layer folders install as rollout_fleet.<layer>
# through a mapping mypy cannot follow, so it reads them through links under out/typecheck/;
# its messages name the folders' own paths. Usage: scripts/typecheck.sh [mypy arguments]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-$("$root/scripts/venv.sh" | tail -n 1)}
shim="$root/out/typecheck/src"
mkdir -p "$shim/rollout_fleet"
for layer in core ports adapters wiring; do
  ln -sfn "$root/$layer" "$shim/rollout_fleet/$layer"
done
report=$(mktemp)
trap 'rm -f "$report"' EXIT
set +e
MYPYPATH="$shim" "$python" -m mypy --cache-dir "${MYPY_CACHE_DIR:-$root/out/typecheck/cache}" \
  -p rollout_fleet "$@" > "$report" 2>&1
status=$?
set -e
sed "s#^out/typecheck/src/rollout_fleet/##; s#^$shim/rollout_fleet/##" "$report"
exit "$status"
