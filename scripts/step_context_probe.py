"""One step of the default pair's runners as the context grows, one thread (BENCHMARKS.md §6p).

    python scripts/step_context_probe.py [--contexts 8,100,300,600] [--reps 3]

For each context length C (a fresh sequence holding C tokens), ms per step, each median of 20
steps, --reps times (printed sorted, so min, median, max):
  - the default draft (the int4 runner on the shipped model, specdec's kernels): a one-token
    step, what a pipelined round's drafting is made of;
  - the default target (fp32 runner, specdec's kernels): one row (a target-only decode) and 9
    rows (a k = 8 verify), with the attention in specdec's kernel (the default where the AVX-512
    VNNI library builds) and, as `sdpa`, with gather + SDPA (runner.c_attention off).
The script only uses the runners' public calls, so the same file can be run against an older
commit (`git worktree add /tmp/old COMMIT && cd /tmp/old && python /path/to/this/file`; the
`sdpa` rows need a commit that has `c_attention`). Prints one JSON object.
"""
import argparse
import json
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import models  # noqa: E402
from specdec.lab.steps import VARIANTS, load, median_ms  # noqa: E402
from specdec.serving.batch import SeqChunk  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--contexts", default="8,100,300,600")
ap.add_argument("--reps", type=int, default=3)
a = ap.parse_args()
torch.set_num_threads(1)
contexts = [int(c) for c in a.contexts.split(",")]


def steps_ms(runner, rows: int) -> dict[int, list[float]]:
    """{context: sorted ms of --reps medians} for steps of `rows` new tokens."""
    out = {}
    for ctx in contexts:
        s = runner.blocks.reserve(ctx + rows + 16)
        runner.forward([SeqChunk(s, [100 + i % 1000 for i in range(ctx)], 0, 1)])

        def step():
            runner.forward([SeqChunk(s, list(range(500, 500 + rows)), ctx, rows)])
            runner.truncate(s, ctx)

        out[ctx] = sorted(round(median_ms(step, 20), 2) for _ in range(a.reps))
        runner.free(s)
    return out


draft = load(VARIANTS["torch-int4"], models.DEFAULT_DRAFT_MODEL, 2)
result = {"command": "python scripts/step_context_probe.py " + " ".join(sys.argv[1:]),
          "draft, 1 token": steps_ms(draft, 1)}
del draft
target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
for rows in (1, 9):
    result[f"target, {rows} rows"] = steps_ms(target, rows)
if getattr(target, "c_attention", False):
    target.c_attention = False
    for rows in (1, 9):
        result[f"target, {rows} rows, sdpa"] = steps_ms(target, rows)
print(json.dumps(result, indent=1))
