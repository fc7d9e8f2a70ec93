"""specdec's CPU kernels against torch's, at the default pair's shapes, one thread.

    python scripts/cpu_kernels_probe.py [--reps 9]        # BENCHMARKS.md §6o

Random weights at the shapes of SmolLM2-135M (30 layers: QKV 576 -> 960, O 576 -> 576,
gate/up 576 -> 3072, down 1536 -> 576; output head 576 -> 49,152); the values do not change
the time. For each row count (1 = a decode, 9 = a k = 8 verify, 36/72 = batched verifies, 128 =
a prefill chunk), ms for one pass over all the layers' matrices, median [min, max] of --reps,
the variants interleaved:
  - target (float32): torch's matmul (MKL) against cpu_gemm.PackedF32Weight;
  - draft (int4 layers, bf16 activations): torch's int4 kernel (serving/int4.Int4Weight)
    against cpu_gemm.PackedInt4Weight;
  - the output head for a draft: bf16, torch's int8 (Int8Weight), cpu_gemm.PackedInt8Weight.
Then the default draft itself (the int4 runner on the shipped model, 300 tokens of context):
one step of 1 to 24 tokens with every layer in one C call (fused_int4.c, with paged_attention.c)
against torch ops with SDPA. It also
checks what the kernels promise: PackedF32Weight gives a row the same bits alone and
in every batch, and agrees with float64 to rounding.
"""
import argparse
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from specdec.serving.cpu_gemm import PackedF32Weight, PackedInt4Weight, PackedInt8Weight, lowbit, skinny  # noqa: E402
from specdec.serving.int4 import Int4Weight, Int8Weight  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=9)
ap.add_argument("--rows", default="1,9,36,72,128")
ap.add_argument("--step-rows", default="1,4,9,12,16,24")
a = ap.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
if skinny() is None or lowbit() is None:
    sys.exit("specdec's kernels do not build on this machine (see the log); nothing to compare")

H, INTER, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
SHAPES = [(H, QKV), (H, H), (H, 2 * INTER), (INTER, H)]  # [in, out] per layer
dense = [[torch.randn(k, n) * 0.05 for k, n in SHAPES] for _ in range(LAYERS)]
head = torch.randn(H, VOCAB) * 0.05  # [in, out]

f32 = [[PackedF32Weight.pack(w) for w in layer] for layer in dense]
i4_torch = [[Int4Weight.quantize(w) for w in layer] for layer in dense]
i4_ours = [[PackedInt4Weight.quantize(w) for w in layer] for layer in dense]
head_bf16 = head.t().contiguous().bfloat16().t()  # [in, out], stored [out, in] as the runner stores it
head_i8_torch, head_i8_ours = Int8Weight.quantize(head), PackedInt8Weight.quantize(head)


def layers(mats, rows: int, dtype, mm):
    """One pass over every layer's matrices, inputs of `rows` rows."""
    xs = {k: torch.randn(rows, k).to(dtype) for k in (H, INTER)}
    def run():
        for layer in mats:
            for (k, _n), w in zip(SHAPES, layer):
                mm(xs[k], w)
    return run


def one(w, rows: int, dtype, mm):
    x = torch.randn(rows, H).to(dtype)
    return lambda: mm(x, w)


def own(x, w):
    return w.matmul(x)


def variants(rows: int) -> dict:
    bf = torch.bfloat16
    return {
        "target torch fp32 (MKL)": layers(dense, rows, torch.float32, torch.matmul),
        "target specdec fp32": layers(f32, rows, torch.float32, own),
        "draft torch int4": layers(i4_torch, rows, bf, own),
        "draft specdec int4": layers(i4_ours, rows, bf, own),
        "head bf16": one(head_bf16, rows, bf, torch.matmul),
        "head torch int8": one(head_i8_torch, rows, bf, own),
        "head specdec int8": one(head_i8_ours, rows, bf, own),
    }


def check_exact() -> dict:
    """PackedF32Weight: a row's bits alone == in any batch; error against float64."""
    w = dense[0][2]
    pw = f32[0][2]
    x = torch.randn(72, w.shape[0])
    alone = torch.cat([pw.matmul(x[i:i + 1]) for i in range(72)])
    same = all(torch.equal(pw.matmul(x[:m]), alone[:m]) for m in (2, 5, 9, 13, 36, 72))
    err = float((alone.double() - x.double() @ w.double()).abs().max())
    mkl_same = all(torch.equal(x[:m] @ w, torch.cat([x[i:i + 1] @ w for i in range(m)])) for m in (9, 36))
    return {"specdec_rows_bit_identical_in_every_batch": same, "specdec_max_abs_error_vs_float64": err,
            "mkl_rows_bit_identical_at_9_and_36": mkl_same}


out = {"reps": a.reps, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "exact": check_exact(), "ms": {}}
for rows in (int(r) for r in a.rows.split(",")):
    runs = variants(rows)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, fn in runs.items():
        fn()  # warm
    for _ in range(a.reps):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    out["ms"][rows] = {name: [round(statistics.median(t), 2), round(min(t), 2), round(max(t), 2)]
                       for name, t in times.items()}
    print(rows, json.dumps(out["ms"][rows]), file=sys.stderr)



def draft_steps() -> dict:
    """The default draft's step (ms): fused layers against torch ops with SDPA, interleaved."""
    from specdec import models
    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import FUSED_ROWS, PagedLlamaRunner

    r = PagedLlamaRunner.load(models.DEFAULT_DRAFT_MODEL, dtype="int4", int4_head="int8", pool_tokens=1024, max_seqs=2)
    seq = r.blocks.reserve(600)
    prompt = [(100 + 13 * i) % 20000 + 50 for i in range(300)]
    for i in range(0, 300, 128):
        r.forward([SeqChunk(seq, prompt[i:i + 128], i, 1)])
    res = {}
    fused = r.fused
    fused.max_rows = 10_000  # every step size through the fused layers here, to see where they stop paying
    for rows in (int(x) for x in a.step_rows.split(",")):
        arms = {"fused layers": fused, "torch ops, SDPA": None}
        times = {name: [] for name in arms}
        for rep in range(a.reps * 3 + 2):
            for name, fz in arms.items():
                r.fused = fz
                t0 = time.perf_counter()
                r.forward([SeqChunk(seq, list(range(500, 500 + rows)), 300, rows)])
                if rep >= 2:
                    times[name].append((time.perf_counter() - t0) * 1e3)
                r.truncate(seq, 300)
        res[rows] = {name: [round(statistics.median(t), 2), round(min(t), 2), round(max(t), 2)]
                     for name, t in times.items()}
        print("draft step", rows, json.dumps(res[rows]), file=sys.stderr)
    return {"fused_rows": FUSED_ROWS, "ms": res}


out["draft_step_ms_at_300_context"] = draft_steps()
print(json.dumps(out, indent=1))
names = list(next(iter(out["ms"].values())))
print("\n| rows | " + " | ".join(names) + " |")
print("|---:|" + "---:|" * len(names))
for rows, row in out["ms"].items():
    print(f"| {rows} | " + " | ".join(f"{m} [{lo}, {hi}]" for m, lo, hi in row.values()) + " |")
print("\n| draft step tokens | fused layers ms | torch ops, SDPA ms |\n|---:|---:|---:|")
for rows, row in out["draft_step_ms_at_300_context"]["ms"].items():
    print(f"| {rows} | " + " | ".join(f"{m} [{lo}, {hi}]" for m, lo, hi in row.values()) + " |")
