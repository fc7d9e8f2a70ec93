"""What adaptive k's probes cost, per study cell with adaptive k.

    python scripts/probe_cost.py bench-results/study-t1-adaptive5/study.json [more study.json ...]

Reads the per-round records of a `specdec study` (the full-length request of each prompt and
run). A probe is a round with drafts right after a round without. Per cell: the share of the
wall time spent in probes beyond what their tokens would cost at the cell's mean k = 0 round
time (the probes' overhead), and the probes' draft ms by the number of k = 0 rounds before
them (their proposal feeds the draft what was committed meanwhile).
"""
from __future__ import annotations

import collections
import json
import statistics
import sys


def probe_costs(study: dict) -> dict[str, dict]:
    f = study["round_fields"]
    longest = max(q["length"] for q in study["requests"])
    out: dict[str, dict] = {}
    for q in study["requests"]:
        if q["length"] != longest or "adaptive" not in q["cell"]:
            continue
        c = out.setdefault(q["cell"], {"total_ms": 0.0, "k0_ms": [], "probes": [], "gap_draft_ms":
                                       collections.defaultdict(list)})
        rounds = [dict(zip(f, r)) for r in q["rounds"]]
        c["total_ms"] += sum(r["round_ms"] for r in rounds)
        c["k0_ms"] += [r["round_ms"] for r in rounds if r["k"] == 0]
        gap = 0
        for r in rounds:
            if r["k"] == 0:
                gap += 1
                continue
            if gap:
                c["probes"].append((r["round_ms"], r["accepted"] + 1))
                c["gap_draft_ms"][min(gap, 64) // 8 * 8].append(r["draft_ms"])
            gap = 0
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        print(path)
        for cell, c in probe_costs(json.load(open(path))).items():
            if not c["k0_ms"] or not c["probes"]:
                print(f"  {cell}: no probes")
                continue
            k0 = statistics.mean(c["k0_ms"])
            over = sum(ms - n * k0 for ms, n in c["probes"])
            gaps = ", ".join(f"{g}+: {statistics.median(v):.0f} ms ({len(v)})" for g, v in sorted(c["gap_draft_ms"].items()))
            print(f"  {cell}: {len(c['probes'])} probes, overhead {over / 1e3:.1f} s of {c['total_ms'] / 1e3:.1f} s "
                  f"({100 * over / c['total_ms']:.1f}%), k = 0 round {k0:.0f} ms; probe draft ms by rounds "
                  f"without drafts before it: {gaps}")


if __name__ == "__main__":
    main(sys.argv[1:])
