"""The lab's statistics: pure functions over measured requests (tested on hand-made numbers in
tests/test_stats.py); no models, no services, no files.

A measured request (`specdec.lab.live.LiveStack.request`) is a dict, as stored in study.json:
`tokens`, `seconds` (wall time seen by the client), `run`, `stats` (the server's summary fields
of `live.STAT_FIELDS`), `rounds` (one dict per round: the fields of `ROUND_FIELDS` and more) and
`marks` (one [seconds, tokens so far, rounds so far] per streamed chunk).

Definitions:
- spread over runs: median / min / max and spread % = (max - min) / median;
- per-position counts come from the rounds (`specdec.stats.position_counts`);
- E(k), the expected tokens per round, the ideal decode rate and the efficiency: see
  `expected_tokens_per_round`, `ideal_tok_s` and `ideal_bound`;
- a pipelined round is a *hit* when its drafts were reused from the previous round's
  speculation, as the orchestrator recorded it (the round's `pipeline_hit`).
"""
from __future__ import annotations

import statistics

from specdec.modes import Mode
from specdec.stats import RoundRecord, position_counts

# the per-round fields study.json keeps, one compact row per round (its "round_fields" names them)
ROUND_FIELDS = ("k", "accepted", "draft_ms", "verify_ms", "overlap_ms", "wasted_draft_tokens", "rpc_ms", "round_ms",
                "draft_available", "pipeline_hit")
EFFICIENCY_TARGET = 0.9
SPECULATIVE = (Mode.PIPELINED.label, Mode.SEQUENTIAL.label)  # the modes that draft


def spread(values: list[float]) -> dict:
    """median / min / max / spread % = (max - min) / median, over runs."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0, "spread_pct": 0.0, "n": 0}
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0, "n": len(values)}


def expected_tokens_per_round(accepted_by_position: list[int], drafted_by_position: list[int], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} P(the first i drafts are all accepted).

    accepted_by_position[j] counts rounds that accepted more than j drafts (the accepted drafts
    are a prefix), so accepted[j] / drafted[j] estimates P(first j+1 accepted). Positions never
    drafted count as 0.
    """
    e = 1.0
    for j in range(k):
        d = drafted_by_position[j] if j < len(drafted_by_position) else 0
        a = accepted_by_position[j] if j < len(accepted_by_position) else 0
        e += a / d if d else 0.0
    return e


def ideal_round_ms(mode: str, k: int, d: float, t: float) -> float:
    """The ideal round: sequential k d + T; pipelined max(T, (k+1) d); target-only T."""
    m = Mode.parse(mode)
    if m == Mode.SEQUENTIAL:
        return k * d + t
    if m == Mode.PIPELINED:
        return max(t, (k + 1) * d)
    return t


def ideal_tok_s(mode: str, k: int, draft_ms_per_token: float, verify_ms: float, expected_tokens: float) -> float:
    """Ideal decode rate (tok/s): sequential E / (k d + T); pipelined E / max(T, (k+1) d)."""
    round_ms = ideal_round_ms(mode, k, draft_ms_per_token, verify_ms)
    if Mode.parse(mode) == Mode.TARGET_ONLY:
        expected_tokens = 1.0
    return 1e3 * expected_tokens / round_ms if round_ms > 0 else 0.0


def round_records(rounds: list[dict]) -> list[RoundRecord]:
    """Round dicts as the core's records (only what position counts need: k and accepted)."""
    return [RoundRecord(k=int(r["k"]), accepted=int(r["accepted"])) for r in rounds]


def position_curve(requests: list[dict]) -> dict:
    """Acceptance by draft position over requests: the per-position counts of all their rounds."""
    acc, dr = position_counts(round_records([rd for r in requests for rd in r["rounds"]]))
    return {"accepted_by_position": acc, "drafted_by_position": dr,
            "acceptance_by_position": [a / b if b else 0.0 for a, b in zip(acc, dr)]}


def prefix_record(rec: dict, length: int) -> dict:
    """The first `length` tokens of a measured request, as if it had asked for `length` tokens.

    `rec["marks"]` holds one [seconds since the request was sent, tokens so far, rounds so far]
    per streamed chunk. The prefix ends with the chunk that delivered token `length`: seconds =
    that chunk's arrival (what a client asking for `length` tokens would have waited, give or
    take the last round, which is not shortened to fit), rounds = the rounds up to it, and the
    summary fields the study reads are recomputed from those rounds. The record is marked
    `prefix_of` (the full request's length), so that it is never counted twice.
    """
    marks = rec["marks"]
    end = next((m for m in marks if m[1] >= length), None)
    if end is None:
        raise ValueError(f"request produced {rec['tokens']} tokens, fewer than the prefix {length}")
    first = next(m for m in marks if m[1] >= 1)
    rounds = rec["rounds"][: end[2]]
    accepted, drafted = position_counts(round_records(rounds))
    stats = dict(rec["stats"])
    stats.update(completion_tokens=length, total_ms=float(stats["ttft_ms"]) + 1e3 * (end[0] - first[0]),
                 rounds=len(rounds), draft_tokens=sum(drafted), accepted_tokens=sum(accepted),
                 accepted_by_position=accepted, drafted_by_position=drafted,
                 wasted_draft_tokens=sum(int(r["wasted_draft_tokens"]) for r in rounds),
                 draft_fallback_rounds=sum(1 for r in rounds if not r.get("draft_available", True)))
    return dict(rec, tokens=length, seconds=end[0], stats=stats, rounds=rounds, marks=marks[: marks.index(end) + 1],
                prefix_of=rec["tokens"])


def full_requests(records: list[dict]) -> list[dict]:
    """The requests as measured (prefix records left out)."""
    return [r for r in records if "prefix_of" not in r]


def compact_rounds(rounds: list[dict]) -> list[list]:
    return [[_num(r.get(f, 0)) for f in ROUND_FIELDS] for r in rounds]


def expand_rounds(rows: list[list], fields: tuple[str, ...] | list[str] = ROUND_FIELDS) -> list[dict]:
    """Compact rows back into round dicts; `fields` names the columns (a study.json's round_fields)."""
    return [dict(zip(fields, row)) for row in rows]


def _num(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, float):
        return round(v, 4)
    return v


def round_time_split(requests: list[dict], mode: str, draft_ms_per_token: float = 0.0) -> dict:
    """Mean ms per round: draft (on the critical path), verify, RPC, idle; and the miss analysis.

    Per request (rounds in order):
    - sequential: the draft is on the critical path: draft_ms;
    - pipelined: a round that reuses the drafts made during the previous verify (a *hit*, as
      recorded in its `pipeline_hit`) exposes only draft_ms - (previous round's overlap_ms); any
      other round with drafts (a *miss*: redraft after a rejection, a wrong bonus guess or an
      empty speculative proposal, or the first round) waits for its whole draft_ms;
    - a miss also waits for the thrown-away speculative draft to finish; estimated as
      max(0, wasted * d - verify_ms - rpc_ms) per round with wasted tokens;
    - idle = decode time per round - draft - verify - RPC (draft round trips, orchestrator work,
      streaming the chunk between rounds).
    `requests` carry `stats` (ttft_ms, total_ms) and `rounds` (dicts).
    """
    pipelined = mode == Mode.PIPELINED.label
    n = 0
    verify = rpc = exposed = miss_draft = hit_draft = wasted_tail = round_ms = 0.0
    misses = hits = drafting = wasted = 0
    decode_ms = 0.0
    for req in requests:
        rounds = req["rounds"]
        decode_ms += max(0.0, float(req["stats"]["total_ms"]) - float(req["stats"]["ttft_ms"]))
        prev = None
        for r in rounds:
            n += 1
            verify += r["verify_ms"]
            rpc += r["rpc_ms"]
            round_ms += r["round_ms"]
            wasted += r["wasted_draft_tokens"]
            if r["k"] > 0:
                drafting += 1
                if pipelined and prev is not None and r.get("pipeline_hit"):
                    hits += 1
                    e = max(0.0, r["draft_ms"] - prev["overlap_ms"])
                    hit_draft += e
                else:
                    misses += 1 if pipelined else 0
                    e = r["draft_ms"]
                    miss_draft += e if pipelined else 0.0
                exposed += e
            if r["wasted_draft_tokens"] and draft_ms_per_token:
                wasted_tail += max(0.0, r["wasted_draft_tokens"] * draft_ms_per_token - r["verify_ms"] - r["rpc_ms"])
            prev = r
    if n == 0:
        return {"rounds": 0}
    per = decode_ms / n
    out = {
        "rounds": n, "drafting_rounds": drafting, "hits": hits, "misses": misses,
        "decode_ms_per_round": per, "round_ms": round_ms / n, "between_rounds_ms": per - round_ms / n,
        "verify_ms": verify / n, "rpc_ms": rpc / n, "draft_ms": exposed / n,
        "miss_draft_ms": miss_draft / n, "hit_draft_ms": hit_draft / n, "wasted_tail_ms": wasted_tail / n,
        "wasted_draft_tokens_per_round": wasted / n,
    }
    out["idle_ms"] = per - out["verify_ms"] - out["rpc_ms"] - out["draft_ms"]
    return out


def aggregate(requests: list[dict], mode: str, k: int) -> dict:
    """Statistics of one cell (one output length, or all): tok/s per run, acceptance, timings."""
    by_run: dict[int, list[dict]] = {}
    for r in requests:
        by_run.setdefault(r["run"], []).append(r)
    tok_s_runs = [sum(x["tokens"] for x in rs) / sum(x["seconds"] for x in rs)
                  for _, rs in sorted(by_run.items()) if sum(x["seconds"] for x in rs) > 0]
    stats = [r["stats"] for r in requests]
    rounds = [rd for r in requests for rd in r["rounds"]]
    drafting = [rd for rd in rounds if rd["k"] > 0]
    drafted = sum(rd["k"] for rd in rounds)
    accepted = sum(rd["accepted"] for rd in rounds)
    d = sum(rd["draft_ms"] for rd in drafting) / drafted if drafted else 0.0
    at_k = [rd["verify_ms"] for rd in rounds if rd["k"] == (k if mode != Mode.TARGET_ONLY.label else 0)]
    verify_at_k = statistics.fmean(at_k) if at_k else (statistics.fmean([rd["verify_ms"] for rd in rounds])
                                                        if rounds else 0.0)
    decode_tokens = sum(max(0, int(s["completion_tokens"]) - 1) for s in stats)
    decode_ms = sum(max(0.0, float(s["total_ms"]) - float(s["ttft_ms"])) for s in stats)
    tokens = sum(r["tokens"] for r in requests)
    seconds = sum(r["seconds"] for r in requests)
    return {
        "requests": len(requests),
        "tok_s": spread(tok_s_runs),
        "tok_s_runs": tok_s_runs,
        "tok_s_all": tokens / seconds if seconds else 0.0,
        "decode_tok_s": 1e3 * decode_tokens / decode_ms if decode_ms else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_tokens": 1.0 + accepted / len(drafting) if drafting else 1.0,
        **position_curve(requests),
        "draft_ms_per_token": d,
        "verify_ms_at_k": verify_at_k,
        "ttft_ms_median": statistics.median(float(s["ttft_ms"]) for s in stats) if stats else 0.0,
        "wasted_draft_tokens": sum(int(s.get("wasted_draft_tokens", 0)) for s in stats),
        "draft_fallback_rounds": sum(int(s.get("draft_fallback_rounds", 0)) for s in stats),
        "time_split": round_time_split(requests, mode, d),
    }


def ideal_bound(agg: dict, mode: str, k: int, draft_ms_per_token: float | None = None) -> dict:
    """The ideal decode rate of a cell and its efficiency; below 0.9, the losses by size."""
    d = agg["draft_ms_per_token"] if draft_ms_per_token is None else draft_ms_per_token
    t = agg["verify_ms_at_k"]
    e = expected_tokens_per_round(agg["accepted_by_position"], agg["drafted_by_position"], k)
    ideal = ideal_tok_s(mode, k, d, t, e)
    measured = agg["decode_tok_s"]
    out = {"mode": mode, "k": k, "draft_ms_per_token": d, "verify_ms": t, "expected_tokens": e,
           "measured_tokens_per_round": agg["mean_accepted_tokens"], "ideal_round_ms": ideal_round_ms(mode, k, d, t),
           "ideal_tok_s": ideal, "measured_tok_s": measured,
           "efficiency": measured / ideal if ideal else 0.0,
           "draft_bound": mode == Mode.PIPELINED.label and (k + 1) * d > t}
    out["losses"] = loss_breakdown(agg["time_split"], mode, k, d, t)
    out["biggest_loss"] = describe_loss(out) if out["efficiency"] < EFFICIENCY_TARGET else ""
    return out


def loss_breakdown(split: dict, mode: str, k: int, d: float, t: float) -> list[dict]:
    """Where the measured round time goes beyond the ideal round, ms per round, largest first."""
    if not split.get("rounds"):
        return []
    losses = [{"name": "rpc", "ms": split["rpc_ms"], "what": "verify round trip minus verify compute"},
              {"name": "between_rounds", "ms": split["between_rounds_ms"],
               "what": "time between rounds (streaming the chunk, starting the next round)"}]
    if mode == Mode.PIPELINED.label:
        ideal_exposed = max(0.0, (k + 1) * d - t)
        losses += [
            {"name": "misses", "ms": split["miss_draft_ms"],
             "what": f"target waits for a redraft: {split['misses']} of {split['drafting_rounds']} drafting rounds "
                     f"were misses"},
            {"name": "hit_draft_exposed", "ms": max(0.0, split["hit_draft_ms"] - ideal_exposed),
             "what": "draft time on hit rounds not hidden behind the verify, beyond the ideal"},
            {"name": "wasted_spec_tail", "ms": split["wasted_tail_ms"],
             "what": f"waiting for thrown-away speculative drafts to finish (estimated; "
                     f"{split['wasted_draft_tokens_per_round']:.2f} wasted draft tokens per round)"},
        ]
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"] - split["draft_ms"] - split["wasted_tail_ms"]
    elif mode == Mode.SEQUENTIAL.label:
        losses.append({"name": "draft_beyond_kd", "ms": max(0.0, split["draft_ms"] - k * d),
                       "what": "draft time beyond k x d"})
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"] - split["draft_ms"]
    else:
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"]
    losses.append({"name": "in_round_overhead", "ms": max(0.0, inside),
                   "what": "inside the round beyond draft, verify and RPC (draft round trips, orchestrator work)"})
    return sorted(losses, key=lambda x: -x["ms"])


def describe_loss(ib: dict) -> str:
    if not ib["losses"]:
        return ""
    top = ib["losses"][0]
    measured_round = ib["measured_tokens_per_round"] / ib["measured_tok_s"] * 1e3 if ib["measured_tok_s"] else 0.0
    return (f"{top['name']}: {top['ms']:.2f} ms/round ({top['what']}); measured {measured_round:.2f} ms/round "
            f"at {ib['measured_tokens_per_round']:.2f} tokens/round vs ideal {ib['ideal_round_ms']:.2f} ms/round "
            f"at E={ib['expected_tokens']:.2f}")


def speedups(cell: dict, base: dict | None) -> dict:
    """Per output length: the spread of the per-run ratios of a cell's tok/s to `base`'s (same runs)."""
    if not base:
        return {}
    out = {}
    for L, agg in cell["by_length"].items():
        b = base["by_length"].get(L)
        runs = [x / y for x, y in zip(agg["tok_s_runs"], b["tok_s_runs"]) if y] if b else []
        out[L] = spread(runs)
    return out


def aggregate_summaries(summaries: list[dict]) -> dict:
    """The bench's figures over the request summaries of one system run (sums and medians)."""
    def tot(key):
        return sum(float(s.get(key, 0)) for s in summaries)

    rounds = tot("rounds")
    drafted = tot("draft_tokens")
    return {
        "acceptance_rate": tot("accepted_tokens") / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + tot("accepted_tokens") / rounds if rounds else 1.0,
        "ttft_ms_median": statistics.median(float(s.get("ttft_ms", 0)) for s in summaries),
        "tpot_ms_median": statistics.median(float(s.get("tpot_ms", 0)) for s in summaries),
        "rpc_overhead_ms_per_round": tot("rpc_overhead_ms_per_round") / len(summaries),
        "draft_ms_per_round": tot("draft_ms_total") / rounds if rounds else 0.0,
        "verify_ms_per_round": tot("verify_ms_total") / rounds if rounds else 0.0,
        "overlap_ms_per_round": tot("overlap_ms_total") / rounds if rounds else 0.0,
        "wasted_draft_tokens": tot("wasted_draft_tokens"),
        "rounds": rounds,
        "wire_bytes_per_round": tot("mean_wire_bytes_per_round") / len(summaries),
    }
