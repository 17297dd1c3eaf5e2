#!/usr/bin/env bash
# The wheel bundle a bare GPU machine (torch 2.11.0+cu130, Python 3.12, no package registry)
# lacks to run a fleet: vLLM 0.25.0 (the newest whose wheel pins torch 2.11.0 and links CUDA 13),
# ai-dynamo 1.6.1 + its runtime, and the small dependencies found missing there.
#
#   scripts/gpu_bundle.sh build DIR [PART_MIB]   here (pip reaches PyPI): DIR/part-NN, each
#                                                 PART_MIB (default 58) or less
#   scripts/gpu_bundle.sh stash DIR              there, once per arriving part: copy DIR's parts
#                                                 to /root/stash (outside the checkout)
#   scripts/gpu_bundle.sh install [SITE]         there: cat the stashed parts, pip install
#                                                 --no-index --no-deps --target SITE
#                                                 (default /root/site); prints the PYTHONPATH
# Parts are cut from one tar of the wheels, so each fits one transfer with the checkout beside it.
set -euo pipefail

STASH=${STASH:-/root/stash}

# Pinned where a newer release was seen to break (see docs/gpu.md): xgrammar 0.2.9 needs a
# newer apache-tvm-ffi than vLLM 0.25 wants; fastapi >= 0.137 and llguidance >= 1.8 are too new.
WHEELS=(
  vllm==0.25.0 ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1
  annotated-types==0.8.0 anthropic==2.15.0 apache-tvm-ffi==0.1.9 astor==0.8.1 blake3==1.0.11
  cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0 dill==0.4.1
  diskcache==5.6.3 docstring-parser==0.18.0 fastapi==0.136.3 flashinfer-python==0.6.13
  httpx-aiohttp==0.2.0 ijson==3.6.0 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6 loguru==0.7.3 mcp==2.3.0
  mcp-types==2.3.0 mistral-common==1.13.1 model-hosting-container-standards==0.1.16
  msgspec==0.23.0 nvidia-cudnn-frontend nvtx==0.2.15 openai==3.57.0 openai-harmony
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1 outlines-core==0.2.14 partial-json-parser==0.2.1.1.post7
  prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.13.5 pydantic-core==2.46.5
  pyjwt==2.15.1 python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0
  referencing==0.37.0 rpds-py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0
  starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.54.0
  watchfiles==1.3.0 xgrammar==0.2.1 zstandard==0.25.0
  httpx2==2.16.2 httpcore2==2.16.2  # imported by the newer openai / starlette releases above
  # the project's own needs and the tier's test runner
  redis==6.4.0  # imported by Dynamo's own vLLM worker (python -m dynamo.vllm) at its start
  attrs==26.1.0 psutil pytest pluggy iniconfig pytest-timeout
  # token capture's staging as NeMo-RL runs it: TransferQueue on Ray
  ray==2.60.0 transferqueue==0.1.11 tensordict==0.15.3 hydra-core==1.3.8 omegaconf==2.3.1
  pyvers==0.2.3 msgpack==1.2.4 cloudpickle==3.1.3 click==8.5.1 protobuf==7.36.2
)
# Published as a source archive only (pure Python): built into a wheel here.
SOURCE_ONLY=(antlr4-python3-runtime==4.9.3)
PLATFORMS=(manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64
           manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64
           manylinux1_x86_64 linux_x86_64)

build() {
  local dir=$1 part_mib=${2:-58}
  mkdir -p "$dir/wheels"
  local platform_args=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  for wheel in "${WHEELS[@]}"; do
    # one at a time: a wheel with no build for these platforms is named, not silently dropped
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${platform_args[@]}" -d "$dir/wheels" "$wheel" \
      || { echo "no wheel for $wheel" >&2; exit 1; }
  done
  python3 -m pip wheel -q --no-deps -w "$dir/wheels" "${SOURCE_ONLY[@]}"
  rm -f "$dir"/part-*
  (cd "$dir/wheels" && tar -cf - *.whl) | split -b "${part_mib}M" -d -a 2 - "$dir/part-"
  (cd "$dir" && sha256sum part-* > SHA256SUMS)
  ls -l "$dir"/part-*
}

stash() {
  mkdir -p "$STASH"
  cp "$1"/part-* "$STASH"/
  [ -f "$1/SHA256SUMS" ] && cp "$1/SHA256SUMS" "$STASH"/ || true
  ls "$STASH"
}

install() {
  local site=${1:-/root/site}
  (cd "$STASH" && sha256sum -c --quiet SHA256SUMS)
  mkdir -p "$site" /root/wheels
  cat "$STASH"/part-* | tar -xf - -C /root/wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" /root/wheels/*.whl
  # The GPU machine sets PYTHONDONTWRITEBYTECODE=1: without bytecode written here, every process
  # of a fleet (CLI, frontend, worker, engine core) compiles vLLM and Dynamo from source again.
  python3 -m compileall -q -j 0 "$site" >/dev/null || true
  echo "$site"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  stash) shift; stash "$@" ;;
  install) shift; install "$@" ;;
  -h|--help) echo "usage: $0 build DIR [PART_MIB] | stash DIR | install [SITE]"; exit 0 ;;
  *) echo "usage: $0 build DIR [PART_MIB] | stash DIR | install [SITE]" >&2; exit 2 ;;
esac
