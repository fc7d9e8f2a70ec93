"""Adaptive k: the number of drafts per round that maximises expected tokens per unit of time.

Pure arithmetic, no asyncio and no transport; the orchestrator feeds it what it measures.

A round with k drafts emits E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j tokens, where a_j is the
chance that draft j is accepted once drafts 1..j-1 were (the request's own history, by
position). Its expected time, from costs measured as the round sees them, wall clock, RPC
included (d: a fresh proposal's ms per draft token, catch-up included; T(k): the verify of a
round with k drafts, and in pipelined mode the wait for the speculation that runs alongside
it, so T(k) there is about max(verify, (k+1) draft steps) with their contention):
- sequential: k d + T(k);
- pipelined: T(k) + (1 - h(k)) k d: the speculation of k+1 tokens runs while the target
  verifies; it hits with h(k) = g prod_{j<=k} a_j (all k accepted, and the bonus token
  guessed, which happens in a fraction g of fully accepted rounds), and a miss costs a fresh
  proposal of k before the next verify;
- k = 0 (a round without drafts): T(0).
`best_k` is the argmax of E(k) / time(k) over 0..k_max (the lab's ideal bound, in
specdec/lab/analysis.py, is the hit-always case of the same model, with T(k) written out as
max(verify, (k+1) d)).

Sampled output stays exact (each round's acceptance rule holds for any k chosen before it
drafts), but k depends on measured timings, so with adaptive k a seed no longer fixes the
tokens.

Estimates: acceptance per position is smoothed toward the request's pooled rate, itself
smoothed toward a prior (what earlier requests accepted), so a few rounds do not swing k to
0 or to k_max; the guess rate g is the request's own, smoothed toward its pooled acceptance
(greedy: about the same; sampled: lower, a guess must equal a sample of the target); T(k) is
an exponential average per k, interpolated (least squares line through the measured k) where
a k was never measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from specdec.modes import Mode

PRIOR_ACCEPTANCE = 0.8  # the acceptance rate assumed before any round was measured
PRIOR_ROUNDS = 4.0  # weight of the prior, in rounds
EMA = 0.2  # weight of a new measurement in the running averages
PROBE_EVERY = 8  # a request choosing k = 0 still drafts (k = PROBE_K) after this many rounds
PROBE_EVERY_MAX = 64  # ... a gap that doubles after each probe that did not bring drafting back
PROBE_K = 2


def expected_tokens(accept: list[float], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j; accept[j] = a_{j+1} (positions past the list
    repeat its last value)."""
    e, p = 1.0, 1.0
    for i in range(k):
        p *= accept[min(i, len(accept) - 1)] if accept else 0.0
        e += p
    return e


def round_ms(mode: Mode, k: int, accept: list[float], draft_ms: float, verify_ms: float,
             guess: float | None = None) -> float:
    """Expected wall time of a round with k drafts (module docstring); guess: g (None: the
    acceptance of position k+1, as if the bonus guess were one more draft)."""
    if k == 0 or mode == Mode.TARGET_ONLY:
        return verify_ms
    if mode == Mode.SEQUENTIAL:
        return k * draft_ms + verify_ms
    all_accepted = expected_tokens(accept, k) - expected_tokens(accept, k - 1)  # prod_{j<=k} a_j
    g = accept[min(k, len(accept) - 1)] if guess is None else guess
    return verify_ms + (1.0 - all_accepted * g) * k * draft_ms


def best_k(mode: Mode, k_max: int, accept: list[float], draft_ms: float, verify_ms,
           guess: float | None = None) -> int:
    """argmax_k E(k) / round_ms(k) over 0..k_max; verify_ms(k) -> T(k). Ties go to the smaller k."""
    best, best_rate = 0, -1.0
    for k in range(k_max + 1):
        t = round_ms(mode, k, accept, draft_ms, verify_ms(k), guess)
        rate = (expected_tokens(accept, k) if k else 1.0) / t if t > 0 else float("inf")
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best


@dataclass
class AcceptanceHistory:
    """One request's drafts by position: how often position j was reached and accepted."""

    prior: float  # the acceptance rate assumed before this request has any history
    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    guesses: int = 0  # fully accepted rounds with a speculation's guess of the bonus token
    guessed: int = 0  # of which the guess was the bonus token (a pipeline hit)
    probe_every: int = PROBE_EVERY  # rounds without drafts before the next probe

    def rounds_to_probe(self, rounds_without: int) -> int:
        """After `rounds_without` rounds without drafts in a row, how many more `CostModel.choose`
        lets pass before it probes (while drafting does not pay)."""
        return max(0, self.probe_every - 1 - rounds_without)

    def record(self, k: int, num_accepted: int) -> None:
        """A round with k drafts, the first num_accepted of which were accepted."""
        while len(self.reached) < k:
            self.reached.append(0)
            self.accepted.append(0)
        for j in range(min(k, num_accepted + 1)):  # drafts 0..num_accepted were looked at
            self.reached[j] += 1
            self.accepted[j] += j < num_accepted

    def record_guess(self, hit: bool) -> None:
        self.guesses += 1
        self.guessed += hit

    def guess_rate(self) -> float:
        """g: how often the guess is the bonus token, smoothed toward the pooled acceptance."""
        return (self.guessed + PRIOR_ROUNDS * self.pooled()) / (self.guesses + PRIOR_ROUNDS)

    def pooled(self) -> float:
        return (sum(self.accepted) + PRIOR_ROUNDS * self.prior) / (sum(self.reached) + PRIOR_ROUNDS)

    def rates(self, k: int) -> list[float]:
        """a_1..a_k: each position's rate, smoothed toward the pooled rate."""
        pooled = self.pooled()
        out = []
        for j in range(k):
            n = self.reached[j] if j < len(self.reached) else 0
            a = self.accepted[j] if j < len(self.accepted) else 0
            out.append((a + PRIOR_ROUNDS * pooled) / (n + PRIOR_ROUNDS))
        return out


@dataclass
class CostModel:
    """Running averages of what rounds cost, shared by the requests of one mode in one orchestrator
    (the orchestrator keeps one per mode: a pipelined round's draft and verify slow each other)."""

    draft_ms_per_token: float | None = None
    verify_ms_by_k: dict[int, float] = field(default_factory=dict)
    acceptance: float = PRIOR_ACCEPTANCE  # the prior of the next request: an average over finished rounds

    def observe_draft(self, draft_ms: float, tokens: int) -> None:
        if tokens > 0 and draft_ms > 0:
            self.draft_ms_per_token = _ema(self.draft_ms_per_token, draft_ms / tokens)

    def observe_round(self, k: int, num_accepted: int, verify_ms: float) -> None:
        if verify_ms > 0:
            self.verify_ms_by_k[k] = _ema(self.verify_ms_by_k.get(k), verify_ms)
        if k > 0:
            self.acceptance = _ema(self.acceptance, num_accepted / k)

    def verify_ms(self, k: int) -> float:
        """T(k): measured, else the least squares line through the measured k (flat when one is);
        for k >= 1, through the measured k >= 1 when there are any: a round with drafts is dearer
        than one without by a step, not by a slope (a pipelined one has a speculation alongside)."""
        if k in self.verify_ms_by_k:
            return self.verify_ms_by_k[k]
        pts = list(self.verify_ms_by_k.items())
        if k >= 1 and any(x >= 1 for x, _ in pts):
            pts = [(x, t) for x, t in pts if x >= 1]
        if not pts:
            return 0.0
        if len(pts) == 1:
            return pts[0][1]
        mk = sum(x for x, _ in pts) / len(pts)
        mt = sum(t for _, t in pts) / len(pts)
        var = sum((x - mk) ** 2 for x, _ in pts)
        slope = sum((x - mk) * (t - mt) for x, t in pts) / var
        return max(1e-3, mt + max(0.0, slope) * (k - mk))

    def choose(self, mode: Mode, k_max: int, history: AcceptanceHistory, rounds_without: int) -> int:
        """The round's k: k_max until the costs are known; a probe of PROBE_K after
        history.probe_every rounds of k = 0, so that a request whose draft got better finds out.
        A probe costs a round a fresh proposal: the gap doubles (up to PROBE_EVERY_MAX) after
        each probe, and is back to PROBE_EVERY once drafting pays again."""
        if k_max <= 0:
            return 0
        if self.draft_ms_per_token is None or not self.verify_ms_by_k:
            return k_max
        k = best_k(mode, k_max, history.rates(k_max), self.draft_ms_per_token, self.verify_ms, history.guess_rate())
        if k > 0:
            history.probe_every = PROBE_EVERY
        elif history.rounds_to_probe(rounds_without) == 0:
            history.probe_every = min(2 * history.probe_every, PROBE_EVERY_MAX)
            return min(PROBE_K, k_max)
        return k


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - EMA) * old + EMA * new
