#!/usr/bin/env bash
# Regenerate every number in BENCHMARKS.md on this machine (run it on an otherwise idle machine;
# about 4.5 hours on 2 CPU cores), then copy the tables and plots it quotes into docs/bench/.
#   ./scripts/bench_all.sh [out-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench-results}
./scripts/install.sh
./scripts/build_llamacpp_peer.sh            # llama.cpp's own speculative example (the CPU peer)
# 1. side by side: our three modes and the peers, outputs of 128 and 256 tokens (~25 min)
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 --out "$out/compare"
# 1b. the same with the llama.cpp target engine (~12 min)
specdec bench --config scripts/configs/llamacpp-target.toml --runs 3 --prompts 2 --workloads chat,code \
  --max-tokens 128,256 --k 8 --systems target-only,sequential,pipelined --out "$out/compare-llamacpp"
# 6g. decode rates against llama.cpp's speculative example at k 4, 8, 12, both target engines (~2 x 20 min)
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 \
  --systems target-only,pipelined,llamacpp-spec --no-progress --out "$out/decode"
specdec bench --config scripts/configs/llamacpp-target.toml --runs 3 --prompts 2 --workloads chat,code \
  --max-tokens 128,256 --k 8 --systems target-only,pipelined,llamacpp-spec --no-progress --out "$out/decode-llamacpp"
# 6h. both services on both cores, sequential rounds, against llama.cpp's example (~15 min)
specdec bench --config scripts/configs/llamacpp-sequential-2cores.toml --runs 3 --prompts 2 --workloads chat,code \
  --max-tokens 128,256 --k 8 --systems target-only,sequential,pipelined,llamacpp-spec --no-progress \
  --out "$out/decode-sequential-2cores"
# 6. the serving core: the cost of one batched forward per runner and shape (~10 min), and the
#    concurrency sweep, 1-16 clients, every system (~30 min)
specdec bench --steps --runs 5 --out "$out/steps"
specdec bench --concurrency 1,2,4,8,16 --max-tokens 128 --runs 2 --requests-per-client 1 --load-prompts 32 \
  --no-progress --out "$out/load"
# 6o. specdec's CPU kernels against torch's (~5 min), the draft's agreement with the target per head
#     (~2 min), and single stream with the kernels against the target in MKL (~15 min); §6o's decode rates
#     against llama.cpp's example are the 6g run above
python scripts/cpu_kernels_probe.py --reps 9 > docs/bench/cpu-kernels-probe.txt
python scripts/int8_head_probe.py > docs/bench/draft-agreement-cpu-kernels.json
python scripts/single_stream_probe.py "$out/single-stream" --reps 3 --tokens 256 --configs k8,k8-mkl,k4,adaptive \
  > docs/bench/single-stream-cpu-kernels.json
# 6p. the runners' steps as the context grows (~2 min), single stream at k 8 and 7 (~3 min), and the
#     decode rate against llama.cpp's example on the current kernels (~6 min)
python scripts/step_context_probe.py > docs/bench/step-context-probe.json
python scripts/single_stream_probe.py "$out/single-stream-6p" --reps 2 --tokens 256 --configs k8,k7 \
  > docs/bench/single-stream-2026-12-06.json
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 \
  --systems target-only,pipelined,llamacpp-spec --no-progress --out "$out/decode-final"
# 6q. the 16-bit draft: where the 8-bit draft's disagreement came from (a simulation, ~5 min), the real
#     kernels' agreement and steps (~2 min), single stream (~6 min), the decode rate against llama.cpp's
#     example (~6 min), the two drafts under 8 clients (~8 min), TTFT on 200+ token prompts (~1 min)
python scripts/activation_rounding_sim.py 12 > docs/bench/activation-rounding-sim.json
python scripts/draft_agreement_probe.py --prompts 8 --variants torch-int4-x8,torch-int4-x16 \
  > docs/bench/draft-agreement-x16.json
python scripts/single_stream_probe.py "$out/single-stream-6q" --reps 1 --configs x8,x16,x16-k12,x16-k16,x16-adaptive \
  > docs/bench/single-stream-x16.json
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 \
  --systems target-only,pipelined,llamacpp-spec --no-progress --out "$out/decode-x16"
python scripts/draft_load_probe.py "$out/draft-load" --clients 1,8 --reps 2 --configs x8,x16 > docs/bench/draft-load-x16.json
PYTHONPATH=. python scripts/ttft_probe.py "$out/ttft" > docs/bench/ttft-2026-12-06-x16.json
# 6r. the bench on target-only and pipelined (~4 min), and where a pipelined round's time goes (~1 min each; twice)
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 --systems target-only,pipelined \
  --no-progress --out "$out/bench-final"
cp "$out/bench-final/compare.md" docs/bench/compare-final-vm4.md
python scripts/round_anatomy_probe.py --reps 1 > docs/bench/round-anatomy-1.json
python scripts/round_anatomy_probe.py --reps 1 > docs/bench/round-anatomy-2.json
# 6s. the target read from its GGUF codes: exactness and steps against float32 panels (~3 min), the bench
#     with each (~3 + 4 min; TOML with [target] cpu_kernels = "specdec-f32" for the panels), llama.cpp's
#     example beside the default (~6 min), the reduced study with each (~6 + 7 min), the round's anatomy, TTFT
python scripts/codes_target_probe.py --reps 3 --out docs/bench/codes-target-probe.json
printf '[target]\ncpu_kernels = "specdec-f32"\n' > "$out/panels.toml"
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 --systems target-only,pipelined \
  --no-progress --out "$out/bench-codes"
specdec bench --config "$out/panels.toml" --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 \
  --systems target-only,pipelined --no-progress --out "$out/bench-panels"
cp "$out/bench-codes/compare.md" docs/bench/compare-codes.md
cp "$out/bench-panels/compare.md" docs/bench/compare-panels.md
specdec bench --runs 3 --prompts 2 --workloads chat,code --max-tokens 128,256 --k 8 \
  --systems target-only,pipelined,llamacpp-spec --no-progress --out "$out/decode-codes"
cp "$out/decode-codes/compare.md" docs/bench/decode-vs-llamacpp-codes.md
specdec study --studies ksweep --prompts 1 --runs 3 --ks 8 --control --no-progress --out "$out/study-codes"
specdec study --config "$out/panels.toml" --studies ksweep --prompts 1 --runs 3 --ks 8 --control --no-progress \
  --out "$out/study-panels"
cp "$out/study-codes/study.md" docs/bench/study-k8-codes.md
cp "$out/study-panels/study.md" docs/bench/study-k8-panels.md
python scripts/round_anatomy_probe.py --reps 1 > docs/bench/round-anatomy-codes.json
PYTHONPATH=. python scripts/ttft_probe.py "$out/ttft-codes" > docs/bench/ttft-codes.json
python scripts/draft_load_probe.py "$out/load-codes" --clients 1,8 --reps 2 --configs x16,panels \
  > docs/bench/load-codes-vs-panels.json
# 6w. the concurrency sweep on the current defaults (~7 min), the runners' step costs (~3 min), the FMA ceiling (~2 min), the cores' shares (~3 min)
specdec bench --concurrency 1,2,4,8,16 --max-tokens 128 --runs 3 --requests-per-client 1 --load-prompts 32 \
  --target-engines torch --load-peers llama-server --systems pipelined,sequential,target-only \
  --no-progress --out "$out/load-1207"
specdec bench --steps --step-variants torch-fp32,torch-int4,torch-bf16 --runs 5 --out "$out/steps-1207"
cp "$out/load-1207/load.md" docs/bench/load-2026-12-07.md
cp "$out/load-1207/concurrency.png" docs/bench/concurrency-2026-12-07.png
cp "$out/steps-1207/steps.md" docs/bench/steps-2026-12-07.md
python scripts/flop_ceiling_probe.py --reps 3 --runs 5 > docs/bench/flop-ceiling.json
python scripts/cpu_share_probe.py "$out/cpu-share" --clients 1,8,16 --reps 2 > docs/bench/cpu-share.json
# 2. the full study on the default pair (BENCHMARKS.md §2, the same command): k 1,2,4,8,12,16 and
#    adaptive k in both modes, target-only twice (the A/A control), outputs of 128 and 256 tokens, the
#    target x draft temperature grid, acceptance by position, ideal bound and efficiency; one prompt
#    from each of the 4 workloads, 3 runs per cell (79-109 min on the VMs measured before specdec's CPU
#    kernels; 23 min on the AVX-512 VM of 2026-12-05 with them, 18 min on 2026-12-06)
specdec study --studies ksweep,temps,positions --prompts 1 --runs 3 --ks 1,2,4,8,12,16 --draft-temps 0,0.6 \
  --control --no-progress --out "$out/study"
# 3. every draft this machine can load (k=8, and k=16 for the position curves), 128 tokens, 2 runs (~25 min)
specdec study --studies drafts,positions --prompts 1 --lengths 128 --runs 2 --no-progress --out "$out/drafts"
# 4. the auto-tuner on the default pair, within a 7-minute budget, over the llama.cpp drafts (the torch and
#    n-gram drafts lose by 2.5x in step 3, so the budget goes to the ones that can win)
specdec tune --budget-s 420 --drafts llamacpp,llamacpp-f16,llamacpp-q8_0 --out "$out/tune" --quiet
# 5. what BENCHMARKS.md quotes
mkdir -p docs/bench
cp "$out/compare/compare.md" docs/bench/compare.md
cp "$out/study/study.md" docs/bench/study.md
cp "$out"/study/*.png docs/bench/
cp "$out/drafts/study.md" docs/bench/drafts-study.md
cp "$out/drafts/acceptance_by_position.png" docs/bench/drafts-acceptance_by_position.png
cp "$out/tune/tune.md" docs/bench/tune.md
cp "$out/compare-llamacpp/compare.md" docs/bench/compare-llamacpp.md
cp "$out/steps/steps.md" docs/bench/steps.md
cp "$out/decode/compare.md" docs/bench/decode-vs-llamacpp-torch-target.md
cp "$out/decode/compare.md" docs/bench/decode-vs-llamacpp-cpu-kernels.md
cp "$out/decode-llamacpp/compare.md" docs/bench/decode-vs-llamacpp-llamacpp-target.md
cp "$out/decode-sequential-2cores/compare.md" docs/bench/decode-vs-llamacpp-sequential-2cores.md
cp "$out/load/load.md" docs/bench/load.md
cp "$out/load/concurrency.png" docs/bench/concurrency.png
cp "$out/decode-final/compare.md" docs/bench/decode-vs-llamacpp-2026-12-06.md
cp "$out/decode-x16/compare.md" docs/bench/decode-vs-llamacpp-2026-12-06-x16.md
echo "bench_all: results in $out/, quoted copies in docs/bench/"
