"""Would a second speculative branch pay (issue 11, item 3)? Offline, on the default pair.

    python scripts/miss_branch_probe.py [--prompts 8] [--new-tokens 160] [--ks 4,6,8]

The fp32 target decodes each prompt greedily; the default draft (int4 paged runner) is then fed
prompt + that continuation in one pass (teacher forcing: up to a round's first rejection this
is exactly what the draft sees when it drafts). Pipelined rounds of k drafts are replayed on
it. A *miss* is a round whose speculation cannot be used: a rejection at position j (the
target's token differs from the draft's), or all k accepted but the draft's guess of the
bonus token wrong. A second branch drafting "rejection at j*, the draft's runner-up token
there" would have turned a rejection into a hit when j* = j and the runner-up is the target's
token. Several rules for j* are scored. Then the cost of carrying the branch is measured on
the draft runner (one thread, as the service runs): a step of 1 sequence against 2, and one
with the branch's catch-up chunk. Prints one JSON object.
"""
import argparse
import json
import math
import statistics
import sys
import time

sys.path.insert(0, ".")
import torch  # noqa: E402

from specdec import hf_compat, models  # noqa: E402
from specdec.lab.steps import VARIANTS, load  # noqa: E402
from specdec.lab.workloads import mixed_workload  # noqa: E402
from specdec.serving.batch import SeqChunk  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--new-tokens", type=int, default=160)
ap.add_argument("--ks", default="4,6,8")
ap.add_argument("--draft", default="torch-int4", choices=sorted(VARIANTS))
a = ap.parse_args()
torch.set_num_threads(1)


def feed(runner, ids: list[int], logit_rows: int, room: int = 0):
    """A fresh sequence fed `ids` in 128-token chunks -> (seq, logits of the last logit_rows positions)."""
    s = runner.blocks.reserve(len(ids) + room + 8)
    out = []
    for i in range(0, len(ids), 128):
        chunk = ids[i:i + 128]
        n = max(0, min(len(chunk), i + len(chunk) - (len(ids) - logit_rows)))
        logits = runner.forward([SeqChunk(s, chunk, i, n)])[0]
        if n:
            out.append(logits.float())
    return s, torch.cat(out)


tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
draft = load(VARIANTS[a.draft], models.DEFAULT_DRAFT_MODEL, 2)
segments = []  # per prompt: [(draft top1, p1, draft top2, p2, target token)] per output position
for p in mixed_workload(a.prompts, 0):
    ids = hf_compat.chat_token_ids(tok, p.messages)[:400]
    s, logits = feed(target, ids, 1, a.new_tokens)
    seq, nxt = list(ids), int(logits[-1].argmax())
    for _ in range(a.new_tokens):
        seq.append(nxt)
        nxt = int(target.forward([SeqChunk(s, [nxt], len(seq) - 1, 1)])[0][-1].argmax())
    target.free(s)
    cont = seq[len(ids):]
    s, dl = feed(draft, seq, len(cont) + 1)
    draft.free(s)
    top = torch.softmax(dl[:-1], -1).topk(2, -1)  # row i: the draft's prediction of cont[i]
    segments.append([(int(top.indices[i, 0]), float(top.values[i, 0]), int(top.indices[i, 1]),
                      float(top.values[i, 1]), cont[i]) for i in range(len(cont))])

RULES = {
    "min margin (largest p2/p1)": lambda r, j: r[j][3] / r[j][1],
    "most likely outcome (prod p1 before j, p2 at j)": lambda r, j: math.prod(x[1] for x in r[:j]) * r[j][3],
    "first flip (flip = p2/(p1+p2))": lambda r, j: math.prod(1 - x[3] / (x[1] + x[3]) for x in r[:j]) * r[j][3] / (r[j][1] + r[j][3]),
}
replay = {}
for k in [int(x) for x in a.ks.split(",")]:
    rounds = accepted = rejections = wrong_bonus = runner_up_right = 0
    hits = dict.fromkeys(RULES, 0)
    for seg in segments:
        t = 0
        while t + k + 1 <= len(seg):
            r = seg[t:t + k + 1]
            m = next((i for i in range(k) if r[i][0] != r[i][4]), k)
            rounds += 1
            accepted += m
            if m < k:
                rejections += 1
                runner_up_right += r[m][2] == r[m][4]
                for name, score in RULES.items():
                    j = max(range(k), key=lambda j: score(r, j))
                    hits[name] += j == m and r[m][2] == r[m][4]
            elif r[k][0] != r[k][4]:
                wrong_bonus += 1
            t += m + 1
    misses = rejections + wrong_bonus
    replay[k] = {"rounds": rounds, "accepted_per_round": round(accepted / rounds, 2),
                 "misses_per_round": round(misses / rounds, 3), "rejections": rejections, "wrong_bonus": wrong_bonus,
                 "runner_up_is_the_target_token_at_a_rejection": round(runner_up_right / max(1, rejections), 3),
                 "branch_hits_share_of_misses": {n: round(h / max(1, misses), 3) for n, h in hits.items()}}


def step_ms(shape: tuple[int, ...], reps: int = 12) -> float:
    seqs = [draft.blocks.reserve(400) for _ in shape]
    ctx = [(100 + 13 * i) % 20000 + 50 for i in range(300)]
    for s in seqs:
        for i in range(0, 300, 128):
            draft.forward([SeqChunk(s, ctx[i:i + 128], i, 0)])
    times = []
    for r in range(reps):
        chunks = [SeqChunk(s, [500 + r + q for q in range(n)], 300, 1) for s, n in zip(seqs, shape)]
        t0 = time.perf_counter()
        draft.forward(chunks)
        times.append((time.perf_counter() - t0) * 1e3)
        for s in seqs:
            draft.truncate(s, 300)
    for s in seqs:
        draft.free(s)
    return round(statistics.median(times[2:]), 1)


costs = {"1 sequence x 1 token": step_ms((1,)), "2 sequences x 1 token": step_ms((1, 1)),
         "1 x 1 + a 10-token catch-up chunk": step_ms((1, 10))}
print(json.dumps({"command": "python scripts/miss_branch_probe.py " + " ".join(sys.argv[1:]), "draft": a.draft,
                  "prompts": a.prompts, "new_tokens": a.new_tokens, "replay": replay, "draft_step_ms": costs}, indent=1))
