"""How often a pipelined speculation's guess of the bonus token was right, per study cell.

    python scripts/guess_rate.py bench-results/study-t1-permode/study.json [more study.json ...]

Reads the per-round records a `specdec study` writes (the full-length request of each prompt
and run): among rounds with drafts, those that accepted every draft with a speculation running
(its tokens were wasted, or the next round used them), and of those, how many found the bonus
token guessed (the next round is a pipeline hit). A fully accepted round that started no
speculation (the next k was 0, or the request was ending) is no guess. Also the k chosen per
round (adaptive k) and the rounds that used speculated drafts (hits).
"""
from __future__ import annotations

import collections
import json
import sys


def guess_rates(study: dict) -> dict[str, dict]:
    fields = study["round_fields"]
    k_at, acc_at, wasted_at, hit_at = (fields.index(f) for f in ("k", "accepted", "wasted_draft_tokens",
                                                                 "pipeline_hit"))
    longest = max(q["length"] for q in study["requests"])
    out: dict[str, dict] = {}
    for q in study["requests"]:
        if q["length"] != longest or "pipelined" not in q["cell"]:
            continue
        c = out.setdefault(q["cell"], {"rounds": 0, "all_accepted": 0, "guessed": 0, "hits": 0,
                                       "k": collections.Counter()})
        rounds = q["rounds"]
        for i, r in enumerate(rounds):
            c["k"][r[k_at]] += 1
            if r[k_at] == 0:
                continue
            c["rounds"] += 1
            c["hits"] += bool(r[hit_at])
            next_hit = i + 1 < len(rounds) and bool(rounds[i + 1][hit_at])
            if r[acc_at] == r[k_at] and (r[wasted_at] > 0 or next_hit):
                c["all_accepted"] += 1
                c["guessed"] += next_hit
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            rates = guess_rates(json.load(f))
        print(path)
        for cell, c in rates.items():
            g = c["guessed"] / c["all_accepted"] if c["all_accepted"] else float("nan")
            print(f"  {cell}: rounds with drafts {c['rounds']}, all accepted with a guess {c['all_accepted']}, "
                  f"guess right {c['guessed']} ({g:.2f}), hits {c['hits']}, k chosen {dict(sorted(c['k'].items()))}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench-results/study/study.json"])
