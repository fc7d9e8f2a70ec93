"""The orchestrator's round loop over fake sessions: no models, no network, milliseconds each.

The fake target is a deterministic "model" (the next token is a hash of the sequence) that
verifies greedily; the fake draft follows the same rule except where a test makes it wrong,
fail or come back empty, and checks that what the orchestrator tells it (`keep`, `append`)
matches what it really holds. Every scenario must give exactly the target-only output.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from orchestrator.engine import (DraftResult, GenerationRequest, Orchestrator, TargetFacts, TargetOpenResult,
                                 VerifyResult)
from specdec.config import OrchestratorConfig
from specdec.errors import Unavailable
from specdec.modes import Mode

V = 50
EOS = 0


def next_token(seq: list[int]) -> int:
    """The fake target's greedy choice after `seq` (never EOS)."""
    return 1 + (seq[-1] * 7 + seq[-2] * 3 + len(seq)) % (V - 1)


def reference(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


class FakeTarget:
    def __init__(self, world: "World"):
        self.world = world
        self.seq: list[int] = []
        self.pending = -1
        self.closed = False

    async def open(self, prompt_ids, sampling, seed, max_tokens, max_draft) -> TargetOpenResult:
        await asyncio.sleep(0)
        w = self.world
        w.opens += 1
        if w.target_fails_on_open == w.opens:
            raise Unavailable("target service unavailable at session open (fake)")
        self.seq = list(prompt_ids)
        self.pending = next_token(self.seq)
        return TargetOpenResult(self.pending, 1.0)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        w = self.world
        w.verifies += 1
        if w.target_fails_on_verify == w.verifies:
            raise Unavailable("target service unavailable during a round (fake)")
        assert len(draft_ids) == len(dists)
        await asyncio.sleep(w.verify_s)
        self.seq.append(self.pending)
        accepted = 0
        for d in draft_ids:
            if d != next_token(self.seq):
                break
            self.seq.append(d)
            accepted += 1
        self.pending = next_token(self.seq)
        return VerifyResult(accepted, self.pending, 1.0, 1.0, 0)

    async def close(self) -> None:
        self.closed = True


class FakeDraft:
    """Proposes the target's tokens, except at positions in `world.wrong_at` (a wrong token)."""

    def __init__(self, world: "World"):
        self.world = world
        self.holds: list[int] = []
        self.closed = False
        self.cutting = False  # a cut arrived for the propose in flight

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_tokens, max_draft) -> float:
        await asyncio.sleep(self.world.draft_open_s)
        self.holds = list(prompt_ids)
        return 1.0

    async def propose(self, keep, append, k, seed, guess_first=False) -> DraftResult:
        w = self.world
        w.draft_calls += 1
        w.proposals.append((k, len(append)))
        assert 0 <= keep <= len(self.holds), (keep, len(self.holds))
        speculative = not append and keep == len(self.holds)
        if w.draft_fails_on_call == w.draft_calls:
            raise ConnectionError("draft went away (fake)")
        await asyncio.sleep(w.draft_s)
        self.holds = self.holds[:keep] + list(append)
        if speculative and w.empty_speculation:
            return DraftResult([], [], 0.5)
        out = []
        self.cutting = False
        for _ in range(k):
            await asyncio.sleep(w.draft_step_s)
            t = next_token(self.holds)
            if len(self.holds) in w.wrong_at:
                t = t % (V - 1) + 1 if t % (V - 1) + 1 != t else 2
            self.holds.append(t)
            out.append(t)
            if self.cutting:  # as the draft engine does: finish after the current step
                break
        return DraftResult(out, [([t], [1.0]) for t in out], 0.5)

    async def cut(self) -> None:
        self.world.cuts += 1
        self.cutting = True

    async def close(self) -> None:
        self.closed = True


@dataclass
class World:
    """The fake backends and everything a test can turn."""

    target: TargetFacts = field(default_factory=lambda: TargetFacts("fp", V, 4096, [EOS]))
    draft_fails_on_call: int = 0  # the Nth propose call raises
    target_fails_on_verify: int = 0  # the Nth verify raises Unavailable
    target_fails_on_open: int = 0  # the Nth target open raises Unavailable
    target_replicas: int = 1  # how many target sessions a request may try (one per replica)
    opens: int = 0
    empty_speculation: bool = False
    wrong_at: set[int] = field(default_factory=set)  # absolute positions the draft gets wrong
    draft_up: bool = True
    draft_comes_back_after_verifies: int = 0  # a down draft is offered again after this many verifies
    verify_s: float = 0.0
    draft_s: float = 0.0
    draft_step_s: float = 0.0  # per drafted token, after draft_s
    draft_open_s: float = 0.0  # the draft's prefill
    verifies: int = 0
    draft_calls: int = 0
    cuts: int = 0
    proposals: list = field(default_factory=list)  # (k, tokens appended) of each propose call
    failures: list = field(default_factory=list)
    targets: list = field(default_factory=list)
    drafts: list = field(default_factory=list)

    def new_target_session(self, sid, deadline):
        self.targets.append(FakeTarget(self))
        return self.targets[-1]

    async def replacement_target_session(self, failed, sid, deadline):
        if len(failed) >= self.target_replicas:
            return None
        return self.new_target_session(sid, deadline)

    def new_draft_session(self, sid, deadline):
        if not self.draft_up:
            if self.draft_comes_back_after_verifies and self.verifies >= self.draft_comes_back_after_verifies:
                self.draft_up = True
            else:
                return None
        self.drafts.append(FakeDraft(self))
        return self.drafts[-1]

    def draft_failed(self, error):
        self.failures.append(error)
        self.draft_up = False


PROMPT = [5, 9, 14, 3]


def run(world: World, mode: Mode, n: int = 40, k: int = 4, config: OrchestratorConfig | None = None,
        **req) -> tuple[list[int], list, object]:
    orch = Orchestrator(world, decode=lambda ids: "".join(chr(97 + t % 26) for t in ids),
                        config=config or OrchestratorConfig(probe_interval_s=0.0))

    async def go():
        tokens, rounds, summary = [], [], None
        async for ev in orch.generate(GenerationRequest(PROMPT, n, k=k, mode=mode, ignore_eos=True, **req)):
            tokens.extend(ev.token_ids)
            if ev.round is not None:
                rounds.append(ev.round)
            if ev.summary is not None:
                summary = ev.summary
        return tokens, rounds, summary

    return asyncio.run(go())


def closed_everything(world: World) -> bool:
    return all(t.closed for t in world.targets) and all(d.closed for d in world.drafts)


@pytest.mark.parametrize("mode", list(Mode))
def test_a_perfect_draft_matches_target_only(mode):
    w = World()
    tokens, rounds, summary = run(w, mode)
    assert tokens == reference(PROMPT, 40)
    assert summary.completion_tokens == 40
    if mode == Mode.TARGET_ONLY:
        assert all(r.k == 0 for r in rounds) and not w.drafts
    else:
        assert summary.acceptance_rate == 1.0
    if mode == Mode.PIPELINED:
        assert sum(r.pipeline_hit for r in rounds) >= len(rounds) - 2  # every round after the first hits
    assert closed_everything(w)


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.PIPELINED])
@pytest.mark.parametrize("nth", [1, 2, 3, 5])
def test_the_draft_failing_on_its_nth_call_goes_target_only(mode, nth):
    w = World(draft_fails_on_call=nth)
    tokens, rounds, summary = run(w, mode)
    assert tokens == reference(PROMPT, 40)
    assert len(w.failures) == 1
    assert summary.draft_fallback_rounds > 0
    assert all(r.k == 0 for r in rounds[-5:])  # the draft stays down (it is never offered again)
    assert closed_everything(w)


def test_an_empty_speculation_is_a_miss_not_a_hit():
    w = World(empty_speculation=True)
    tokens, rounds, summary = run(w, Mode.PIPELINED)
    assert tokens == reference(PROMPT, 40)
    assert not any(r.pipeline_hit for r in rounds)
    assert all(r.k > 0 for r in rounds[:-1])  # every round still drafts (a fresh call each time)
    assert summary.wasted_draft_tokens == 0


def test_a_wrong_bonus_guess_throws_the_speculation_away():
    # round 1 verifies positions 5..8 (prompt 4 + first token); the draft is right there but
    # wrong at 9, the bonus position, so its speculation starts with a wrong guess
    w = World(wrong_at={9})
    tokens, rounds, summary = run(w, Mode.PIPELINED, k=4)
    assert tokens == reference(PROMPT, 40)
    assert rounds[0].accepted == 4 and rounds[0].wasted_draft_tokens == 5
    assert not rounds[1].pipeline_hit
    assert any(r.pipeline_hit for r in rounds[2:])


def test_a_rejection_mid_round_redrafts_from_the_right_place():
    w = World(wrong_at={7, 20, 21})
    for mode in (Mode.SEQUENTIAL, Mode.PIPELINED):
        tokens, rounds, summary = run(w, mode)
        assert tokens == reference(PROMPT, 40)
        assert 0 < summary.acceptance_rate < 1


@pytest.mark.parametrize("cut", [True, False])
def test_a_rejection_cuts_the_speculation_still_drafting(cut):
    # a draft 3x slower than the verify (20 ms a token against 5 ms a round, k = 4): when a
    # round's draft is rejected, the speculation on top of it has drafted one token, not five
    w = World(wrong_at={7, 20, 33}, draft_step_s=0.02, verify_s=0.005)
    tokens, rounds, summary = run(w, Mode.PIPELINED, k=4,
                                  config=OrchestratorConfig(probe_interval_s=0.0, cut_speculation_on_miss=cut))
    assert tokens == reference(PROMPT, 40)  # the draft's `keep` checks what it holds after a cut
    rejected = [r for r in rounds if r.accepted < r.k]
    assert len(rejected) == 3
    if cut:
        assert w.cuts == 3
        assert all(0 < r.wasted_draft_tokens < 5 for r in rejected)  # stopped after its current step
    else:
        assert w.cuts == 0
        assert all(r.wasted_draft_tokens == 5 for r in rejected)


def test_a_cut_comes_only_after_a_rejection():
    w = World(wrong_at={9}, draft_step_s=0.005)  # a wrong bonus guess: every draft accepted
    tokens, rounds, summary = run(w, Mode.PIPELINED, k=4)
    assert tokens == reference(PROMPT, 40)
    assert w.cuts == 0 and rounds[0].wasted_draft_tokens == 5


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.PIPELINED])
def test_the_draft_is_reattached_within_the_same_request(mode):
    w = World(draft_fails_on_call=2, draft_comes_back_after_verifies=6)
    tokens, rounds, summary = run(w, mode, n=60)
    assert tokens == reference(PROMPT, 60)
    assert len(w.drafts) == 2  # the first session, then a new one after the draft came back
    assert summary.draft_fallback_rounds > 0
    assert any(r.k > 0 for r in rounds[-3:])  # drafting again at the end
    assert closed_everything(w)


@pytest.mark.parametrize("mode", list(Mode))
def test_the_target_failing_mid_request_ends_it_with_the_target_error(mode):
    w = World(target_fails_on_verify=3, draft_s=0.01)  # pipelined: a speculative call is in flight

    with pytest.raises(Unavailable, match="target"):
        run(w, mode)
    assert closed_everything(w)


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("fails", ["open", "verify"])
def test_a_target_that_fails_with_another_replica_up_moves_the_request_and_changes_nothing(mode, fails):
    """With a second target replica, a failed target (at open, or mid-request with a speculative
    draft call in flight) costs nothing but time: the request reopens there with what it has
    committed, the output is the target-only output, and every session is closed."""
    w = World(target_replicas=2, draft_s=0.01, **{f"target_fails_on_{fails}": 3 if fails == "verify" else 1})
    tokens, rounds, summary = run(w, mode)
    assert tokens == reference(PROMPT, 40)
    assert summary.target_moves == (1 if fails == "verify" else 0)
    assert len(w.targets) == 2 and closed_everything(w)
    if fails == "verify":
        moved = [r for r in rounds if r.target_moved]
        assert len(moved) == 1 and moved[0].k == 0
    if mode != Mode.TARGET_ONLY:
        assert summary.draft_tokens > 0  # the draft came back after the move


def test_eos_and_stop_are_found_in_what_is_new():
    w = World()
    ref = reference(PROMPT, 40)
    text = "".join(chr(97 + t % 26) for t in ref)
    stop = text[20:23]
    cut = text.find(stop)
    tokens, rounds, summary = run(w, Mode.PIPELINED, stop=[stop])
    assert "".join(chr(97 + t % 26) for t in tokens)[:cut] == text[:cut]
    assert len(tokens) == cut + len(stop)  # one character per token: the stop's last token ends it
    assert closed_everything(w)


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.PIPELINED])
@pytest.mark.parametrize("budget, shared_k", [(8, 2), (4, 0)])
def test_k_is_shared_out_when_many_requests_speculate_and_the_output_is_unchanged(mode, budget, shared_k):
    """4 requests at once with k = 8 and a draft token budget of 8: each round drafts 2 tokens
    while all 4 run, and the full k again once it runs alone; with a budget of 4 (a share of
    1, under MIN_SHARED_K) the rounds of 4 run without drafts; outputs stay target-only."""
    w = World(verify_s=0.001, draft_s=0.001)
    orch = Orchestrator(w, decode=lambda ids: "", config=OrchestratorConfig(probe_interval_s=0.0,
                                                                          draft_token_budget=budget))

    async def one(n: int):
        ks, tokens = [], []
        async for ev in orch.generate(GenerationRequest(PROMPT, n, k=8, mode=mode, ignore_eos=True)):
            tokens += ev.token_ids
            if ev.round is not None:
                ks.append((ev.round.k, orch.speculating))
        assert tokens == reference(PROMPT, n)
        return ks

    async def go():
        return await asyncio.gather(one(40), one(40), one(40), one(200))

    results = asyncio.run(go())
    assert orch.speculating == 0
    together = [k for ks in results for k, running in ks if running == 4]
    alone = [k for k, running in results[3] if running == 1]
    assert together and max(together) == shared_k, together
    assert alone and max(alone) == 8, alone
    assert closed_everything(w)


@pytest.mark.parametrize("mode", [Mode.SEQUENTIAL, Mode.PIPELINED])
def test_the_first_token_does_not_wait_for_the_draft(mode):
    """A draft whose prefill takes 0.3 s: the first token comes with the target's prefill, the
    rounds before the draft is ready run without drafts, then the draft joins (catching up on
    what the target produced meanwhile) and the output is still target-only's."""
    w = World(draft_open_s=0.3, verify_s=0.01)
    orch = Orchestrator(w, decode=lambda ids: "", config=OrchestratorConfig(probe_interval_s=0.0))

    async def go():
        t0, first_at, ks, tokens = time.perf_counter(), None, [], []
        async for ev in orch.generate(GenerationRequest(PROMPT, 120, k=4, mode=mode, ignore_eos=True)):
            if first_at is None:
                first_at = time.perf_counter() - t0
            tokens += ev.token_ids
            if ev.round is not None:
                ks.append(ev.round.k)
        return first_at, ks, tokens

    first_at, ks, tokens = asyncio.run(go())
    assert first_at < 0.1, first_at
    assert tokens == reference(PROMPT, 120)
    assert ks[0] == 0 and ks.index(4) >= 5, ks  # ~0.3 s of 0.01 s rounds without drafts, then k = 4
    assert len(w.drafts) == 1
    assert closed_everything(w)


def test_a_request_that_ends_while_its_draft_opens_closes_that_session():
    w = World(draft_open_s=0.5)
    tokens, rounds, summary = run(w, Mode.PIPELINED, n=3)
    assert tokens == reference(PROMPT, 3) and all(r.k == 0 for r in rounds)
    assert len(w.drafts) == 1 and closed_everything(w)


def test_a_sampled_request_waits_for_its_draft_so_its_rounds_depend_on_the_seed_alone():
    """A sampled request's first token does not wait for the draft either, but its first round
    does: whether a round drafts changes the random draws, so it must not depend on timing."""
    from specdec.sampling_params import SamplingParams

    w = World(draft_open_s=0.2)
    tokens, rounds, _ = run(w, Mode.PIPELINED, n=20, sampling=SamplingParams(temperature=1.0))
    assert rounds[0].k == 4 and all(r.k > 0 for r in rounds[:-1]), [r.k for r in rounds]
    assert tokens == reference(PROMPT, 20)  # the fake target verifies greedily whatever the sampling
    assert closed_everything(w)
