"""A one-token step of the default draft (int4, the service's runner) on one thread against two
(BENCHMARKS.md §6j: what borrowing the other service's idle core could give).

    taskset -c 0,1 python scripts/draft_threads_probe.py [--busy-core 0]

The step feeds one token after 300 cached ones, as a draft step does; each thread count is
measured twice, alternating, 25 steps each (the first 5 left out of the median). With
--busy-core, a process spinning on that core stands for the other service at work.
"""
import argparse
import statistics
import subprocess
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import models  # noqa: E402
from specdec.lab.steps import CONTEXT, VARIANTS, load  # noqa: E402
from specdec.serving.batch import SeqChunk  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--busy-core", type=int, default=None)
a = ap.parse_args()
torch.set_num_threads(1)
runner = load(VARIANTS["torch-int4"], models.DEFAULT_DRAFT_MODEL, 2)
seq = runner.blocks.reserve(CONTEXT + 64)
context = [(100 + 13 * i) % 20000 + 50 for i in range(CONTEXT)]
for i in range(0, CONTEXT, 128):
    runner.forward([SeqChunk(seq, context[i:i + 128], i, 1)])


def step_ms() -> float:
    t0 = time.perf_counter()
    runner.forward([SeqChunk(seq, [500], CONTEXT, 1)])
    runner.truncate(seq, CONTEXT)
    return (time.perf_counter() - t0) * 1e3


busy = None if a.busy_core is None else subprocess.Popen(
    ["taskset", "-c", str(a.busy_core), sys.executable, "-c", "while True: pass"])
try:
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        times = [step_ms() for _ in range(25)]
        print(f"threads {threads}: median {statistics.median(times[5:]):.1f} ms, min {min(times):.1f} ms")
finally:
    if busy is not None:
        busy.kill()
