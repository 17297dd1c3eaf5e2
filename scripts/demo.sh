#!/usr/bin/env bash
# The main job: installs what it needs (.venv, idempotent), then runs `rollout-fleet demo`.
# Extra arguments go to the demo (see `rollout-fleet demo --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=$("$root/scripts/venv.sh" | tail -n 1)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# The demo starts a local Ray, whose daemons bind every interface: on this machine the script
# keeps them in a private network namespace (loopback only). `rollout-fleet demo` itself runs
# wherever it is started.
flags=-n
[ "$(id -u)" = 0 ] || flags="-r -n"  # unprivileged: map ourselves to root in a user namespace
exec unshare $flags -- sh -c 'ip link set lo up && exec "$@"' sh \
  "$(dirname "$python")/rollout-fleet" demo "$@"
