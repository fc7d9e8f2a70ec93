"""How often the int4 draft picks the fp32 target's next token, and what its steps cost, per variant (BENCHMARKS §6q).

    python scripts/draft_agreement_probe.py [--prompts 8] [--variants torch-int4-x8,torch-int4-x16]

The fp32 target and each draft variant (specdec.lab.steps.VARIANTS, built as the services build
them) are fed the same seed-0 ShareGPT/HumanEval prompts (chat template, up to 400 tokens) 4
tokens a step with logits for all 4; top-1 agreement = the share of positions where the draft's
argmax is the target's. Step times: one sequence of 1 token and of 9 tokens after 300 cached
tokens (median ms, one thread). Prints one JSON object.
"""
import argparse
import json
import sys

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import hf_compat, models  # noqa: E402
from specdec.lab.steps import VARIANTS, argmax_per_position, load, time_shape  # noqa: E402
from specdec.lab.workloads import mixed_workload  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--variants", default="torch-int4-x8,torch-int4-x16")
a = ap.parse_args()
torch.set_num_threads(1)




target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
drafts = {n: load(VARIANTS[n], models.DEFAULT_DRAFT_MODEL, 2) for n in a.variants.split(",")}
steps = {n: {"1 token": time_shape(r, 1, 1, 30), "9 tokens": time_shape(r, 1, 9, 20)} for n, r in drafts.items()}
tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
agree, positions = dict.fromkeys(drafts, 0), 0
for p in mixed_workload(a.prompts, 0):
    ids = hf_compat.chat_token_ids(tok, p.messages)[:400]
    ref = argmax_per_position(target, ids)
    for name, runner in drafts.items():
        agree[name] += int((argmax_per_position(runner, ids) == ref).sum())
    positions += len(ids)
print(json.dumps({"command": "python scripts/draft_agreement_probe.py " + " ".join(sys.argv[1:]),
                  "positions": positions, "step_ms_at_300_keys": steps,
                  "top1_agreement_with_fp32_target": {n: round(v / positions, 4) for n, v in agree.items()}}, indent=1))
