"""How often a pipelined speculation's guess of the bonus token was right, per study cell.

    python scripts/guess_rate.py bench-results/study-t1-permode/study.json [more study.json ...]

Reads the per-round records a `specdec study` writes (the full-length request of each prompt
and run): among rounds with drafts, those that accepted every draft with a speculation running,
and of those, how many found the bonus token guessed (no draft tokens wasted). Also the k
chosen per round (adaptive k) and the rounds that used speculated drafts (hits).
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
        for r in q["rounds"]:
            c["k"][r[k_at]] += 1
            if r[k_at] == 0:
                continue
            c["rounds"] += 1
            c["hits"] += bool(r[hit_at])
            if r[acc_at] == r[k_at]:
                c["all_accepted"] += 1
                c["guessed"] += r[wasted_at] == 0
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        with open(path) as f:
            rates = guess_rates(json.load(f))
        print(path)
        for cell, c in rates.items():
            g = c["guessed"] / c["all_accepted"] if c["all_accepted"] else float("nan")
            print(f"  {cell}: rounds with drafts {c['rounds']}, all accepted {c['all_accepted']}, "
                  f"guess right {c['guessed']} ({g:.2f}), hits {c['hits']}, k chosen {dict(sorted(c['k'].items()))}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bench-results/study/study.json"])
