"""Adaptive k: the chooser on hand-made acceptance histories and costs, and in the round loop."""
from __future__ import annotations

import pytest

from specdec.config import OrchestratorConfig
from specdec.kchoice import (PROBE_EVERY, PROBE_K, AcceptanceHistory, CostModel, best_k, expected_tokens,
                             round_ms)
from specdec.modes import Mode
from test_orchestrator_rounds import PROMPT, V, World, closed_everything, reference, run

SEQ, PIPE = Mode.SEQUENTIAL, Mode.PIPELINED
ADAPTIVE = OrchestratorConfig(probe_interval_s=0.0, adaptive_k=True)


def test_expected_tokens():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)  # the last rate repeats
    assert expected_tokens([1.0, 0.5, 0.0], 3) == pytest.approx(1 + 1 + 0.5)
    assert expected_tokens([], 4) == 1.0


def test_round_time_model():
    assert round_ms(SEQ, 3, [0.5], 2.0, 10.0) == 16.0  # k d + T
    assert round_ms(SEQ, 0, [0.5], 2.0, 10.0) == 10.0
    assert round_ms(PIPE, 4, [1.0], 2.0, 10.0) == 10.0  # always a hit: max(T, (k+1) d)
    # never a hit: the miss redrafts k before the next verify
    assert round_ms(PIPE, 4, [0.0], 2.0, 10.0) == 10.0 + 8.0
    # every draft accepted, the bonus guessed in a fraction g of those rounds: a miss otherwise
    assert round_ms(PIPE, 4, [1.0], 2.0, 10.0, guess=0.25) == 10.0 + 0.75 * 8.0
    assert round_ms(PIPE, 4, [0.5], 2.0, 10.0, guess=1.0) == pytest.approx(10.0 + (1 - 0.5 ** 4) * 8.0)


def test_a_bonus_guess_that_often_misses_makes_speculation_shorter():
    # pipelined, d = 37, a verify of 65 + 25k alongside a speculation of (k+1) d: at a = 0.76 one
    # draft pays while the guess is as good as a draft, not when it matches the bonus in 0.4 of
    # fully accepted rounds (about what a sampled guess did at temperature 1); at a = 0.85 (d = 30,
    # verify 65 + 17k) the guess rate shortens k from 2 to 1
    t = lambda k: max(65.0 + 25.0 * k, 37.0 * (k + 1))  # noqa: E731
    assert best_k(PIPE, 8, [0.76], 37.0, t) == 1
    assert best_k(PIPE, 8, [0.76], 37.0, t, guess=0.4) == 0
    t = lambda k: max(65.0 + 17.0 * k, 30.0 * (k + 1))  # noqa: E731
    assert best_k(PIPE, 8, [0.85], 30.0, t) == 2
    assert best_k(PIPE, 8, [0.85], 30.0, t, guess=0.4) == 1


@pytest.mark.parametrize("mode, accept, d, t, want", [
    (SEQ, [1.0], 1.0, lambda k: 10.0, 8),  # perfect drafts, flat verify: (k+1)/(k+10) grows with k
    (SEQ, [0.0], 1.0, lambda k: 10.0, 0),  # never accepted: drafting only costs
    # a = 0.5, d = 2, T = 10: k=0 0.1, k=1 1.5/12 = 0.125, k=2 1.75/14 = 0.125 (a tie: the smaller), k=3 0.117
    (SEQ, [0.5], 2.0, lambda k: 10.0, 1),
    # pipelined, always a hit: T(k) includes the speculation alongside, max(10, 2(k+1)): the rate
    # (k+1) / T(k) peaks from k = 4 on (k+1 drafts fit one verify)
    (PIPE, [1.0], 2.0, lambda k: max(10.0, 2.0 * (k + 1)), 4),
    # a verify that costs 9 ms per draft on top of 40 (this CPU, one sequence): a = 0.6 does not pay
    (SEQ, [0.6], 15.0, lambda k: 40.0 + 9.0 * k, 0),
    # drafts far cheaper than a verify that is flat in k (a GPU): the full k, (k+1) / 100
    (PIPE, [1.0], 1.0, lambda k: 100.0, 8),
    # a = 0.95, d = 15, verify 40 + 8k alongside a speculation of (k+1) d: k = 3 (E 3.71 in
    # max(64, 60) + 0.185 * 45 = 72.3 ms: 51 tok/s; k = 8 is 7.39 in 135 + 0.37 * 120 = 180 ms: 41 tok/s)
    (PIPE, [0.95], 15.0, lambda k: max(40.0 + 8.0 * k, 15.0 * (k + 1)), 3),
])
def test_best_k_is_the_argmax_of_the_model(mode, accept, d, t, want):
    assert best_k(mode, 8, accept, d, t) == want
    rates = [(expected_tokens(accept, k) if k else 1.0) / round_ms(mode, k, accept, d, t(k)) for k in range(9)]
    assert rates[want] == pytest.approx(max(rates))


def test_acceptance_history_counts_positions_and_smooths():
    h = AcceptanceHistory(prior=0.5)
    h.record(4, 2)  # drafts 0 and 1 accepted, 2 rejected, 3 never looked at
    h.record(4, 4)
    assert h.reached == [2, 2, 2, 1] and h.accepted == [2, 2, 1, 1]
    pooled = (6 + 4 * 0.5) / (7 + 4)
    assert h.pooled() == pytest.approx(pooled)
    rates = h.rates(5)
    assert rates[0] == pytest.approx((2 + 4 * pooled) / 6)
    assert rates[4] == pytest.approx(pooled)  # never reached: the pooled rate
    for _ in range(200):
        h.record(4, 0)
    assert h.rates(1)[0] < 0.05  # enough evidence outweighs the prior


def test_the_guess_rate_starts_at_the_pooled_acceptance_and_learns():
    h = AcceptanceHistory(prior=0.8)
    assert h.guess_rate() == pytest.approx(h.pooled())
    for i in range(40):
        h.record_guess(i % 4 == 0)
    assert h.guess_rate() == pytest.approx((10 + 4 * 0.8) / 44)


def test_cost_model_interpolates_verify_time_and_probes():
    c = CostModel()
    assert c.choose(SEQ, 8, AcceptanceHistory(0.0), 0) == 8  # nothing measured yet: the full k
    c.observe_round(0, 0, 40.0)
    c.observe_round(8, 0, 112.0)
    assert c.verify_ms(4) == 112.0  # a round with drafts: from the rounds with drafts only (one: flat)
    c.observe_round(2, 0, 70.0)
    assert c.verify_ms(4) == pytest.approx(84.0) and c.verify_ms(8) == 112.0 and c.verify_ms(0) == 40.0
    unmeasured_zero = CostModel(verify_ms_by_k={2: 70.0, 8: 112.0})
    assert unmeasured_zero.verify_ms(0) == pytest.approx(56.0)  # the line through every k measured
    c.observe_draft(50.0, 10)
    assert c.draft_ms_per_token == 5.0
    hopeless = AcceptanceHistory(0.0)
    for _ in range(50):
        hopeless.record(8, 0)
    assert c.choose(SEQ, 8, hopeless, 0) == 0
    assert c.choose(SEQ, 8, hopeless, PROBE_EVERY - 1) == PROBE_K  # a probe now and then
    good = AcceptanceHistory(0.95)
    for _ in range(20):
        good.record(8, 8)
    assert c.choose(PIPE, 8, good, 0) == 8  # ~8.7 tokens in ~112 ms beats ~5.9 in ~84
    c.observe_draft(250.0, 10)  # a draft 5x dearer (25 ms per token): the average moves a fifth of the way
    assert c.draft_ms_per_token == pytest.approx(9.0)


def test_probes_back_off_while_drafting_does_not_pay_and_come_back_when_it_does():
    from specdec.kchoice import PROBE_EVERY_MAX

    c = CostModel()
    c.observe_round(0, 0, 40.0)
    c.observe_round(8, 0, 112.0)
    c.observe_draft(50.0, 10)
    h = AcceptanceHistory(0.0)
    for _ in range(50):
        h.record(8, 0)
    probes, without = [], 0
    for i in range(400):  # the orchestrator's bookkeeping: rounds without drafts since the last one that drafted
        k = c.choose(SEQ, 8, h, without)
        without = without + 1 if k == 0 else 0
        if k:
            probes.append(i)
    gaps = [b - a for a, b in zip([-1] + probes, probes)]
    assert gaps[:4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY], gaps  # one probe per gap
    assert set(gaps[4:]) == {PROBE_EVERY_MAX}, gaps
    for _ in range(400):  # the draft got good: drafting pays again, and the gap is back to the first
        h.record(8, 8)
    assert c.choose(SEQ, 8, h, 0) > 0 and h.probe_every == PROBE_EVERY


def test_a_useless_draft_is_mostly_not_used_and_the_output_is_unchanged():
    # every draft wrong: after the first rounds, rounds run without drafts, with a probe now and then
    w = World(wrong_at=set(range(5, 400)), verify_s=0.002, draft_s=0.002)
    tokens, rounds, _ = run(w, SEQ, n=150, k=8, config=ADAPTIVE)
    assert tokens == reference(PROMPT, 150)
    ks = [r.k for r in rounds]
    late = ks[len(ks) // 2:]
    assert late.count(0) > 0.75 * len(late), ks
    assert 0 < sum(1 for k in late if k) <= len(late) // (PROBE_EVERY - 1) + 1, ks
    assert closed_everything(w)


def test_a_probe_that_does_not_pay_starts_no_speculation():
    # pipelined: a probe's round is followed by rounds without drafts, so it speculates nothing
    # (a speculation would only slow its verify and be thrown away)
    w = World(wrong_at=set(range(5, 400)), verify_s=0.002, draft_s=0.002)
    tokens, rounds, _ = run(w, PIPE, n=150, k=8, config=ADAPTIVE)
    assert tokens == reference(PROMPT, 150)
    probes = [r for r in rounds[len(rounds) // 2:] if r.k]
    assert probes and all(r.wasted_draft_tokens == 0 and r.overlap_ms == 0 for r in probes), probes
    assert closed_everything(w)


@pytest.mark.parametrize("mode", [SEQ, PIPE])
def test_the_draft_catches_up_before_a_probe_so_the_probe_has_little_to_feed(mode):
    # drafting does not pay, so rounds run without drafts and the draft falls behind; a few rounds
    # before each probe it is sent what was committed (a propose of k = 0) alongside the verifies,
    # and the probe itself appends only the tokens of the last few rounds (before: up to 64)
    from orchestrator.engine import CATCH_UP_LEAD, CATCH_UP_MIN

    w = World(wrong_at=set(range(5, 400)), verify_s=0.002, draft_s=0.002)
    tokens, rounds, _ = run(w, mode, n=200, k=8, config=ADAPTIVE)
    assert tokens == reference(PROMPT, 200)
    catch_ups = [n for k, n in w.proposals if k == 0]
    assert catch_ups and min(catch_ups) >= CATCH_UP_MIN, w.proposals
    ks = [r.k for r in rounds]
    probes = [i for i in range(1, len(ks)) if ks[i] and not ks[i - 1]]
    assert len(probes) >= 3, ks
    fresh = [n for k, n in w.proposals if k > 0][-len(probes):]  # the probes' proposals (fresh calls)
    # the first probe comes PROBE_EVERY rounds after drafting stopped: fewer than CATCH_UP_MIN
    # tokens behind until the round before it, so it feeds them itself; the later ones do not
    assert fresh[0] <= PROBE_EVERY + 1 and max(fresh[1:]) <= CATCH_UP_LEAD + 1, (fresh, w.proposals)
    assert closed_everything(w)


@pytest.mark.parametrize("mode", [SEQ, PIPE])
def test_a_perfect_draft_keeps_the_full_k(mode):
    # a draft that takes no time at all: a 0.5 ms sleep measured as several ms on a busy machine
    # now and then, and made a round choose a smaller k (k is chosen from measured wall times)
    w = World(verify_s=0.004, draft_s=0.0)
    tokens, rounds, _ = run(w, mode, n=120, k=6, config=ADAPTIVE)
    assert tokens == reference(PROMPT, 120)
    assert all(r.k == 6 for r in rounds[1:-2]), [r.k for r in rounds]
    assert V  # the fake world's vocabulary (imported with it)


@pytest.mark.parametrize("server_default", [False, True])
def test_a_request_turns_adaptive_k_on_or_off_over_the_servers_default(server_default):
    # a useless draft: adaptive k stops drafting (k = 0 rounds); fixed k drafts the full k every round
    config = OrchestratorConfig(probe_interval_s=0.0, adaptive_k=server_default)
    for asked in (None, not server_default):
        w = World(wrong_at=set(range(5, 400)), verify_s=0.002, draft_s=0.002)
        tokens, rounds, _ = run(w, SEQ, n=80, k=8, config=config, adaptive_k=asked)
        assert tokens == reference(PROMPT, 80)
        adaptive = server_default if asked is None else asked
        late = [r.k for r in rounds[len(rounds) // 2:]]
        if adaptive:
            assert late.count(0) > 0.5 * len(late), (asked, late)
        else:
            # the full k, clipped only by what is left (k <= remaining - 1) in the last rounds
            assert all(k == 8 for k in late[:-8]) and 0 not in late[:-1], (asked, late)
        assert closed_everything(w)


def test_each_mode_learns_its_own_costs():
    # a pipelined round's draft and verify run at once and slow each other on a CPU, a sequential
    # round's do not: one orchestrator keeps a cost model per mode, each fed by its own rounds only
    import asyncio

    from orchestrator.engine import GenerationRequest, Orchestrator

    w = World(verify_s=0.002, draft_s=0.001)
    orch = Orchestrator(w, decode=lambda ids: "", config=OrchestratorConfig(probe_interval_s=0.0))

    async def go(mode, k):
        async for _ in orch.generate(GenerationRequest(PROMPT, 30, k=k, mode=mode, ignore_eos=True)):
            pass

    asyncio.run(go(PIPE, 6))
    assert orch.costs[PIPE].draft_ms_per_token is not None and orch.costs[SEQ].draft_ms_per_token is None
    # except a round without drafts (the first, before the draft joins), which costs the same in any mode
    assert set(orch.costs[SEQ].verify_ms_by_k) == {0} and 6 in orch.costs[PIPE].verify_ms_by_k
    asyncio.run(go(SEQ, 3))
    assert max(orch.costs[SEQ].verify_ms_by_k) <= 3 < max(orch.costs[PIPE].verify_ms_by_k)
    assert orch.costs[SEQ].draft_ms_per_token is not None
