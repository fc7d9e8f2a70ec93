"""One linear layer of the default target (576 -> 1536, SmolLM2-135M's MLP up-projection), fp32
against bf16, for 1 row (a decode) and 9 rows (a k = 8 verify); one thread, median ms of 200.

    python scripts/matmul_dtype_probe.py        # BENCHMARKS.md §6n
"""
import statistics
import time

import torch

torch.set_num_threads(1)
print("torch CPU capability:", torch.backends.cpu.get_cpu_capability())
for rows in (1, 9):
    for dtype in (torch.float32, torch.bfloat16):
        w, x = torch.randn(1536, 576, dtype=dtype), torch.randn(rows, 576, dtype=dtype)
        times = []
        for i in range(220):
            t0 = time.perf_counter()
            x @ w.T
            if i >= 20:
                times.append((time.perf_counter() - t0) * 1e3)
        print(f"{rows} rows {str(dtype).removeprefix('torch.')}: {statistics.median(times):.3f} ms")
