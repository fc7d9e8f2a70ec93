"""How close the default target's batched verify runs to one core's float32 FMA peak
(BENCHMARKS.md §6w: why many clients meet a ceiling).

    python scripts/flop_ceiling_probe.py [--reps 3] [--runs 5] [--shapes 1x9,8x9,16x9]

- **Peak**: a C loop of 24 independent 512-bit (or 256-bit) fused multiply-add chains, compiled
  here with `cc -O3 -march=native` and run pinned to core 0, `--reps` times: the float32 FLOP/s
  one core can do at all.
- **The target**: the default target as the target service builds it (specdec's kernels, one
  thread, core 0); per shape B x n (B sequences feeding n tokens after 300 cached ones,
  `specdec.lab.steps.time_shape`, median of `--runs` forwards), its matmul FLOP/s: 2 x the
  elements of the output head and every layer's matrices x the rows, over the step's time
  (attention, norms and the rest count as time, not as FLOPs); and the same matrices alone: one
  `paged_llama.linear` of B*n random rows through each (the step's matmuls without the rest).
Prints JSON: the peak (median, min, max), and per shape the step's and the matmuls' ms, GFLOP/s
and fractions of peak.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, ".")
from specdec.serving import cpu_gemm  # noqa: E402  (its compiler choice: $CC, cc or gcc)

PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#if defined(__AVX512F__)
typedef __m512 vf;
#define W 16
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#else
typedef __m256 vf;
#define W 8
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#endif
int main(void)
{
    vf a[24];
    for (int i = 0; i < 24; i++) a[i] = SET1(1.0f + i * 1e-7f);
    const vf b = SET1(0.9999999f), c = SET1(1e-8f);
    const long iters = 150000000L;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long n = 0; n < iters; n++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) a[i] = FMA(a[i], b, c);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    float keep = 0;
    for (int i = 0; i < 24; i++) keep += ((float *)&a[i])[0];
    printf("%.3f %d %g\n", iters * 24.0 * W * 2 / s / 1e9, W * 32, keep);
    return 0;
}
"""


def fma_peak(reps: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "peak.c", Path(d) / "peak"
        src.write_text(PEAK_C)
        subprocess.run([cpu_gemm._compiler() or "cc", "-O3", "-march=native", str(src), "-o", str(exe)], check=True)
        runs = [subprocess.run(["taskset", "-c", "0", str(exe)], capture_output=True, text=True, check=True).stdout.split()
                for _ in range(reps)]
    gflops = [float(r[0]) for r in runs]
    return {"gflop_s": statistics.median(gflops), "min": min(gflops), "max": max(gflops), "vector_bits": int(runs[0][1])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--shapes", default="1x9,8x9,16x9")
    a = ap.parse_args()
    out: dict = {"command": "python scripts/flop_ceiling_probe.py " + " ".join(sys.argv[1:])}
    out["peak"] = fma_peak(a.reps)

    import torch

    from specdec import models
    from specdec.lab.steps import VARIANTS, load, median_ms, time_shape
    from specdec.serving.paged_llama import linear

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    runner = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, max(b for b, _ in shapes))
    matrices = runner.weights.matrices()
    elements = sum(m.numel() if isinstance(m, torch.Tensor) else m.in_features * m.out_features for m in matrices)
    out["matmul_elements"] = elements
    out["shapes"] = {}
    peak = out["peak"]["gflop_s"]
    for b, n in shapes:
        flop = 2 * elements * b * n
        ms = [time_shape(runner, b, n, a.runs) for _ in range(a.reps)]
        xs = [torch.randn(b * n, m.shape[0] if isinstance(m, torch.Tensor) else m.in_features) for m in matrices]
        mm = [median_ms(lambda: [linear(x, m) for x, m in zip(xs, matrices)], reps=a.runs, warmup=1)
              for _ in range(a.reps)]
        step, alone = statistics.median(ms), statistics.median(mm)
        out["shapes"][f"{b}x{n}"] = {
            "step_ms": round(step, 1), "step_ms_min": round(min(ms), 1), "step_ms_max": round(max(ms), 1),
            "step_gflop_s": round(flop / step / 1e6, 1), "step_of_peak": round(flop / step / 1e6 / peak, 2),
            "matmuls_ms": round(alone, 1), "matmuls_gflop_s": round(flop / alone / 1e6, 1),
            "matmuls_of_peak": round(flop / alone / 1e6 / peak, 2), "rest_of_step": round(1 - alone / step, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
