#!/usr/bin/env bash
# Regenerate every number in BENCHMARKS.md on this machine (run it on an otherwise idle machine).
#   ./scripts/bench_all.sh [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
./scripts/install.sh
./scripts/build_llamacpp_peer.sh            # llama.cpp's own speculative example (the CPU peer)
# 1. side by side: our three modes and the peers (issue 2)
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128 --k 8 --out "$out/compare"
# 2. sampled requests: target T=0.6, draft T in {0.1, 0.6, 0.8} (issue 3)
specdec study --studies temps --target-temps 0.6 --draft-temps 0.1,0.6,0.8 --prompts 1 --lengths 128 --runs 2 \
  --no-progress --out "$out/temps"
# 3. the full study on the default pair (issue 4): k 1-16 in both modes + target-only, outputs of 128 and 256
#    tokens, the 3 x 4 temperature grid, acceptance by position, ideal bound; 4 workloads, 3 runs (~85 min)
specdec study --studies ksweep,temps,positions --prompts 1 --runs 3 --no-progress --out "$out/study"
# 4. every draft this machine can load (k=8, and k=16 for the position curves), 128 tokens, 2 runs (~20 min)
specdec study --studies drafts,positions --prompts 1 --lengths 128 --runs 2 --no-progress --out "$out/drafts"
