"""The draft engine keeps its cache consistent with what the orchestrator says it holds."""
from __future__ import annotations

import threading

import pytest
import torch

from draft_service.drafters import ModelDrafter, NgramDrafter, TorchBackend
from draft_service.engine import DraftEngine
from specdec.config import DraftConfig
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams


@pytest.fixture(scope="module")
def runner():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(20)  # peaked, so greedy drafts vary with the context
    return ModelRunner(m, None, None)


def engine(runner, **kw):
    d = ModelDrafter(TorchBackend(runner), "torch", "tiny", runner.fingerprint, runner.vocab_size, runner.max_context)
    return DraftEngine(d, DraftConfig(**kw))


def fresh(runner, tokens, k):
    e = engine(runner)
    e.open("f", tokens, SamplingParams(), runner.fingerprint, runner.vocab_size)
    e.prefill("f")
    return e.propose("f", len(tokens), [], k, 0).token_ids


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("accepted", [0, 1, 2, 3, 4])
def test_proposals_after_any_rollback_equal_a_fresh_session(runner, k, accepted):
    prompt = [1, 5, 9, 13, 2]
    e = engine(runner)
    e.open("s", prompt, SamplingParams(), runner.fingerprint, runner.vocab_size)
    e.prefill("s")
    first = e.propose("s", len(prompt), [], k, 0).token_ids
    n = min(accepted, k)
    correction = (first[n] + 1) % 64 if n < k else 7
    keep = len(prompt) + n
    second = e.propose("s", keep, [correction], k, 0).token_ids
    assert second == fresh(runner, prompt + first[:n] + [correction], k)
    # pipelined shape: keep everything, append nothing
    third = e.propose("s", keep + 1 + k, [], k, 0).token_ids
    assert third == fresh(runner, prompt + first[:n] + [correction] + second, k)


def test_engine_errors(runner):
    e = engine(runner, max_sessions=1)
    with pytest.raises(FailedPrecondition, match="tokenizer"):
        e.open("a", [1, 2], SamplingParams(), "other-fingerprint", runner.vocab_size)
    e.open("a", [1, 2], SamplingParams(), runner.fingerprint, runner.vocab_size)
    e.prefill("a")
    with pytest.raises(ResourceExhausted):
        e.open("b", [1, 2], SamplingParams(), runner.fingerprint, runner.vocab_size)
    with pytest.raises(InvalidArgument, match="keep"):
        e.propose("a", 99, [], 2, 0)
    with pytest.raises(InvalidArgument, match="k must be"):
        e.propose("a", 2, [], 1000, 0)
    with pytest.raises(NotFound):
        e.propose("zz", 2, [], 2, 0)
    with pytest.raises(InvalidArgument, match="draft_temperature"):
        e.open("c", [1], SamplingParams(temperature=-1), runner.fingerprint, runner.vocab_size)


def test_ngram_drafter_copies_what_followed_the_last_match():
    d = NgramDrafter(max_ngram=2)
    e = DraftEngine(d)
    e.open("s", [1, 2, 3, 4, 1, 2], SamplingParams(), "", 0)
    e.prefill("s")
    p = e.propose("s", 6, [], 3, 0)
    assert p.token_ids == [3, 4, 1]
    assert p.dists == [([3], [1.0]), ([4], [1.0]), ([1], [1.0])]
    assert e.propose("s", 6, [9], 3, 0).token_ids == []  # no earlier 9: nothing to propose


class _GatedDrafter(NgramDrafter):
    """An n-gram drafter whose prefill waits for a gate, counting releases (close-race tests)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.released = 0

    def new_sequence(self, prompt_ids):
        self.entered.set()
        assert self.gate.wait(10)
        return super().new_sequence(prompt_ids)

    def release(self, seq):
        self.released += 1


@pytest.mark.parametrize("close_at", ["before prefill", "during prefill", "after prefill"])
def test_close_at_any_moment_releases_the_session_exactly_once(close_at):
    d = _GatedDrafter()
    e = DraftEngine(d, DraftConfig(max_sessions=1))
    e.open("s", [1, 2, 3], SamplingParams(), "", 0)
    if close_at == "before prefill":
        e.close("s")
        d.gate.set()
        with pytest.raises(NotFound):
            e.prefill("s")
    else:
        t = threading.Thread(target=lambda: e.prefill("s"))
        if close_at == "after prefill":
            d.gate.set()
        t.start()
        assert d.entered.wait(10)
        if close_at == "after prefill":
            t.join(10)
        e.close("s")  # never blocks, whatever the job is doing
        assert e.active_sessions == 0
        d.gate.set()
        t.join(10)
    e.close("s")  # idempotent
    assert d.released == (0 if close_at == "before prefill" else 1)
    e.open("t", [1, 2], SamplingParams(), "", 0)  # the slot is free again
