#!/usr/bin/env bash
# The device check of issue 12 (specdec/lab/gpu.py): bandwidth and the step floor, the target's
# T(k) eager and with CUDA graphs, graphs on/off, the three services, projected tok/s, isolated pools,
# the services again under MPS and with expandable_segments, the goals.
#   scripts/gpu_check.sh                      # on the GPU machine (under 8 minutes); docs/bench/gpu.md
#   scripts/gpu_check.sh --out $OUT/gpu.md    # elsewhere
#   scripts/gpu_check.sh --tiny               # tiny shapes on the CPU, seconds (tests/test_gpu_check.py)
# The GPU machine has no packaged SmolLM2 (its tokenizer rides with the random models) and no
# grpcio-health-checking / grpcio-reflection. Here, once:
#   SPECDEC_CACHE_DIR=.gpu-cache python -m specdec.lab.gpu --prepare && scripts/gpu_wheels.sh
# then carry .gpu-cache and .whl (both git-ignored) and run there:
#   SPECDEC_CACHE_DIR=.gpu-cache scripts/gpu_check.sh --out $OUT/gpu.md
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the services it starts import specdec from here
PY="${PYTHON:-python3}"
wheels="${SPECDEC_GPU_WHEELS:-.whl}"  # scripts/gpu_wheels.sh's folder
if ! "$PY" -c "import grpc_health.v1.health, grpc_reflection.v1alpha.reflection" 2>/dev/null; then
  if ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "gpu_check: this Python lacks grpcio-health-checking / grpcio-reflection; run scripts/gpu_wheels.sh" \
      "where pip reaches a registry and carry $wheels" >&2
    exit 2
  fi
  site="${TMPDIR:-/tmp}/specdec-gpu-site"  # for this run only, not the image's site-packages
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$PY" -m specdec.lab.gpu "$@"
