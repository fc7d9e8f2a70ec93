"""Would a vocabulary-trimmed draft head (FR-Spec) pay on the default pair? (BENCHMARKS.md §6k)

    python scripts/vocab_trim_probe.py [--prompts 8] [--new-tokens 128]

The int4 draft's int8 output head reads 49,152 x 576 bytes per step. FR-Spec keeps only the most
frequent vocabulary rows in the draft's head: a cheaper step, but a draft that can never propose a
token outside the kept rows. Exactness does not change (the target verifies every token, and a
sampled draft's q is zero outside the kept rows), only speed. This measures both sides, one thread:

1. One int8 head matmul for one row (a draft step), median ms, for each kept size.
2. Frequencies: tokens of the ShareGPT replies of conversations 0-1999 (the target's tokenizer).
3. Top-1 agreement of the default draft (paged runner, int4, int8 head) with the fp32 target over
   the target's own greedy continuations (`--new-tokens` after each of `--prompts` seed-0
   ShareGPT/HumanEval prompts, chat template): the draft's argmax over the whole vocabulary, and
   restricted to each kept set (its logits elsewhere masked: what a trimmed head proposes).
4. The draft's one-token step (median ms after 300 cached tokens: specdec.lab.steps.time_shape),
   and the cost model's consequence on a draft-bound pipeline (the draft's k + 1 steps per round
   longer than the verify, as on this machine): tokens per round E(8) at the measured agreement,
   over (k + 1) draft steps of the step time less the head's saving, against the full head.
Prints one JSON object.
"""
import argparse
import json
import sys
from collections import Counter

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import hf_compat, models  # noqa: E402
from specdec.kchoice import expected_tokens  # noqa: E402
from specdec.lab import workloads  # noqa: E402
from specdec.lab.steps import VARIANTS, load, median_ms, time_shape  # noqa: E402
from specdec.serving.batch import SeqChunk  # noqa: E402
from specdec.serving.int4 import Int8Weight  # noqa: E402

V = 49152  # SmolLM2's vocabulary
KEPT = (V, 32768, 24576, 16384, 8192)
K = 8

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--new-tokens", type=int, default=128)
a = ap.parse_args()
torch.set_num_threads(1)


# 1. the head matmul, one row, per kept size
w = torch.randn(576, V) * 0.05  # [hidden, V]
x = torch.randn(1, 576).to(torch.bfloat16)  # [1, hidden]
head_ms = {}
for n in KEPT:
    head = Int8Weight.quantize(w[:, :n])
    head_ms[n] = median_ms(lambda: head.matmul(x), reps=30)

# 2. frequencies from ShareGPT replies (not the benchmark's prompts, not the model's outputs)
tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
freq: Counter = Counter()
for i, conv in enumerate(workloads.iter_json_array(workloads.sharegpt_path())):
    if i >= 2000:
        break
    for turn in (conv.get("conversations") or ()) if isinstance(conv, dict) else ():
        if isinstance(turn, dict) and turn.get("from") == "gpt":
            freq.update(tok(turn.get("value") or "", add_special_tokens=False)["input_ids"])
ranked = [t for t, _ in freq.most_common()]
kept_masks = {}
for n in KEPT:
    m = torch.zeros(V, dtype=torch.bool)  # [V]: True = kept
    m[torch.tensor(ranked[:n] if n < V else range(V))] = True
    kept_masks[n] = m

# 3. agreement over the target's own greedy continuations
target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
draft = load(VARIANTS["torch-int4"], models.DEFAULT_DRAFT_MODEL, 2)


def continuation(ids: list[int], n: int) -> list[int]:
    s = target.blocks.reserve(len(ids) + n + 8)
    (logits,) = target.forward([SeqChunk(s, ids, 0, 1)])  # [1, V]
    out = []
    for i in range(n):
        out.append(int(logits[-1].argmax()))
        (logits,) = target.forward([SeqChunk(s, [out[-1]], len(ids) + i, 1)])
    target.free(s)
    return out


agree, positions = dict.fromkeys(KEPT, 0), 0
for p in workloads.mixed_workload(a.prompts, 0):
    ids = hf_compat.chat_token_ids(tok, p.messages)[:400]
    new = continuation(ids, a.new_tokens)
    s = draft.blocks.reserve(len(ids) + len(new) + 8)
    draft.forward([SeqChunk(s, ids[:-1], 0, 1)])
    seq = ids[-1:] + new[:-1]  # the draft sees the prompt's last token, then the target's tokens
    for i in range(0, len(seq), 4):  # 4 logit rows a step: the int8 head (SMALL_HEAD_ROWS)
        chunk = seq[i:i + 4]
        (logits,) = draft.forward([SeqChunk(s, chunk, len(ids) - 1 + i, len(chunk))])  # [len(chunk), V]
        want = torch.tensor(new[i:i + len(chunk)])
        for n, m in kept_masks.items():
            agree[n] += int((logits.float().masked_fill(~m, float("-inf")).argmax(-1) == want).sum())
    draft.free(s)
    positions += len(new)

# 4. the draft's step, and the draft-bound pipeline's tokens per ms at k = 8
step_ms = time_shape(draft, 1, 1, 30)  # one sequence, one new token, after CONTEXT cached tokens
rate = {}
for n in KEPT:
    acc = agree[n] / positions
    d = step_ms - (head_ms[V] - head_ms[n])
    rate[n] = {"agreement": round(acc, 4), "step_ms": round(d, 2), "E8": round(expected_tokens([acc], K), 2),
               "tokens_per_s_draft_bound": round(1e3 * expected_tokens([acc], K) / ((K + 1) * d), 1)}
full = rate[V]["tokens_per_s_draft_bound"]
for n in KEPT:
    rate[n]["vs_full_head"] = round(rate[n]["tokens_per_s_draft_bound"] / full, 3)
print(json.dumps({"command": "python scripts/vocab_trim_probe.py " + " ".join(sys.argv[1:]),
                  "cpu": torch.backends.cpu.get_cpu_capability(),
                  "positions": positions, "head_matmul_ms_one_row": head_ms, "draft_step_ms": step_ms,
                  "by_kept_rows": rate}, indent=1))
