"""Does the fp32 target come back bit for bit from Q4_1 codes? (BENCHMARKS.md §6r)

    python scripts/q4_1_exact_probe.py

The default target is the shipped Q4_1 GGUF dequantized to float32. For every decoder matrix,
pack it on the Q4_1 grid (`PackedInt4Weight.quantize`: per group of 32 inputs, float16 d and lo,
codes 0..15) and compare `dense()` (d * q + lo in float32; d * q is exact, so one FMA gives the
same value) with the float32 weight. All equal means a kernel that reads the codes and
dequantizes them in registers computes the fp32 target's numbers exactly, reading a sixth of
the bytes. Prints one line.
"""
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import models  # noqa: E402
from specdec.serving.cpu_gemm import PackedInt4Weight  # noqa: E402

model = models.load_model(models.resolve(models.DEFAULT_TARGET_MODEL), "float32", "cpu")
total = same = 0
for name, p in model.named_parameters():
    if p.dim() == 2 and ".layers." in name:
        w = p.detach().t().contiguous()  # [in, out]
        total += 1
        same += int(torch.equal(PackedInt4Weight.quantize(w).dense(), w))
print(f"{same} of {total} decoder matrices of {models.DEFAULT_TARGET_MODEL} come back bit for bit from their Q4_1 codes")
