"""Statistics arithmetic on hand-made round logs: specdec/stats.py (per-round records, the request
summary) and the lab's ideal bound and time split (specdec/lab/analysis.py). Pure functions, no models."""
from __future__ import annotations

import math

import pytest

from specdec.stats import RoundRecord, position_counts, summarize
from specdec.lab.analysis import (aggregate, expected_tokens_per_round, full_requests, ideal_bound, ideal_tok_s,
                                  loss_breakdown, prefix_record, round_time_split, spread)


def hand_rounds() -> list[RoundRecord]:
    return [
        RoundRecord(k=4, accepted=4, draft_ms=8.0, verify_ms=20.0, overlap_ms=6.0, rpc_ms=1.0, wire_bytes=100),
        RoundRecord(k=4, accepted=1, draft_ms=9.0, verify_ms=22.0, overlap_ms=7.0, wasted_draft_tokens=5, rpc_ms=2.0,
                    wire_bytes=120),
        RoundRecord(k=2, accepted=0, draft_ms=4.0, verify_ms=18.0, rpc_ms=3.0, wire_bytes=80),
        RoundRecord(k=0, accepted=0, verify_ms=10.0, rpc_ms=2.0, draft_available=False, wire_bytes=20),
    ]


def test_position_counts_by_hand():
    accepted, drafted = position_counts(hand_rounds())
    assert drafted == [3, 3, 2, 2]  # positions 0, 1 drafted in 3 rounds; 2, 3 only in the k=4 rounds
    assert accepted == [2, 1, 1, 1]  # round 1 accepted all four, round 2 only position 0


def test_position_counts_empty():
    assert position_counts([]) == ([], [])
    assert position_counts([RoundRecord(k=0, accepted=0)]) == ([], [])


def test_summarize_by_hand():
    # tokens: 1 (prefill) + (4+1) + (1+1) + (0+1) + (0+1) = 10
    s = summarize(hand_rounds(), prompt_tokens=12, completion_tokens=10, ttft_ms=20.0, total_ms=110.0)
    assert (s.prompt_tokens, s.completion_tokens, s.rounds) == (12, 10, 4)
    assert (s.draft_tokens, s.accepted_tokens) == (10, 5)
    assert s.acceptance_rate == pytest.approx(0.5)
    assert s.mean_accepted_length == pytest.approx(1 + 5 / 3)  # 3 rounds carried drafts
    assert s.accepted_by_position == [2, 1, 1, 1] and s.drafted_by_position == [3, 3, 2, 2]
    assert s.acceptance_by_position == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert s.tpot_ms == pytest.approx(90.0 / 9)
    assert s.tokens_per_s == pytest.approx(10 / 0.110)
    assert s.rpc_overhead_ms_per_round == pytest.approx(8.0 / 4)
    assert s.wasted_draft_tokens == 5
    assert (s.draft_ms_total, s.verify_ms_total, s.overlap_ms_total) == (21.0, 70.0, 13.0)
    assert s.draft_fallback_rounds == 1
    assert s.mean_wire_bytes_per_round == pytest.approx(80.0)


def test_summarize_target_only_and_empty():
    s = summarize([RoundRecord(k=0, accepted=0, verify_ms=5.0)] * 3, 4, 4, 10.0, 40.0)
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 1.0 and s.accepted_by_position == []
    assert s.tpot_ms == pytest.approx(10.0)
    e = summarize([], 4, 1, 10.0, 10.0)
    assert e.rounds == 0 and e.tpot_ms == 0.0 and e.rpc_overhead_ms_per_round == 0.0
    assert e.mean_wire_bytes_per_round == 0.0 and e.tokens_per_s == pytest.approx(100.0)


@pytest.mark.parametrize("k, accepted", [(2, 3), (0, 1), (3, -1)])
def test_summarize_rejects_impossible_rounds(k, accepted):
    with pytest.raises(ValueError):
        summarize([RoundRecord(k=k, accepted=accepted)], 1, 1, 0.0, 1.0)


def test_mean_accepted_length_equals_expected_tokens_when_k_is_fixed():
    """With every round drafting k, E(k) from the per-position counts is the mean accepted length."""
    rounds = [RoundRecord(k=4, accepted=a) for a in (4, 0, 2, 3, 1, 4, 0)]
    s = summarize(rounds, 1, 1 + sum(a + 1 for a in (4, 0, 2, 3, 1, 4, 0)), 0.0, 1.0)
    e = expected_tokens_per_round(s.accepted_by_position, s.drafted_by_position, 4)
    assert e == pytest.approx(s.mean_accepted_length)


def test_expected_tokens_by_hand():
    assert expected_tokens_per_round([8, 4, 2], [10, 10, 10], 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert expected_tokens_per_round([8, 4, 2], [10, 10, 10], 1) == pytest.approx(1.8)
    assert expected_tokens_per_round([8], [10], 4) == pytest.approx(1.8)  # positions never drafted add nothing
    assert expected_tokens_per_round([], [], 0) == 1.0


def test_ideal_tok_s_by_hand():
    # sequential: E / (k d + T) = 3 / (4*2 + 20) ms
    assert ideal_tok_s("sequential", 4, 2.0, 20.0, 3.0) == pytest.approx(3 / 28 * 1e3)
    # pipelined, target-bound: E / max(T, (k+1) d) = 3 / 20 ms
    assert ideal_tok_s("pipelined", 4, 2.0, 20.0, 3.0) == pytest.approx(150.0)
    # pipelined, draft-bound: (k+1) d = 25 > T
    assert ideal_tok_s("pipelined", 4, 5.0, 20.0, 3.0) == pytest.approx(120.0)
    assert ideal_tok_s("target-only", 0, 0.0, 25.0, 7.0) == pytest.approx(40.0)
    assert ideal_tok_s("pipelined", 4, 0.0, 0.0, 3.0) == 0.0
    with pytest.raises(ValueError):
        ideal_tok_s("bogus", 1, 1.0, 1.0, 1.0)


def _request(rounds: list[dict], ttft_ms: float, total_ms: float, run: int = 0, seconds: float = 1.0) -> dict:
    full = [dict({"overlap_ms": 0.0, "wasted_draft_tokens": 0, "rpc_ms": 0.0, "draft_ms": 0.0,
                  "draft_available": True}, **r) for r in rounds]
    rs = [RoundRecord(**{k: v for k, v in r.items() if k in RoundRecord.__dataclass_fields__}) for r in full]
    tokens = 1 + sum(r.accepted + 1 for r in rs)
    s = summarize(rs, 10, tokens, ttft_ms, total_ms)
    stats = {"completion_tokens": tokens, "ttft_ms": ttft_ms, "total_ms": total_ms,
             "accepted_by_position": s.accepted_by_position, "drafted_by_position": s.drafted_by_position,
             "wasted_draft_tokens": s.wasted_draft_tokens, "draft_fallback_rounds": s.draft_fallback_rounds}
    return {"run": run, "tokens": tokens, "seconds": seconds, "stats": stats, "rounds": full}


PIPELINED = [  # a miss (first round), a hit (round 1 accepted all and kept its spec), a miss after a rejection
    {"k": 4, "accepted": 4, "draft_ms": 8.0, "verify_ms": 20.0, "overlap_ms": 6.0, "rpc_ms": 1.0, "round_ms": 30.0},
    {"k": 4, "accepted": 2, "draft_ms": 9.0, "verify_ms": 20.0, "overlap_ms": 7.0, "rpc_ms": 1.0, "round_ms": 25.0,
     "wasted_draft_tokens": 5, "pipeline_hit": True},
    {"k": 4, "accepted": 0, "draft_ms": 8.0, "verify_ms": 20.0, "overlap_ms": 7.0, "rpc_ms": 2.0, "round_ms": 32.0,
     "wasted_draft_tokens": 5},
]


def test_round_time_split_pipelined_by_hand():
    req = _request(PIPELINED, ttft_ms=10.0, total_ms=100.0)  # 90 ms over 3 rounds
    s = round_time_split([req], "pipelined", draft_ms_per_token=2.0)
    assert (s["rounds"], s["drafting_rounds"], s["hits"], s["misses"]) == (3, 3, 1, 2)
    assert s["decode_ms_per_round"] == pytest.approx(30.0)
    assert s["round_ms"] == pytest.approx(29.0) and s["between_rounds_ms"] == pytest.approx(1.0)
    assert s["verify_ms"] == pytest.approx(20.0) and s["rpc_ms"] == pytest.approx(4 / 3)
    # exposed draft: misses 8 + 8, the hit 9 - 6 (the previous round's overlap)
    assert s["miss_draft_ms"] == pytest.approx(16 / 3) and s["hit_draft_ms"] == pytest.approx(1.0)
    assert s["draft_ms"] == pytest.approx(19 / 3)
    assert s["idle_ms"] == pytest.approx(30.0 - 20.0 - 4 / 3 - 19 / 3)
    assert s["wasted_tail_ms"] == 0.0  # 5 x 2 ms finished within the verify
    slow = round_time_split([req], "pipelined", draft_ms_per_token=5.0)
    assert slow["wasted_tail_ms"] == pytest.approx(((25 - 21) + (25 - 22)) / 3)
    assert s["wasted_draft_tokens_per_round"] == pytest.approx(10 / 3)


def test_round_time_split_counts_hits_from_the_recorded_field():
    """A fully accepted round whose speculative proposal came back empty (the n-gram drafter often
    proposes nothing) wastes no tokens, yet the next round has no drafts ready and redrafts: a miss.
    Only the round's own `pipeline_hit` says whether its drafts came from the speculation."""
    rounds = [
        {"k": 4, "accepted": 4, "draft_ms": 8.0, "verify_ms": 20.0, "overlap_ms": 0.0, "round_ms": 30.0},
        # the speculation after round 0 was empty: nothing wasted, but round 1 redrafted (a miss)
        {"k": 4, "accepted": 4, "draft_ms": 9.0, "verify_ms": 20.0, "overlap_ms": 6.0, "round_ms": 30.0,
         "pipeline_hit": False},
        # round 1's speculation was kept: round 2 reused it (a hit, exposing 10 - 6 ms)
        {"k": 4, "accepted": 1, "draft_ms": 10.0, "verify_ms": 20.0, "overlap_ms": 7.0, "round_ms": 25.0,
         "wasted_draft_tokens": 5, "pipeline_hit": True},
        {"k": 4, "accepted": 0, "draft_ms": 8.0, "verify_ms": 20.0, "overlap_ms": 7.0, "round_ms": 32.0,
         "wasted_draft_tokens": 5, "pipeline_hit": False},
    ]
    s = round_time_split([_request(rounds, ttft_ms=10.0, total_ms=130.0)], "pipelined")
    assert (s["drafting_rounds"], s["hits"], s["misses"]) == (4, 1, 3)
    assert s["miss_draft_ms"] == pytest.approx((8.0 + 9.0 + 8.0) / 4)
    assert s["hit_draft_ms"] == pytest.approx((10.0 - 6.0) / 4)


def test_round_time_split_sequential_puts_all_draft_on_the_critical_path():
    rounds = [dict(r, overlap_ms=0.0, wasted_draft_tokens=0) for r in PIPELINED]
    s = round_time_split([_request(rounds, 10.0, 100.0)], "sequential")
    assert s["hits"] == 0 and s["misses"] == 0
    assert s["draft_ms"] == pytest.approx(25 / 3)
    assert s["verify_ms"] + s["rpc_ms"] + s["draft_ms"] + s["idle_ms"] == pytest.approx(s["decode_ms_per_round"])


def test_aggregate_and_ideal_bound_by_hand():
    reqs = [_request(PIPELINED, 10.0, 100.0, run=0, seconds=0.1), _request(PIPELINED, 10.0, 100.0, run=1,
                                                                           seconds=0.2)]
    agg = aggregate(reqs, "pipelined", 4)
    assert agg["tok_s_runs"] == pytest.approx([10 / 0.1, 10 / 0.2])  # 1 + 5 + 3 + 1 tokens each
    assert agg["tok_s"]["median"] == pytest.approx(75.0) and agg["tok_s"]["spread_pct"] == pytest.approx(
        100 * 50 / 75)
    assert agg["acceptance_rate"] == pytest.approx(6 / 12)
    assert agg["mean_accepted_tokens"] == pytest.approx(1 + 6 / 3)
    assert agg["accepted_by_position"] == [4, 4, 2, 2] and agg["drafted_by_position"] == [6, 6, 6, 6]
    assert agg["draft_ms_per_token"] == pytest.approx(50 / 24)
    assert agg["verify_ms_at_k"] == pytest.approx(20.0)
    assert agg["decode_tok_s"] == pytest.approx(1e3 * 18 / 180)  # 9 tokens after the first, 90 ms, twice
    ib = ideal_bound(agg, "pipelined", 4, draft_ms_per_token=2.0)
    e = 1 + 4 / 6 + 4 / 6 + 2 / 6 + 2 / 6
    assert ib["expected_tokens"] == pytest.approx(e)
    assert ib["ideal_round_ms"] == pytest.approx(20.0)  # max(T=20, 5 x 2)
    assert ib["ideal_tok_s"] == pytest.approx(1e3 * e / 20.0)
    assert ib["efficiency"] == pytest.approx(100.0 / (1e3 * e / 20.0))
    assert ib["efficiency"] < 0.9 and not ib["draft_bound"]
    # the biggest loss: the target waiting for redrafts (16/3 ms per round), named with its numbers
    assert ib["losses"][0]["name"] == "misses" and ib["losses"][0]["ms"] == pytest.approx(16 / 3)
    assert ib["biggest_loss"].startswith("misses: 5.33 ms/round") and "4 of 6 drafting rounds" in ib["biggest_loss"]


def test_ideal_bound_at_full_efficiency_names_no_loss():
    # sequential, every round exactly k d + T, no RPC, no gaps: efficiency 1
    rounds = [{"k": 2, "accepted": 2, "draft_ms": 4.0, "verify_ms": 10.0, "round_ms": 14.0}] * 4
    agg = aggregate([_request(rounds, 5.0, 5.0 + 56.0)], "sequential", 2)
    ib = ideal_bound(agg, "sequential", 2)
    assert ib["expected_tokens"] == pytest.approx(3.0)
    assert ib["ideal_tok_s"] == pytest.approx(3e3 / 14.0)
    assert ib["efficiency"] == pytest.approx(1.0)
    assert ib["biggest_loss"] == ""
    assert all(x["ms"] == pytest.approx(0.0) for x in ib["losses"])


def test_loss_breakdown_draft_bound_pipeline_expects_exposed_draft():
    split = {"rounds": 10, "drafting_rounds": 10, "misses": 0, "hits": 10, "rpc_ms": 0.5, "between_rounds_ms": 0.2,
             "miss_draft_ms": 0.0, "hit_draft_ms": 5.0, "wasted_tail_ms": 0.0, "wasted_draft_tokens_per_round": 0.0,
             "round_ms": 25.5, "verify_ms": 20.0, "draft_ms": 5.0}
    # (k+1) d = 25 > T = 20: 5 ms of exposed draft per round is part of the ideal, not a loss
    losses = {x["name"]: x["ms"] for x in loss_breakdown(split, "pipelined", 4, 5.0, 20.0)}
    assert losses["hit_draft_exposed"] == pytest.approx(0.0)
    assert losses["rpc"] == pytest.approx(0.5) and losses["in_round_overhead"] == pytest.approx(0.0)


def test_spread():
    s = spread([10.0, 12.0, 8.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (10.0, 8.0, 12.0, 3)
    assert s["spread_pct"] == pytest.approx(40.0)
    assert spread([])["n"] == 0 and math.isclose(spread([0.0])["spread_pct"], 0.0)


def hand_request() -> dict:
    """A 12-token request: first token after prefill, then rounds of 5, 2 and 4 tokens (chunk arrival times in s)."""
    rounds = [dict(k=4, accepted=4, draft_ms=8.0, verify_ms=20.0, overlap_ms=6.0, wasted_draft_tokens=0, rpc_ms=1.0,
                   round_ms=30.0, draft_available=True),
              dict(k=4, accepted=1, draft_ms=9.0, verify_ms=22.0, overlap_ms=7.0, wasted_draft_tokens=5, rpc_ms=2.0,
                   round_ms=31.0, draft_available=True),
              dict(k=4, accepted=3, draft_ms=9.0, verify_ms=22.0, overlap_ms=7.0, wasted_draft_tokens=0, rpc_ms=2.0,
                   round_ms=32.0, draft_available=False)]
    stats = dict(completion_tokens=12, ttft_ms=500.0, total_ms=620.0, rounds=3, draft_tokens=12, accepted_tokens=8,
                 accepted_by_position=[3, 2, 2, 1], drafted_by_position=[3, 3, 3, 3], wasted_draft_tokens=5,
                 draft_fallback_rounds=1)
    marks = [[0.5, 1, 0], [0.54, 6, 1], [0.58, 8, 2], [0.62, 12, 3], [0.621, 12, 3]]  # the last chunk: summary
    return dict(prompt="p", workload="chat", tokens=12, seconds=0.621, stats=stats, rounds=rounds, marks=marks,
                cell="c", length=12, run=0)


def test_prefix_record_by_hand():
    rec = hand_request()
    p = prefix_record(rec, 7)  # token 7 arrives with the second round's chunk, at 0.58 s
    assert (p["tokens"], p["seconds"], p["prefix_of"]) == (7, 0.58, 12)
    assert len(p["rounds"]) == 2 and p["stats"]["rounds"] == 2
    assert p["stats"]["completion_tokens"] == 7
    assert p["stats"]["total_ms"] == pytest.approx(500.0 + 80.0)  # ttft + (0.58 - 0.5) s
    assert p["stats"]["draft_tokens"] == 8 and p["stats"]["accepted_tokens"] == 5
    assert p["stats"]["accepted_by_position"] == [2, 1, 1, 1]
    assert p["stats"]["drafted_by_position"] == [2, 2, 2, 2]
    assert p["stats"]["wasted_draft_tokens"] == 5 and p["stats"]["draft_fallback_rounds"] == 0
    assert rec["stats"]["rounds"] == 3 and len(rec["rounds"]) == 3  # the full request is left as it was
    one = prefix_record(rec, 1)
    assert (one["seconds"], one["rounds"], one["stats"]["total_ms"]) == (0.5, [], 500.0)
    assert prefix_record(rec, 12)["stats"]["draft_fallback_rounds"] == 1
    with pytest.raises(ValueError):
        prefix_record(rec, 13)


def test_prefix_records_are_not_counted_twice():
    rec = hand_request()
    records = [rec, dict(prefix_record(rec, 6), length=6)]
    assert full_requests(records) == [rec]
    agg6 = aggregate([r for r in records if r["length"] == 6], "pipelined", 4)
    assert agg6["tok_s"]["median"] == pytest.approx(6 / 0.54)
    assert agg6["acceptance_rate"] == 1.0 and agg6["mean_accepted_tokens"] == 5.0
