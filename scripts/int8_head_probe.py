"""The int4 draft's int8 output head against its bf16 head (BENCHMARKS.md §6f, paged_llama.SMALL_HEAD_ROWS).

    python scripts/int8_head_probe.py [--prompts 8]

1. One head matmul (49,152 x 576, one thread, the layouts the paged runner keeps: bf16 [V, hidden]
   through a transposed view, int8 codes [V, hidden] with a scale per row), median ms per row count.
2. Top-1 agreement with the fp32 target: the int4 draft with 8-bit activations (the default before §6q) with each
   head, over every position of 8 seed-0 ShareGPT/HumanEval prompts (up to 400 tokens each),
   against the fp32 target's argmax at the same positions; the int8 head also in torch's kernels
   (cpu_kernels = torch: bf16 activations), against specdec's (the default: int8 activations).
   Prints one JSON object.
"""
import argparse
import json
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import hf_compat, models  # noqa: E402
from specdec.lab.steps import VARIANTS, argmax_per_position, load, median_ms  # noqa: E402
from specdec.lab.workloads import mixed_workload  # noqa: E402
from specdec.serving.int4 import Int8Weight  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
a = ap.parse_args()
torch.set_num_threads(1)


w = torch.randn(576, 49152) * 0.05  # [in, out]
bf16 = w.t().contiguous().to(torch.bfloat16).t()  # [in, out], a view of [V, hidden]
int8 = Int8Weight.quantize(w)
matmul_ms = {}
for rows in (1, 2, 4, 6, 8, 16):
    x = torch.randn(rows, 576).to(torch.bfloat16)
    matmul_ms[rows] = {"int8": median_ms(lambda: int8.matmul(x)), "bf16": median_ms(lambda: torch.matmul(x, bf16))}

target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
drafts = {"int8": load(VARIANTS["torch-int4-x8"], models.DEFAULT_DRAFT_MODEL, 2),
          "bf16": load(VARIANTS["torch-int4-bf16-head"], models.DEFAULT_DRAFT_MODEL, 2),
          # the int8 head in torch's kernels (bf16 activations) rather than specdec's (int8 activations)
          "int8, cpu_kernels=torch": load(VARIANTS["torch-int4-torch"], models.DEFAULT_DRAFT_MODEL, 2)}




tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
agree, positions = dict.fromkeys(drafts, 0), 0
for p in mixed_workload(a.prompts, 0):
    ids = hf_compat.chat_token_ids(tok, p.messages)[:400]
    ref = argmax_per_position(target, ids)
    for name, runner in drafts.items():
        agree[name] += int((argmax_per_position(runner, ids) == ref).sum())
    positions += len(ids)
print(json.dumps({"command": "python scripts/int8_head_probe.py " + " ".join(sys.argv[1:]),
                  "head_matmul_ms_by_rows": matmul_ms, "positions": positions,
                  "top1_agreement_with_fp32_target": {n: round(v / positions, 4) for n, v in agree.items()}}, indent=1))
