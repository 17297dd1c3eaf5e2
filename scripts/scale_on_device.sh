#!/usr/bin/env bash
# The scale figures (bench/bench_scale.py) at N = 8, 128 and 32 memory-engine workers, on a bare
# machine with Python, torch and many cores (the device machine: 16 cores, 128 GiB; no GPU used),
# from the copied checkout, in one command of at most 9 minutes:
#
#   bash scripts/scale_on_device.sh            (OUT: where the results go; default ./scale-out)
#
# SCALE_WORKERS (default 8,128,32) and LIMIT_S (default 540) make a small dry run elsewhere;
# SCALE_PARTS (default all) picks the bench's parts (--parts), e.g. refit.
# What it needs there: Dynamo's wheels, either installed already (SITE on PYTHONPATH imports
# dynamo.frontend) or stashed by scripts/gpu_bundle.sh (/root/stash/part-*: every wheel but vLLM's
# is installed, vLLM is not needed); etcd on PATH or carried as .scale-carry/etcd (else the etcd
# discovery fleet is skipped, saying so). The project itself is built from the checkout.
# Writes under $OUT: results.json (every figure), summary.md (the figures against N and the
# done-when ratios, the cluster model's table), scale.log, hops.json, plots.tar (one PNG a figure
# and the model's).
set -uo pipefail
usage="usage: $0 [--help]   (settings through SCALE_WORKERS, LIMIT_S, OUT, SITE)"
case "${1:-}" in
  -h|--help) echo "$usage"; awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
             exit 0 ;;
  "") ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
started=$(date +%s)
LIMIT_S=${LIMIT_S:-540}  # the whole command, install included
# The memory the fleets may take: the lent machine has 128 GiB but may report less until used.
SITE=${SITE:-/root/site-scale}
STASH=${STASH:-/root/stash}
OUT=${OUT:-$root/scale-out}
mkdir -p "$OUT" "$SITE"
log="$OUT/scale.log"
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 PATH=/root/bin:$root/.scale-carry:$PATH
say() { echo "[$(( $(date +%s) - started )) s] $*" | tee -a "$log"; }

install_site() {
  if python3 -c "import dynamo.frontend" 2>/dev/null; then
    say "Dynamo already importable from $SITE"
  elif ls "$STASH"/part-* >/dev/null 2>&1; then
    say "installing the stashed wheels but vLLM's into $SITE"
    (cd "$STASH" && { [ ! -f SHA256SUMS ] || sha256sum -c --quiet SHA256SUMS; }) || return 1
    rm -rf /tmp/scale-wheels && mkdir -p /tmp/scale-wheels
    cat "$STASH"/part-* | tar -xf - -C /tmp/scale-wheels --exclude 'vllm-*' \
      --exclude 'flashinfer_python-*' --exclude 'xgrammar-*' --exclude 'nvidia_cudnn_frontend-*' \
      || return 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" /tmp/scale-wheels/*.whl >>"$log" 2>&1 || return 1
  else
    say "no Dynamo: neither importable from $SITE nor stashed in $STASH (scripts/gpu_bundle.sh stash)"
    return 1
  fi
  say "building rollout-fleet from the checkout"
  rm -rf /tmp/scale-src && mkdir -p /tmp/scale-src
  cp -r pyproject.toml README.md core ports adapters wiring /tmp/scale-src/ || return 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
    --no-cache-dir --upgrade --target "$SITE" /tmp/scale-src >>"$log" 2>&1 || return 1
  # Bytecode once, not in each of 128 workers (the machine may not write it: PYTHONDONTWRITEBYTECODE).
  python3 -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || true
  if ! command -v ip >/dev/null; then  # the bench brings loopback up in its own namespace
    mkdir -p /root/bin
    install -m 755 "$root/scripts/ip_shim.py" /root/bin/ip
  fi
  python3 -c "import torch, dynamo.frontend, rollout_fleet.wiring.worker; print('torch', torch.__version__)" \
    2>&1 | tee -a "$log"
}

install_site || { say "install failed; see $log"; exit 1; }
say "$(nproc) cores, $(awk '/MemAvailable/ {printf "%.0f GiB available", $2 / 1048576}' /proc/meminfo); etcd: $(command -v etcd || echo none)"

say "per-hop figures (bench/refit_hops.py)"
timeout 120 python3 bench/refit_hops.py --out "$OUT/hops.json" 2>&1 | grep -v '^\[W' | tee -a "$log"

left=$(( LIMIT_S - ($(date +%s) - started) - 45 ))  # 45 s for the summary and the plots' tar
say "the scale bench, N = ${SCALE_WORKERS:-8,128,32} (the last dropped first if time runs short), ${left} s"
timeout $(( left + 30 )) python3 bench/bench_scale.py --workers "${SCALE_WORKERS:-8,128,32}" --out "$OUT/figures" \
  --time-budget-s "$left" --free-gib "${FREE_GIB:-100}" ${SCALE_PARTS:+--parts "$SCALE_PARTS"} 2>&1 | grep -v '^\[W' | tee -a "$log"

say "summary"
python3 bench/scale_summary.py --results "$OUT/figures/results.json" --hops "$OUT/hops.json" \
  --out "$OUT/figures" > "$OUT/summary.md" 2>>"$log" || say "summary failed; see $log"
cp "$OUT/figures/results.json" "$OUT/results.json" 2>/dev/null
(cd "$OUT/figures" && tar -cf "$OUT/plots.tar" ./*.png) 2>>"$log"
rm -rf "$OUT/figures"
say "done: $(ls "$OUT" | tr '\n' ' ')"
