#!/usr/bin/env bash
# The main job: installs what it needs (.venv, idempotent), then runs `rollout-fleet demo`.
# Extra arguments go to the demo (see `rollout-fleet demo --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=$("$root/scripts/venv.sh" | tail -n 1)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$(dirname "$python")/rollout-fleet" demo "$@"
