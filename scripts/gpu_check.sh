#!/usr/bin/env bash
# The device check of issue 12 (specdec/lab/gpu.py): bandwidth and the step floor, the target's
# T(k) eager and with CUDA graphs, graphs on/off, the three services, projected tok/s, the goals.
#   scripts/gpu_check.sh                      # on the GPU machine (under 8 minutes); docs/bench/gpu.md
#   scripts/gpu_check.sh --out $OUT/gpu.md    # elsewhere
#   scripts/gpu_check.sh --tiny               # tiny shapes on the CPU, seconds (tests/test_gpu_check.py)
# Without the packaged SmolLM2 there (its tokenizer rides with the random models): here
#   SPECDEC_CACHE_DIR=.gpu-cache python -m specdec.lab.gpu --prepare
# then carry .gpu-cache and run with SPECDEC_CACHE_DIR=.gpu-cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
exec "${PYTHON:-python3}" -m specdec.lab.gpu "$@"
