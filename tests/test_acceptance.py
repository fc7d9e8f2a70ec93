"""Unit tests of the exact-sampling math: `specdec.acceptance.verify_drafts` and `specdec.sampling`.

All distributions are hand-made. Deterministic cases (one-hot residuals, p(x) = 0, one-hot p)
are checked on every draw; the others are checked statistically with a seeded generator
(chi-square goodness of fit; the seeds are fixed, so each test is deterministic).

Vocabulary: p = the target's processed distribution, q = q~ the draft's (truncated,
renormalised) distribution, k = number of draft tokens.
"""
from __future__ import annotations

import math
from collections import Counter

import pytest
from chi2 import chi2_sf
import torch

from specdec.acceptance import VerifyOutcome, verify_drafts
from specdec.errors import InvalidArgument
from specdec.sampling import (
    dense_from_sparse,
    draft_token,
    make_generator,
    processed_probs,
    truncate_support,
)
from specdec.sampling_params import SamplingParams

V = 8
ALPHA = 1e-3  # seeds are fixed, so a pass/fail is reproducible; this only sets the power/robustness trade-off


# -- helpers ----------------------------------------------------------------------------------

def chi2_pvalue(counts: dict[int, int], probs: torch.Tensor) -> float:
    """Goodness of fit of `counts` (outcome -> count) to `probs` [V]. Cells with an expected
    count < 5 are pooled; an outcome of probability 0 gives p-value 0."""
    n = sum(counts.values())
    probs = probs.double() / probs.double().sum()
    if any(probs[t] <= 0 for t in counts):
        return 0.0
    big, pooled_e, pooled_o, stat = 0, 0.0, 0, 0.0
    for t in range(probs.numel()):
        e, o = n * float(probs[t]), counts.get(t, 0)
        if e == 0:
            continue
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
        else:
            stat += (o - e) ** 2 / e
            big += 1
    bins = big
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        bins += 1
    return chi2_sf(stat, bins - 1)


def binom_z(successes: int, n: int, prob: float) -> float:
    return abs(successes - n * prob) / math.sqrt(n * prob * (1 - prob))


def dist(*vals: float) -> torch.Tensor:
    """A length-V probability row from the given leading entries (rest 0), normalised."""
    t = torch.zeros(V)
    t[: len(vals)] = torch.tensor(vals, dtype=torch.float32)
    return t / t.sum()


def onehot(i: int) -> torch.Tensor:
    t = torch.zeros(V)
    t[i] = 1.0
    return t


def run_many(draft_ids: list[int], q: torch.Tensor, p: torch.Tensor, n: int, seed: int) -> list[VerifyOutcome]:
    g = make_generator(seed)
    ids = torch.tensor(draft_ids, dtype=torch.long)
    return [verify_drafts(ids, q, p, g) for _ in range(n)]


# non-degenerate rows used across tests
P_A = dist(0.30, 0.25, 0.15, 0.10, 0.08, 0.06, 0.04, 0.02)
P_B = dist(0.05, 0.10, 0.40, 0.20, 0.10, 0.05, 0.05, 0.05)
Q_A = dist(0.10, 0.40, 0.05, 0.25, 0.05, 0.05, 0.05, 0.05)


# -- verify_drafts: deterministic cases -----------------------------------------------------------

def test_perfect_match_accepts_all_and_bonus_comes_from_last_row():
    # q == p at every drafted position: acceptance probability min(1, p/q) = 1
    q = torch.stack([P_A, P_B, Q_A])  # [3, V]
    p = torch.cat([q, onehot(5)[None]])  # [4, V], bonus row one-hot on 5
    for out in run_many([0, 2, 1], q, p, 300, seed=1):
        assert out == VerifyOutcome(3, 5)
        assert out.output_tokens([0, 2, 1]) == [0, 2, 1, 5]


def test_perfect_match_bonus_is_distributed_as_p_k():
    q = torch.stack([P_A, P_B])
    p = torch.cat([q, P_B[None]])  # bonus row non-degenerate
    outs = run_many([3, 4], q, p, 6000, seed=2)
    assert all(o.num_accepted == 2 for o in outs)
    assert chi2_pvalue(Counter(o.next_token for o in outs), P_B) > ALPHA


@pytest.mark.parametrize("j", [0, 1, 2], ids=["first", "middle", "last"])
def test_rejection_at_position_recovers_from_one_hot_residual(j):
    """Positions before j always accept (p(x) >= q(x)); position j always rejects (p(x) = 0)
    and its residual norm(max(0, p - q)) is one-hot on token 6, which q also puts mass on."""
    draft = [1, 2, 3]  # k = 3
    q = torch.stack([Q_A, Q_A, Q_A]).clone()  # Q_A(1..3) > 0
    p = torch.stack([P_B, P_B, P_B, P_A]).clone()
    for i in range(j):  # make x_i certainly accepted: p(x_i) >= q(x_i)
        p[i] = onehot(draft[i]) * 0.5 + dist(*([1.0] * V)) * 0.5
        q[i] = dist(*([1.0] * V))
        assert p[i, draft[i]] >= q[i, draft[i]]
    p[j] = onehot(6)  # p(x_j) = 0; residual max(0, p - q) = (1 - q(6)) e_6
    assert q[j, draft[j]] > 0 and 0 < q[j, 6] < 1
    for out in run_many(draft, q, p, 500, seed=10 + j):
        assert out == VerifyOutcome(j, 6)
        assert out.output_tokens(draft) == draft[:j] + [6]


def test_draft_token_outside_target_top_k_is_always_rejected():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0]])
    p = processed_probs(logits, SamplingParams(1.0, top_k=3))[0]  # support {0, 1, 2}
    assert (p[3:] == 0).all() and (p[:3] > 0).all()
    for x in (3, 7):
        for qrow in (Q_A, onehot(x)):  # sampled draft and greedy draft
            outs = run_many([x], qrow[None], torch.stack([p, P_A]), 1500, seed=20 + x)
            assert all(o.num_accepted == 0 for o in outs)
            assert all(p[o.next_token] > 0 for o in outs)  # recovered inside the target's support


def test_draft_token_outside_target_top_p_is_always_rejected():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.01, 0.005, 0.005]]))
    p = processed_probs(logits, SamplingParams(1.0, top_p=0.75))[0]  # smallest prefix reaching 0.75: {0, 1}
    assert (p[2:] == 0).all()
    torch.testing.assert_close(p[:2], torch.tensor([0.625, 0.375]))
    q = dist(*([1.0] * V))  # q(2) = 1/8 > 0 = p(2)
    outs = run_many([2], q[None], torch.stack([p, P_A]), 4000, seed=30)
    assert all(o.num_accepted == 0 and o.next_token in (0, 1) for o in outs)
    # the recovered token follows norm(max(0, p - q)) = [2/3, 1/3] on {0, 1}
    resid = (p - q).clamp_min(0)
    assert chi2_pvalue(Counter(o.next_token for o in outs), resid) > ALPHA


def test_greedy_target_with_sampled_draft():
    p_rows = torch.stack([onehot(4), onehot(2), onehot(7)])  # greedy target: one-hot p
    q = torch.stack([Q_A, Q_A])
    # draft equal to the argmax: accepted with probability min(1, 1/q) = 1, bonus = argmax of last row
    assert all(o == VerifyOutcome(2, 7) for o in run_many([4, 2], q, p_rows, 300, seed=40))
    # draft differing at position 1: always rejected there, recovered = the argmax
    assert all(o == VerifyOutcome(1, 2) for o in run_many([4, 3], q, p_rows, 300, seed=41))
    # full loop: x ~ q, the emitted first token is always the target's argmax
    g = make_generator(42)
    for _ in range(500):
        x = int(torch.multinomial(Q_A, 1, generator=g))
        out = verify_drafts(torch.tensor([x]), Q_A[None], p_rows[1:], g)
        assert out.output_tokens([x])[0] == 2


def test_greedy_draft_accepts_with_probability_p_x():
    x = 1
    p = torch.stack([P_A, P_B])
    outs = run_many([x], onehot(x)[None], p, 8000, seed=50)
    acc = sum(o.num_accepted for o in outs)
    assert binom_z(acc, len(outs), float(P_A[x])) < 4
    rejected = [o.next_token for o in outs if o.num_accepted == 0]
    assert x not in rejected  # residual = p without x
    resid = P_A.clone()
    resid[x] = 0
    assert chi2_pvalue(Counter(rejected), resid) > ALPHA


def test_k_zero_is_a_target_only_step():
    empty = torch.zeros(0, dtype=torch.long)
    out = verify_drafts(empty, torch.zeros(0, V), onehot(3)[None], make_generator(0))
    assert out == VerifyOutcome(0, 3) and out.output_tokens([]) == [3]
    g = make_generator(60)
    outs = [verify_drafts(empty, torch.zeros(0, V), P_A[None], g) for _ in range(6000)]
    assert all(o.num_accepted == 0 for o in outs)
    assert chi2_pvalue(Counter(o.next_token for o in outs), P_A) > ALPHA


# -- verify_drafts: statistical cases ------------------------------------------------------------

def test_rejection_probability_and_non_degenerate_residual():
    """x with p(x) < q(x): accepted with probability p(x)/q(x); on rejection the token
    follows norm(max(0, p - q)) (chi-square), never the plain p."""
    x = 3  # P_A[3] = 0.10 < Q_A[3] = 0.25
    p = torch.stack([P_A, P_B])
    outs = run_many([x], Q_A[None], p, 12000, seed=70)
    acc = sum(o.num_accepted for o in outs)
    assert binom_z(acc, len(outs), float(P_A[x] / Q_A[x])) < 4
    rec = Counter(o.next_token for o in outs if o.num_accepted == 0)
    resid = (P_A - Q_A).clamp_min(0)
    assert (resid > 0).sum() >= 3  # non-degenerate
    assert set(rec) <= set(torch.nonzero(resid).flatten().tolist())
    assert chi2_pvalue(rec, resid) > ALPHA
    assert chi2_pvalue(rec, P_A) < 1e-6  # the naive "resample from p" would be told apart


def test_rejection_in_the_middle_statistically():
    """k=3; position 0 always accepted; position 1 accepted w.p. p/q; on rejection at 1 the
    recovered token follows the residual of row 1, and the bonus after full acceptance follows p_3."""
    draft = [2, 1, 0]
    q = torch.stack([dist(*([1.0] * V)), Q_A, P_B])
    p = torch.stack([P_B, P_A, P_B, P_A])  # P_B[2]=0.4 >= 1/8; P_A[1]=0.25 < Q_A[1]=0.4; row 2: p == q
    outs = run_many(draft, q, p, 12000, seed=80)
    assert all(o.num_accepted >= 1 for o in outs)
    acc1 = sum(o.num_accepted >= 2 for o in outs)
    assert binom_z(acc1, len(outs), float(P_A[1] / Q_A[1])) < 4
    assert all(o.num_accepted in (1, 3) for o in outs)  # row 2 has q == p, never rejected
    rec = Counter(o.next_token for o in outs if o.num_accepted == 1)
    assert chi2_pvalue(rec, (P_A - Q_A).clamp_min(0)) > ALPHA
    bonus = Counter(o.next_token for o in outs if o.num_accepted == 3)
    assert chi2_pvalue(bonus, P_A) > ALPHA


@pytest.mark.parametrize("k", [1, 2])
def test_first_emitted_token_is_distributed_as_p(k):
    """The defining property: x ~ q, then verify; the first emitted token ~ p (for any q)."""
    q_rows = torch.stack([Q_A, P_B])[:k]
    p_rows = torch.stack([P_A, P_B, P_A])[: k + 1]
    g = make_generator(90 + k)
    first = Counter()
    for _ in range(8000):
        xs = [int(torch.multinomial(q_rows[i], 1, generator=g)) for i in range(k)]
        out = verify_drafts(torch.tensor(xs), q_rows, p_rows, g)
        first[out.output_tokens(xs)[0]] += 1
    assert chi2_pvalue(first, P_A) > ALPHA
    assert chi2_pvalue(first, Q_A) < 1e-6


def test_verify_is_reproducible_with_the_same_seed():
    q = torch.stack([Q_A, Q_A])
    p = torch.stack([P_A, P_B, P_A])
    a = run_many([1, 3], q, p, 200, seed=123)
    b = run_many([1, 3], q, p, 200, seed=123)
    c = run_many([1, 3], q, p, 200, seed=124)
    assert a == b
    assert a != c


# -- sampling ------------------------------------------------------------------------------------

def test_processed_probs_temperature_top_k_top_p_and_greedy():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=torch.float16)
    full = processed_probs(logits, SamplingParams(1.0))
    assert full.dtype == torch.float32
    torch.testing.assert_close(full, torch.softmax(logits.float(), -1))
    hot = processed_probs(logits, SamplingParams(0.5))
    torch.testing.assert_close(hot, torch.softmax(logits.float() / 0.5, -1))
    k2 = processed_probs(logits, SamplingParams(1.0, top_k=2))
    assert ((k2 > 0).sum(-1) == 2).all()
    torch.testing.assert_close(k2[0, :2], torch.softmax(torch.tensor([2.0, 1.0]), -1))
    greedy = processed_probs(logits, SamplingParams(0.0))
    assert greedy.tolist() == [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]]
    # top-p keeps the smallest prefix reaching top_p (always at least the top token)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    keep = lambda tp: (processed_probs(probs.log(), SamplingParams(1.0, top_p=tp)) > 0).sum().item()
    assert [keep(0.1), keep(0.49), keep(0.51), keep(0.79), keep(0.81), keep(0.96), keep(1.0)] == [1, 1, 2, 2, 3, 4, 4]
    torch.testing.assert_close(processed_probs(probs.log(), SamplingParams(1.0, top_p=0.75)),
                               torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    for params in (SamplingParams(0.7, 3, 0.9), SamplingParams(1.3), SamplingParams(0.0)):
        torch.testing.assert_close(processed_probs(logits, params).sum(-1), torch.ones(2))


def test_truncate_support_caps_and_renormalises():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    ids, q = truncate_support(probs, 3)
    assert ids.tolist() == [1, 3, 4]  # the most likely first
    torch.testing.assert_close(q, torch.tensor([0.4, 0.25, 0.2]) / 0.85)
    assert q.dtype == torch.float32
    ids, q = truncate_support(probs, 0)  # 0 = no cap: every nonzero entry, zeros dropped
    assert sorted(ids.tolist()) == [0, 1, 3, 4, 5]
    torch.testing.assert_close(q.sum(), torch.tensor(1.0))
    ids, q = truncate_support(probs, 64)  # a cap above the support keeps the support
    assert sorted(ids.tolist()) == [0, 1, 3, 4, 5]
    ids, q = truncate_support(onehot(2), 4)
    assert ids.tolist() == [2] and q.tolist() == [1.0]
    # a far tail (here 2e-6 of the mass) is dropped, and what is kept is renormalised
    tail = torch.tensor([0.6, 0.4 - 2e-6, 1e-6, 1e-6])
    ids, q = truncate_support(tail, 0)
    assert ids.tolist() == [0, 1]
    torch.testing.assert_close(q.sum(), torch.tensor(1.0))
    torch.testing.assert_close(dense_from_sparse(*truncate_support(probs, 3), 6),
                               torch.tensor([0.0, 0.4, 0.0, 0.25, 0.2, 0.0]) / 0.85)


def test_draft_token_samples_from_the_truncated_distribution_it_returns():
    logits = torch.log(torch.tensor([0.05, 0.3, 0.02, 0.25, 0.2, 0.1, 0.05, 0.03]))
    params = SamplingParams(1.0)
    g = make_generator(7)
    counts, seen_q = Counter(), None
    for _ in range(8000):
        tok, ids, q = draft_token(logits, params, 3, g)
        assert ids.numel() <= 3 and tok in ids.tolist()
        counts[tok] += 1
        seen_q = dense_from_sparse(ids, q, V)
    assert set(counts) == {1, 3, 4}  # never outside the capped support
    torch.testing.assert_close(seen_q[[1, 3, 4]], torch.tensor([0.3, 0.25, 0.2]) / 0.75)
    assert chi2_pvalue(counts, seen_q) > ALPHA  # renormalised before sampling
    assert chi2_pvalue(counts, processed_probs(logits[None], params)[0]) < 1e-6  # not from the untruncated p


def test_draft_token_greedy_is_one_hot_on_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    tok, ids, q = draft_token(logits, SamplingParams(0.0), 4, make_generator(0))
    assert tok == 1 and ids.tolist() == [1] and q.tolist() == [1.0]


def test_draft_token_is_reproducible_with_the_same_seed():
    logits = torch.randn(V, generator=make_generator(3))
    params = SamplingParams(1.0, top_k=6)
    seq = lambda seed: [draft_token(logits, params, 5, g)[0] for g in [make_generator(seed)] for _ in range(100)]
    assert seq(11) == seq(11)
    assert seq(11) != seq(12)


# -- SamplingParams.validate -------------------------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.7, 40, 0.95), SamplingParams(1.0, 0, 1.0),
                                    SamplingParams(2, 1, 0.01)])
def test_validate_accepts_valid_params(params):
    assert params.validate() is params
    assert params.validate("draft_") is params


@pytest.mark.parametrize("params,name", [
    (SamplingParams(temperature=-0.1), "temperature"),
    (SamplingParams(temperature=float("nan")), "temperature"),
    (SamplingParams(temperature=float("inf")), "temperature"),
    (SamplingParams(temperature=float("-inf")), "temperature"),
    (SamplingParams(1.0, top_p=0.0), "top_p"),
    (SamplingParams(1.0, top_p=-0.5), "top_p"),
    (SamplingParams(1.0, top_p=1.0001), "top_p"),
    (SamplingParams(1.0, top_p=float("nan")), "top_p"),
    (SamplingParams(1.0, top_p=float("inf")), "top_p"),
    (SamplingParams(1.0, top_k=-1), "top_k"),
    (SamplingParams(1.0, top_k=2.5), "top_k"),
])
@pytest.mark.parametrize("prefix", ["", "draft_"])
def test_validate_rejects_invalid_params_naming_the_parameter(params, name, prefix):
    with pytest.raises(InvalidArgument) as exc:
        params.validate(prefix)
    msg = str(exc.value)
    assert msg.startswith(prefix + name), msg
    if not prefix:
        assert "draft_" not in msg
