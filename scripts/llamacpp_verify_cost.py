"""The llama.cpp target runner's own step cost, without a service around it (BENCHMARKS §6h).

    python scripts/llamacpp_verify_cost.py POOL_TOKENS THREADS [FLASH_ATTN 0|1]

Loads the F32 target GGUF in a `LlamaCppRunner` (a pool of POOL_TOKENS tokens), prefills 150
tokens, then times 20 one-token steps and 20 nine-token verifies (k = 8), each rolled back, and
prints the median and min in ms. Pin it as the service would be: `taskset -c 0,1 ...`.
"""
import statistics
import sys
import time

from specdec import models
from specdec.serving.batch import SeqChunk
from specdec.serving.llamacpp import LlamaCppRunner, gguf_variant

pool, threads = int(sys.argv[1]), int(sys.argv[2])
flash = len(sys.argv) > 3 and sys.argv[3] == "1"
runner = LlamaCppRunner.load(str(gguf_variant(models.DEFAULT_TARGET_MODEL, "f32")), pool, 16, threads, flash_attn=flash)
seq = runner.blocks.reserve(1000)
tokens = [(i * 37) % 40000 + 100 for i in range(150)]
runner.forward([SeqChunk(seq, tokens, 0, 1)])
for k in (0, 8):
    ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        runner.forward([SeqChunk(seq, tokens[:k + 1], 150, k + 1)])
        ms.append((time.perf_counter() - t0) * 1e3)
        runner.truncate(seq, 150)
    print(f"pool {pool} threads {threads} flash_attn {flash} k={k}: median {statistics.median(ms):.1f} ms, min {min(ms):.1f}")
