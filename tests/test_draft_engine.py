"""The draft engine keeps its cache consistent with what the orchestrator says it holds, batches
sessions, and frees a session however it ends."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from draft_service.engine import DraftEngine, NgramDraftEngine
from specdec.config import DraftConfig
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.sampling_params import SamplingParams
from specdec.serving.paged_llama import PagedLlamaRunner


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)  # peaked, so greedy drafts vary with the context
    return m


@pytest.fixture()
def engine(model):
    e = DraftEngine(PagedLlamaRunner.from_hf_model(model, num_blocks=256, block_size=4, max_seqs=4),
                    DraftConfig(max_sessions=4)).start()
    yield e
    e.stop()


def open_session(e, sid: str, prompt: list[int], max_tokens: int = 64, max_draft: int = 8) -> None:
    asyncio.run(e.open(sid, prompt, SamplingParams(), e.facts.fingerprint, e.facts.vocab_size, 0, max_tokens,
                       max_draft))
    e.prefill(sid).result(10)


def propose(e, sid, keep, append, k) -> list[int]:
    return e.propose(sid, keep, append, k, 0).result(10).token_ids


def fresh(e, tokens, k) -> list[int]:
    open_session(e, "fresh", tokens)
    try:
        return propose(e, "fresh", len(tokens), [], k)
    finally:
        e.close("fresh")


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_proposals_after_any_rollback_equal_a_fresh_session(engine, k, accepted):
    prompt = [1, 5, 9, 13, 2]
    open_session(engine, "s", prompt)
    first = propose(engine, "s", len(prompt), [], k)
    n = min(accepted, k)
    correction = (first[n] + 1) % 64 if n < k else 7
    keep = len(prompt) + n
    second = propose(engine, "s", keep, [correction], k)
    assert second == fresh(engine, prompt + first[:n] + [correction], k)
    # pipelined shape: keep everything, append nothing
    third = propose(engine, "s", keep + 1 + k, [], k)
    assert third == fresh(engine, prompt + first[:n] + [correction] + second, k)


@pytest.mark.parametrize("rollback", [0, 2])
def test_a_catch_up_feeds_the_cache_and_the_next_propose_equals_a_fresh_session(engine, rollback):
    """propose(k = 0) brings the cache up to date (after keeping `keep` tokens) and drafts nothing;
    the propose after it has nothing left to feed and drafts what a fresh session would."""
    prompt = [1, 5, 9, 13, 2]
    open_session(engine, "s", prompt)
    drafted = propose(engine, "s", len(prompt), [], 3)
    committed = prompt + drafted[:3 - rollback] + [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    keep = len(prompt) + 3 - rollback
    caught_up = engine.propose("s", keep, committed[keep:], 0, 0).result(10)
    assert caught_up.token_ids == [] and caught_up.dists == []
    s = engine._sessions["s"]
    assert s.cached == len(committed) and s.tokens == committed and s.last_logits is not None
    assert propose(engine, "s", len(committed), [], 4) == fresh(engine, committed, 4)
    assert engine.propose("s", len(committed) + 4, [], 0, 0).result(10).token_ids == []
    assert s.cached == len(committed) + 4  # the last draft, never fed by its propose, is fed now
    assert engine.propose("s", len(committed) + 4, [], 0, 0).result(10).draft_ms == 0.0  # nothing left: no step


def test_a_cut_propose_ends_after_its_current_step_and_the_session_goes_on_from_there(engine):
    prompt = [1, 5, 9, 13, 2]
    open_session(engine, "s", prompt)
    full = fresh(engine, prompt, 12)
    gate = threading.Event()
    engine.loop.call(gate.wait)  # hold the model thread between steps, so the cut lands before a step
    future = engine.propose("s", len(prompt), [], 12, 0)
    engine.cut("s")
    gate.set()
    cut = future.result(10).token_ids
    # the first token came from the prefill's logits without a step; the step in flight gave the second
    assert cut == full[:2]
    # the session holds prompt + that token: a pipelined propose on top of it drafts what a fresh one does
    more = propose(engine, "s", len(prompt) + 2, [], 4)
    assert more == fresh(engine, prompt + cut, 4)
    engine.cut("s")  # no propose running: nothing happens, the next one drafts all it is asked
    engine.cut("no-such-session")
    held = prompt + cut + more
    assert propose(engine, "s", len(held), [], 6) == fresh(engine, held, 6)
    engine.close("s")


def test_sessions_drafting_at_once_share_steps_and_match_drafting_alone(engine):
    prompts = [[1, 5, 9], [2, 4, 6, 8, 10], [3, 3, 3, 7]]
    alone = [fresh(engine, p, 6) for p in prompts]
    for i, p in enumerate(prompts):
        open_session(engine, f"s{i}", p)
    steps = engine.loop.steps
    futures = [engine.propose(f"s{i}", len(p), [], 6, 0) for i, p in enumerate(prompts)]
    together = [f.result(10).token_ids for f in futures]
    assert together == alone
    assert engine.loop.steps - steps < 3 * 6  # the three sessions' draft steps went into shared forwards


def test_a_guess_first_propose_starts_with_the_most_likely_token_and_samples_the_rest(engine):
    # a speculation's first token guesses the target's bonus token: the draft's argmax, not a
    # sample (a sample matches a sampled bonus less often); the tokens after it are samples
    prompt = [1, 5, 9, 13, 2]
    greedy = fresh(engine, prompt, 1)[0]
    asyncio.run(engine.open("s", prompt, SamplingParams(temperature=5.0), engine.facts.fingerprint,
                            engine.facts.vocab_size, 0, 64, 8))
    engine.prefill("s").result(10)
    guessed, sampled = [], []
    for seed in range(24):
        g = engine.propose("s", len(prompt), [], 3, seed, True).result(10)
        assert g.dists[0] == ([greedy], [1.0]) and len(g.dists[1][0]) > 1  # one-hot guess, sampled rest
        guessed.append(tuple(g.token_ids))
        sampled.append(engine.propose("s", len(prompt), [], 3, seed).result(10).token_ids[0])
    engine.close("s")
    assert {t[0] for t in guessed} == {greedy}
    assert len(set(sampled)) > 1 and len({t[1:] for t in guessed}) > 1  # the test can tell a sample


def test_engine_errors(model):
    e = DraftEngine(PagedLlamaRunner.from_hf_model(model, num_blocks=64, block_size=4, max_seqs=1),
                    DraftConfig(max_sessions=1)).start()
    try:
        with pytest.raises(FailedPrecondition, match="tokenizer"):
            asyncio.run(e.open("a", [1, 2], SamplingParams(), "other-fingerprint", 64))
        open_session(e, "a", [1, 2])
        with pytest.raises(ResourceExhausted, match="full"):  # one sequence slot; the draft does not queue
            asyncio.run(e.open("b", [1, 2], SamplingParams(), e.facts.fingerprint, 64))
        with pytest.raises(InvalidArgument, match="keep"):
            e.propose("a", 99, [], 2, 0)
        with pytest.raises(InvalidArgument, match="k must be"):
            e.propose("a", 2, [], 1000, 0)
        with pytest.raises(InvalidArgument, match="full"):  # past what the session reserved
            e.propose("a", 2, [5] * 100, 2, 0)
        with pytest.raises(NotFound):
            e.propose("zz", 2, [], 2, 0)
        with pytest.raises(InvalidArgument, match="draft_temperature"):
            asyncio.run(e.open("c", [1], SamplingParams(temperature=-1), e.facts.fingerprint, 64))
    finally:
        e.stop()


def test_ngram_engine_copies_what_followed_the_last_match():
    e = NgramDraftEngine(DraftConfig(ngram_max=4, ngram_min=1))
    asyncio.run(e.open("s", [1, 2, 3, 4, 1, 2], SamplingParams(), "", 0))
    p = e.propose("s", 6, [], 3, 0).result()
    assert p.token_ids == [3, 4, 1] and all(d == ([t], [1.0]) for t, d in zip(p.token_ids, p.dists))
    assert e.propose("s", 6, [9], 3, 0).result().token_ids == []  # no earlier 9: nothing to propose


class _GatedRunner:
    """A runner whose forward waits for a gate (close-race tests)."""

    def __init__(self, inner):
        self.inner, self.blocks, self.facts = inner, inner.blocks, inner.facts
        self.gate, self.entered = threading.Event(), threading.Event()

    def forward(self, chunks, stop=None):
        self.entered.set()
        assert self.gate.wait(10)
        return self.inner.forward(chunks)

    def truncate(self, seq, length):
        self.inner.truncate(seq, length)

    def free(self, seq):
        self.inner.free(seq)


@pytest.mark.parametrize("close_at", ["before prefill", "during prefill", "after prefill"])
def test_close_at_any_moment_frees_the_session(model, close_at):
    runner = _GatedRunner(PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=4, max_seqs=1))
    e = DraftEngine(runner, DraftConfig(max_sessions=1)).start()
    try:
        asyncio.run(e.open("s", [1, 2, 3], SamplingParams(), e.facts.fingerprint, 64, 0, 8, 2))
        if close_at == "before prefill":
            e.close("s")
            with pytest.raises(NotFound):
                e.prefill("s")
        else:
            done = e.prefill("s")
            if close_at == "after prefill":
                runner.gate.set()
                done.result(10)
            assert runner.entered.wait(10)
            e.close("s")  # never blocks, whatever the model thread is doing
            assert e.active_sessions == 0
            runner.gate.set()
        e.close("s")  # idempotent
        e.loop.call(lambda: None).result(10)  # the model thread has run the close
        stats = runner.blocks.stats()
        assert stats.used_blocks == stats.reserved_blocks == stats.sequences == 0
        asyncio.run(e.open("t", [1, 2], SamplingParams(), e.facts.fingerprint, 64))  # the slot is free again
    finally:
        runner.gate.set()
        e.stop()
