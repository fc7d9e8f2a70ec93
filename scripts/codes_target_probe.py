"""The default target read from its GGUF codes against float32 panels (BENCHMARKS.md §6s).

    python scripts/codes_target_probe.py [--reps 3] [--runs 7] [--out FILE.json]

Loads the default target twice as the target service does (`cpu_kernels = specdec`: matrices on
a Q4_1 / Q8_0 grid read as their codes; `specdec-f32`: every matrix in float32 panels), in this
process pinned to one core with one thread, and reports:
- how many matrices each holds as codes, its weight bytes and its load time (after a warm-up load);
- whether the two give the same logits bit for bit, 9-token verifies over a real chat prompt;
- the median ms of one forward of 1 sequence x n tokens (n = 1: a decode; n = 9: a k = 8
  verify; n = 128: a prefill chunk) after 300 cached tokens (`specdec.lab.steps.time_shape`,
  `--runs` forwards), the two runners alternating `--reps` times: median (min-max) over the reps.
"""
import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import hf_compat, models  # noqa: E402
from specdec.lab.steps import VARIANTS, load, time_shape  # noqa: E402
from specdec.lab.workloads import mixed_workload  # noqa: E402
from specdec.serving.batch import SeqChunk  # noqa: E402
from specdec.serving.cpu_gemm import CodesF32Weight  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=3)
ap.add_argument("--runs", type=int, default=7)
ap.add_argument("--out", default="")
a = ap.parse_args()
os.sched_setaffinity(0, {0})
torch.set_num_threads(1)
out: dict = {"command": "python scripts/codes_target_probe.py " + " ".join(sys.argv[1:])}
load(VARIANTS["torch-fp32-panels"], models.DEFAULT_TARGET_MODEL, 2)  # a warm-up: imports, the cached model files
runners = {}
for name, variant in (("codes", "torch-fp32"), ("panels", "torch-fp32-panels")):
    t0 = time.perf_counter()
    r = runners[name] = load(VARIANTS[variant], models.DEFAULT_TARGET_MODEL, 2)
    mats = r.weights.matrices()
    out[name] = {"load_s": round(time.perf_counter() - t0, 1), "weight_mb": round(r.facts.weight_bytes / 1e6, 1),
                 "matrices": len(mats), "as_codes": sum(isinstance(m, CodesF32Weight) for m in mats)}
tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
ids = hf_compat.chat_token_ids(tok, mixed_workload(1, 0)[0].messages)
seqs = {n: r.blocks.reserve(len(ids) + 16) for n, r in runners.items()}
same = True
for i in range(0, len(ids), 9):
    chunk = ids[i:i + 9]
    logits = [r.forward([SeqChunk(seqs[n], chunk, i, len(chunk))])[0] for n, r in runners.items()]
    same &= torch.equal(*logits)
for n, r in runners.items():
    r.free(seqs[n])
out["positions_compared"], out["logits_bit_identical"] = len(ids), bool(same)
for n_tokens in (1, 9, 128):
    times: dict[str, list[float]] = {n: [] for n in runners}
    for _ in range(a.reps):
        for n, r in runners.items():
            times[n].append(time_shape(r, 1, n_tokens, a.runs))
    out[f"1x{n_tokens}_ms"] = {n: {"median": round(statistics.median(t), 1), "min": round(min(t), 1),
                                   "max": round(max(t), 1)} for n, t in times.items()}
print(json.dumps(out, indent=1))
if a.out:
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
