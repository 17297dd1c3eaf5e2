#!/usr/bin/env bash
# The GPU tier on a machine prepared by scripts/gpu_bundle.sh (its parts stashed in /root/stash).
# Run from the checkout's root there:
#   scripts/gpu_tier.sh install      install the bundle and the project's wheel into /root/site
#   scripts/gpu_tier.sh tests [ARGS] pytest ARGS, by default tests/gpu (serve / generate / refit
#                                    on the GPU; NeMo-RL's IPC refit through CUDA IPC; NeMo-Gym's
#                                    token capture through the NeMo-RL drop-in, 16 trajectories x
#                                    8 turns with a refit between: tests/gpu/test_gpu_capture.py)
#   scripts/gpu_tier.sh bench [ARGS] bench/bench_gpu_fleet.py (fleet vs bare vLLM)
#   scripts/gpu_tier.sh standard-clients [ARGS]
#                                    bench/bench_standard_clients.py --gpu (vllm bench serve
#                                    against the fleet and vLLM's own server, in a private
#                                    network namespace)
#   scripts/gpu_tier.sh sweep [ARGS]  bench/bench_serve_sweep.py --gpu (the same client over input x
#                                    output x concurrency; both servers resident (started one
#                                    after the other, or together), or each alone;
#                                    table and plot in $OUT/sweep)
#   scripts/gpu_tier.sh agent-door [ARGS]
#                                    bench/bench_agent_door.py --gpu (multi-turn trajectories
#                                    through the agent door, named vs routed, workers sharing
#                                    the GPU)
#   scripts/gpu_tier.sh grpo-groups [ARGS]
#                                    bench/bench_grpo_groups.py --gpu (a GRPO load: the fleet
#                                    grouped (n=8 in one request), one by one, and vLLM's own
#                                    server with n=8, without and with logprobs; table in
#                                    $OUT/grpo-groups)
#   scripts/gpu_tier.sh logprobs-cost [ARGS]
#                                    bench/bench_logprobs_cost.py --gpu (what asking logprobs
#                                    costs vLLM's front; table in $OUT/logprobs-cost)
# Output and figures go to $OUT (or ./gpu-out). The project's wheel is built beforehand where
# pip works, from a copy outside the checkout so no build folder lands in it
# (`git archive HEAD | tar -x -C "$tmp" && pip wheel --no-deps -w wheel "$tmp"`), and found in ./wheel: vLLM finds the project's
# plugin through the wheel's entry point.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
SITE=${SITE:-/root/site}
OUT=${OUT:-$root/gpu-out}
case "${1:-}" in  # a usage question writes nothing
  install|tests|bench|standard-clients|sweep|grpo-groups|logprobs-cost|agent-door|colocated) mkdir -p "$OUT" ;;
esac
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PATH=/root/bin:$PATH
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

ip_shim() {
  # `serve` enters a private network namespace and brings loopback up with `ip`; a machine
  # without iproute2 gets the one call it needs (SIOCSIFFLAGS) from Python.
  command -v ip >/dev/null && return 0
  mkdir -p /root/bin
  install -m 755 scripts/ip_shim.py /root/bin/ip
}

case "${1:-}" in
  install)
    started=$(date +%s)
    bash scripts/gpu_bundle.sh install "$SITE" >/dev/null
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" wheel/rollout_fleet-*.whl
    ip_shim
    python3 -c "import vllm, torch, dynamo.frontend, rollout_fleet.wiring.worker; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    echo "installed in $(( $(date +%s) - started )) s"
    ;;
  tests)
    shift
    [ "$#" -gt 0 ] || set -- tests/gpu
    python3 -m pytest -v -p no:cacheprovider -o addopts="" --timeout=580 "$@" 2>&1 | tee "$OUT/gpu-tests.log"
    ;;
  bench)
    shift
    python3 bench/bench_gpu_fleet.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench-gpu-fleet.log"
    ;;
  standard-clients)
    shift
    ip_shim
    unshare -n sh -c 'ip link set lo up && exec python3 bench/bench_standard_clients.py --gpu "$@"' \
      sh --out "$OUT/standard-clients" "$@" 2>&1 | tee "$OUT/bench-standard-clients.log"
    ;;
  sweep)
    shift
    ip_shim
    unshare -n sh -c 'ip link set lo up && exec python3 bench/bench_serve_sweep.py --gpu "$@"' \
      sh --out "$OUT/sweep" "$@" 2>&1 | tee -a "$OUT/bench-serve-sweep.log"
    ;;
  grpo-groups)
    shift
    ip_shim
    unshare -n sh -c 'ip link set lo up && exec python3 bench/bench_grpo_groups.py --gpu "$@"' \
      sh --out "$OUT/grpo-groups" "$@" 2>&1 | tee "$OUT/bench-grpo-groups.log"
    ;;
  logprobs-cost)
    shift
    python3 bench/bench_logprobs_cost.py --gpu --out "$OUT/logprobs-cost" "$@" 2>&1 | tee "$OUT/bench-logprobs-cost.log"
    ;;
  agent-door)
    shift
    ip_shim
    python3 bench/bench_agent_door.py --gpu "$@" 2>&1 | tee "$OUT/bench-agent-door.log"
    ;;
  colocated)
    shift
    python3 -m rollout_fleet.wiring.cli demo --colocated --device gpu --quiet --out "$OUT/colocated" "$@" 2>&1 | tee "$OUT/colocated-demo.log"
    ;;
  -h|--help) echo "usage: $0 install | tests [PYTEST ARGS] | bench [ARGS] | standard-clients [ARGS] | sweep [ARGS] | grpo-groups [ARGS] | logprobs-cost [ARGS] | agent-door [ARGS] | colocated [DEMO ARGS]"; exit 0 ;;
  *) echo "usage: $0 install | tests [PYTEST ARGS] | bench [ARGS] | standard-clients [ARGS] | sweep [ARGS] | grpo-groups [ARGS] | logprobs-cost [ARGS] | agent-door [ARGS] | colocated [DEMO ARGS]" >&2; exit 2 ;;
esac
