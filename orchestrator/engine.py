"""The orchestrator engine: speculative rounds over a target session and a draft session.

Pure asyncio over two small session interfaces (no transport here), so it runs the same
over gRPC (`orchestrator.clients`) and over in-process or fake sessions (tests).

A request is a `Run` (its state between rounds); a round is a few named steps:
1. attach the draft if it is due (it can join, or re-join, mid-request): the draft session
   opens in the background, so the first token never waits for the draft's prefill; greedy
   rounds run without drafts until it is ready, sampled ones wait for it (reproducibility);
2. get the round's drafts: the pipeline's prepared ones, or a fresh proposal;
3. pipelined: start the speculative proposal for the next round;
4. verify the drafts on the target;
5. reconcile the speculation with what the target decided (a hit or a miss);
6. commit the new tokens and emit them.

Pipelining: while the target verifies round n, the draft already drafts k+1 tokens after
round n's last draft, the first of which is its guess of the target's bonus token (the
draft's most likely token, not a sample: at temperature 1 on the default pair, k = 8, it
matched the sampled bonus in 0.54-0.56 of fully accepted rounds, a sampled guess in 0.40;
BENCHMARKS §2d). When
round n accepts all drafts and the bonus equals that guess, the other k tokens are round
n+1's drafts (a hit); otherwise they are thrown away (a miss). Reusing drafts on a hit
stays exact: they were sampled from the q~ sent with them, on a prefix the target then
produced. A miss by rejection is known as soon as the verify returns: the speculation,
still drafting when the draft is the slower of the two, is cut there (`cut_speculation_on_miss`),
so the redraft of the next round starts at once instead of after the speculation's last step.

The draft is optional at every moment: any draft error drops it for the request, which
goes on target-only; it is offered again every `probe_interval_s`.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from specdec.aio import cancel_and_wait, cancelled_by_caller, quietly
from specdec.config import OrchestratorConfig
from specdec.errors import InvalidArgument, ResourceExhausted, RoundRejected, Unavailable
from specdec.kchoice import PRIOR_ACCEPTANCE, AcceptanceHistory, CostModel
from specdec.modes import Mode
from specdec.sampling_params import SamplingParams, derive_seed
from specdec.stats import RoundRecord, Summary, summarize

log = logging.getLogger(__name__)

SparseDist = tuple[list[int], list[float]]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int  # new tokens at most
    sampling: SamplingParams = SamplingParams()
    draft_sampling: SamplingParams | None = None  # None = the server's default for the target's sampling
    seed: int | None = None  # None = random (reported)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    k: int = 0  # 0 = the server's default
    mode: Mode | None = None  # None = the server's default
    adaptive_k: bool | None = None  # choose each round's k (at most k); None = the server's default
    deadline: float | None = None  # time.monotonic() when the client's time is up


# -- the session interfaces -------------------------------------------------------------------------

@dataclass
class TargetOpenResult:
    first_token: int
    prefill_ms: float


@dataclass
class VerifyResult:
    num_accepted: int
    next_token: int
    verify_ms: float
    rtt_ms: float
    wire_bytes: int


@dataclass
class DraftResult:
    token_ids: list[int]
    dists: list[SparseDist]
    draft_ms: float
    started: float = 0.0  # perf_counter at send
    finished: float = 0.0  # perf_counter at reply


class TargetSession(Protocol):
    async def open(self, prompt_ids: list[int], sampling: SamplingParams, seed: int, max_tokens: int,
                   max_draft: int) -> TargetOpenResult:
        """max_tokens and max_draft: the session's worst case, which the target reserves."""

    async def verify(self, draft_ids: list[int], dists: list[SparseDist]) -> VerifyResult:
        """Raises RoundRejected when the target refuses what was sent (the round can be retried)."""

    async def close(self) -> None: ...


class DraftSession(Protocol):
    async def open(self, prompt_ids: list[int], sampling: SamplingParams, target_fingerprint: str,
                   target_vocab_size: int, max_tokens: int, max_draft: int) -> float: ...

    async def propose(self, keep: int, append: list[int], k: int, seed: int, guess_first: bool = False) -> DraftResult:
        """Keep `keep` tokens, append `append`, draft k; guess_first: the first is the draft's most
        likely token, not a sample (a speculation's guess of the bonus token). k = 0: a catch-up
        (the draft feeds what it was given, drafts nothing)."""

    async def cut(self) -> None:
        """Ask the propose in flight to finish now, with what it has drafted (it replies shorter);
        best effort: never raises, and does nothing when no propose is running."""

    async def close(self) -> None: ...


@dataclass
class TargetFacts:
    fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]


class Backends(Protocol):
    target: TargetFacts

    def new_target_session(self, session_id: str, deadline: float | None) -> TargetSession: ...

    async def replacement_target_session(self, failed: list[TargetSession], session_id: str,
                                         deadline: float | None) -> TargetSession | None:
        """A session on another target replica, not one of those `failed`; None when there is none."""

    def new_draft_session(self, session_id: str, deadline: float | None) -> DraftSession | None:
        """None while the draft is known to be unavailable."""

    def draft_failed(self, error: BaseException) -> None: ...


# -- what a request emits ---------------------------------------------------------------------------

@dataclass
class Event:
    token_ids: list[int]
    text: str
    round: RoundRecord | None = None
    summary: Summary | None = None
    finish_reason: str = ""
    seed: int = 0
    k: int = 0
    mode: Mode = Mode.PIPELINED


class TextStream:
    """The output's text, decoded incrementally: each token decodes only a short window
    (the tokens since the last complete characters), stop sequences are looked for in what
    is new, and text that could still become a stop sequence is held back until it cannot."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""  # complete characters so far
        self.sent = 0  # characters emitted
        self._prefix = 0  # tokens[_prefix:_read] decoded to the text's last piece
        self._read = 0

    def push(self, token: int) -> int | None:
        """Add one token; -> where a stop sequence starts in `text`, or None."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self._prefix:self._read])
        now = self.decode(self.tokens[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return None  # no complete new character yet
        start = len(self.text)
        self.text += now[len(before):]
        self._prefix, self._read = self._read, len(self.tokens)
        hits = [i for s in self.stop if (i := self.text.find(s, max(0, start - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    def take(self, final: bool, end: int | None = None) -> str:
        """The text not emitted yet, up to `end` (a stop's start); all of it when final."""
        if final and end is None:  # flush what is pending (incomplete characters included)
            tail = self.decode(self.tokens[self._prefix:])[len(self.decode(self.tokens[self._prefix:self._read])):]
            self.text += tail
            self._prefix = self._read = len(self.tokens)
        stop = len(self.text) if end is None else end
        if not final:
            stop = min(stop, len(self.text) - self.hold)
        delta = self.text[self.sent:stop] if stop > self.sent else ""
        self.sent = max(self.sent, stop)
        return delta


# -- a request's state ----------------------------------------------------------------------------

@dataclass
class Drafts:
    """One round's draft tokens and the q~ each was sampled from."""

    tokens: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)
    draft_ms: float = 0.0
    from_speculation: bool = False


@dataclass
class Speculation:
    """The pipeline's proposal for the next round, running while the target verifies."""

    task: asyncio.Task  # -> DraftResult


@dataclass
class Run:
    req: GenerationRequest
    sid: str
    seed: int
    target: TargetSession
    text: TextStream
    eos: set[int]
    started: float  # perf_counter
    committed: list[int] = field(default_factory=list)  # the target's sequence: prompt + output
    out: list[int] = field(default_factory=list)  # output tokens
    draft: DraftSession | None = None
    attaching: asyncio.Task | None = None  # a draft session opening in the background
    opening_draft: DraftSession | None = None  # the session it opens, until it is `draft`
    catching_up: asyncio.Task | None = None  # the draft feeding what was committed, before a probe (-> what it holds)
    draft_holds: list[int] = field(default_factory=list)  # what the draft's cache holds
    ready: Drafts | None = None  # next round's drafts, from a speculation hit
    draft_calls: int = 0
    attaches: int = 0
    next_attach: float = 0.0  # perf_counter
    rounds: list[RoundRecord] = field(default_factory=list)
    history: AcceptanceHistory = field(default_factory=lambda: AcceptanceHistory(PRIOR_ACCEPTANCE))  # adaptive k
    rounds_without: int = 0  # consecutive rounds adaptive k ran without drafts
    ttft_ms: float = 0.0
    finish_reason: str = ""
    failed_targets: list[TargetSession] = field(default_factory=list)  # replicas this request left

    @property
    def wants_draft(self) -> bool:
        return self.req.mode != Mode.TARGET_ONLY

    @property
    def remaining(self) -> int:
        return self.req.max_tokens - len(self.out)

    def next_seed(self) -> int:
        self.draft_calls += 1
        return derive_seed(self.seed, 1, self.draft_calls)

    def event(self, tokens: list[int], text: str, rec: RoundRecord | None = None) -> Event:
        return Event(tokens, text, round=rec, finish_reason=self.finish_reason, seed=self.seed,
                     k=self.req.k, mode=self.req.mode)

    async def close(self) -> None:
        await cancel_and_wait(self.attaching)
        await cancel_and_wait(self.catching_up)
        await quietly(self.target.close(), "target session close")
        for draft in (self.draft, self.opening_draft):
            if draft is not None:
                await quietly(draft.close(), "draft session close")


# how many times one request may move to another target replica
MAX_TARGET_MOVES = 4

# a request at k = 0 (adaptive k found that drafting does not pay) still probes now and then; the
# probe's proposal would first feed the draft every token committed since it last drafted (about
# 5 ms a token for the default draft on this CPU: 300 ms after 64 rounds), on the round's
# critical path. So the draft catches up in the background, alongside the verifies (it is idle
# at k = 0), from CATCH_UP_LEAD rounds before the probe, when it is CATCH_UP_MIN tokens behind
CATCH_UP_LEAD = 4
CATCH_UP_MIN = 8

# the smallest k worth a draft step under load: with the default pair on this CPU, k = 1 at
# 8 clients gave 44 tok/s against 53 without drafts (BENCHMARKS.md §6)
MIN_SHARED_K = 2


# -- the engine -------------------------------------------------------------------------------------

class Orchestrator:
    def __init__(self, backends: Backends, decode: Callable[[list[int]], str],
                 config: OrchestratorConfig | None = None):
        self.backends = backends
        self.decode = decode
        self.config = config or OrchestratorConfig()
        self.default_mode = Mode.parse(self.config.default_mode)
        self.speculating = 0  # requests running in a speculative mode now (they share the draft)
        # what rounds cost, for adaptive k, per mode: a pipelined round's draft and verify run at
        # once and slow each other (their cores share caches and memory bandwidth), a sequential
        # round's do not (BENCHMARKS.md §2a, §2c), so each mode learns and chooses from its own
        self.costs: dict[Mode, CostModel] = defaultdict(CostModel)
        self.target_moves = 0  # requests moved to another target replica mid-request

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Event]:
        run = self._start(self.validate(req))
        self.speculating += run.wants_draft
        try:
            yield await self._open(run)
            while not run.finish_reason:
                yield await self._round(run)
            yield self._summary(run)
        finally:
            self.speculating -= run.wants_draft
            await run.close()

    async def _round(self, run: Run) -> Event:
        t0 = time.perf_counter()
        await self._attach_draft_if_due(run)
        drafts = await self._get_drafts(run, self._round_k(run))
        spec = self._start_speculation(run, drafts)
        self._start_catch_up(run, drafts)
        t_verify = time.perf_counter()
        try:
            v = await self._verify(run, drafts, spec)
        except Unavailable as e:
            return await self._fail_over(run, e, t0)
        rec = await self._reconcile(run, drafts, v, spec, t_verify)
        return self._commit(run, drafts.tokens[:v.num_accepted] + [v.next_token], rec, t0)

    # -- validation ----------------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> GenerationRequest:
        t, c = self.backends.target, self.config
        if not req.prompt_ids:
            raise InvalidArgument("prompt is empty")
        if len(req.prompt_ids) > c.max_prompt_tokens:
            raise InvalidArgument(f"prompt is {len(req.prompt_ids)} tokens, over the limit of {c.max_prompt_tokens} "
                                  f"(max_prompt_tokens)")
        if req.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {req.max_tokens}")
        if len(req.prompt_ids) + req.max_tokens > t.max_context:
            raise InvalidArgument(
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                f"target context limit of {t.max_context}")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= t.vocab_size:
            raise InvalidArgument(f"prompt token ids must be in [0, {t.vocab_size})")
        req.k = req.k or c.default_k
        req.adaptive_k = c.adaptive_k if req.adaptive_k is None else bool(req.adaptive_k)
        if not 1 <= req.k <= c.max_k:
            raise InvalidArgument(f"k must be in [1, {c.max_k}], got {req.k}")
        req.mode = self.default_mode if req.mode is None else req.mode
        if req.mode not in tuple(Mode):
            raise InvalidArgument(f"unknown mode {req.mode!r}: use pipelined, sequential or target-only")
        req.mode = Mode(req.mode)
        req.sampling.validate()
        if req.draft_sampling is None:
            req.draft_sampling = self._default_draft_sampling(req.sampling)
        req.draft_sampling.validate("draft_")
        if len(req.stop) > c.max_stop_strings:
            raise InvalidArgument(f"stop: at most {c.max_stop_strings} stop sequences (max_stop_strings), "
                                  f"got {len(req.stop)}")
        if any(not s or len(s) > c.max_stop_string_chars for s in req.stop):
            raise InvalidArgument(f"stop: each stop sequence must have 1 to {c.max_stop_string_chars} characters "
                                  f"(max_stop_string_chars)")
        if req.seed is None:
            req.seed = random.getrandbits(63)
        return req

    def _default_draft_sampling(self, target: SamplingParams) -> SamplingParams:
        """Greedy targets draft greedily; sampled ones at the target's own sampling when
        default_draft_temperature < 0 (measured best for a draft that is a copy of the target)."""
        c = self.config
        if target.greedy:
            return SamplingParams()
        if c.default_draft_temperature < 0:
            return target
        return SamplingParams(c.default_draft_temperature, c.default_draft_top_k, c.default_draft_top_p)

    # -- the steps -----------------------------------------------------------------------------
    def _start(self, req: GenerationRequest) -> Run:
        sid = uuid.uuid4().hex
        return Run(req, sid, int(req.seed), self.backends.new_target_session(sid, req.deadline),
                   TextStream(self.decode, req.stop), set() if req.ignore_eos else set(self.backends.target.eos_token_ids),
                   time.perf_counter(), committed=list(req.prompt_ids),
                   history=AcceptanceHistory(self.costs[req.mode].acceptance))

    async def _open(self, run: Run) -> Event:
        """Prefill the target, the draft's session opening alongside; emit the first token as
        soon as the target's prefill is done (the draft joins when it is ready). A target replica
        that is down or full at open is replaced by another, when there is one."""
        req = run.req
        open_target = lambda: asyncio.ensure_future(run.target.open(  # noqa: E731
            req.prompt_ids, req.sampling, derive_seed(run.seed, 0), req.max_tokens, req.k))
        opening = open_target()
        self._start_attach_if_due(run)
        while True:
            try:
                opened = await _settled(opening)
                break
            except (Unavailable, ResourceExhausted) as e:
                await self._move_target(run, e)
                opening = open_target()
        run.ttft_ms = (time.perf_counter() - run.started) * 1e3
        return self._commit(run, [opened.first_token], None, None)

    async def _move_target(self, run: Run, error: Exception) -> None:
        """Move the request to another target replica (raise `error` when there is none): a new
        session there; the caller prefills it with everything committed."""
        if len(run.failed_targets) >= MAX_TARGET_MOVES:
            raise error
        run.failed_targets.append(run.target)
        new = await self.backends.replacement_target_session(run.failed_targets,
                                                             f"{run.sid}-t{len(run.failed_targets)}", run.req.deadline)
        if new is None:
            raise error
        log.warning("target failed for request %s (%s); moving it to another replica with %d committed tokens",
                    run.sid, error, len(run.committed))
        old, run.target = run.target, new
        await quietly(old.close(), "failed target session close")

    async def _fail_over(self, run: Run, error: Unavailable, t0: float) -> Event:
        """The target replica failed mid-request: reopen the session on another one with every
        committed token as its prompt; the token the prefill samples is the round's output.
        Greedy output is unchanged; a sampled continuation is a sample from the target given
        what was committed (with a seed of its own: same seed, same tokens does not hold across
        a failover)."""
        run.ready = None  # drafts speculated for the old session's round: the round is lost
        await self._reopen_draft(run)
        while True:
            await self._move_target(run, error)
            seed = derive_seed(run.seed, 2, len(run.failed_targets))
            try:
                opened = await run.target.open(run.committed, run.req.sampling, seed, run.remaining, run.req.k)
                break
            except (Unavailable, ResourceExhausted) as e:
                error = e
        self.target_moves += 1
        rec = RoundRecord(k=0, accepted=0, verify_ms=opened.prefill_ms, target_moved=True)
        return self._commit(run, [opened.first_token], rec, t0)

    async def _attach_draft_if_due(self, run: Run) -> None:
        """The round's draft. A greedy request does not wait for a draft session that is still
        opening: this round runs without drafts (the output is the same either way). A sampled
        one waits, so that which rounds draft, and with it the sampled output, depends on the
        seed and not on timing (same seed, same tokens)."""
        if run.attaching is None:
            self._start_attach_if_due(run)
        if run.attaching is None or (not run.attaching.done() and run.req.sampling.greedy):
            return
        await run.attaching  # _attach_draft handles its own errors
        run.attaching = None

    def _start_attach_if_due(self, run: Run) -> None:
        """Start opening a draft session in the background when the request has none, the last
        try is probe_interval_s old, and its share of k is not 0."""
        if (run.wants_draft and run.draft is None and time.perf_counter() >= run.next_attach
                and self._k_under_load(run) > 0):
            run.attaching = asyncio.ensure_future(self._attach_draft(run))

    async def _attach_draft(self, run: Run) -> None:
        """Open a draft session on what is committed now; on any failure go on without one."""
        run.next_attach = time.perf_counter() + self.config.probe_interval_s
        ds = self.backends.new_draft_session(f"{run.sid}-d{run.attaches}", run.req.deadline)
        run.attaches += 1
        if ds is None:
            return
        t = self.backends.target
        holds = list(run.committed)
        run.opening_draft = ds  # closed by Run.close if the request ends first
        try:
            await ds.open(holds, run.req.draft_sampling, t.fingerprint, t.vocab_size, run.remaining, run.req.k)
        except Exception as e:  # noqa: BLE001 - a draft error never fails the request
            log.warning("draft session could not be opened (%s); serving target-only", e)
            self.backends.draft_failed(e)
            run.opening_draft = None
            await quietly(ds.close(), "draft session close")
            return
        # the first propose appends what the target committed meanwhile (keep = len(holds))
        run.draft, run.opening_draft, run.draft_holds, run.ready = ds, None, holds, None

    async def _reopen_draft(self, run: Run) -> None:
        """Close the request's draft session (a speculation cut short left its stream with a reply
        in flight) and open a fresh one on what is committed, in the background."""
        await self._stop_catch_up(run)
        draft, run.draft, run.ready = run.draft, None, None
        if draft is not None:
            await quietly(draft.close(), "draft session close")
            run.next_attach = 0.0

    async def _drop_draft(self, run: Run, error: BaseException) -> None:
        log.warning("draft failed mid-request (%s); continuing target-only", error)
        self.backends.draft_failed(error)
        await self._stop_catch_up(run)
        draft, run.draft, run.ready = run.draft, None, None
        if draft is not None:
            await quietly(draft.close(), "draft session close")

    async def _draft_call(self, run: Run, call) -> DraftResult | None:
        """Await a draft call; any failure of it (a CancelledError from its stream included, but
        not a cancellation of this request) drops the draft -> None."""
        try:
            return await call
        except asyncio.CancelledError as e:
            if cancelled_by_caller():
                raise
            await self._drop_draft(run, e)
        except Exception as e:  # noqa: BLE001 - the request goes on target-only
            await self._drop_draft(run, e)
        return None

    def _k_under_load(self, run: Run) -> int:
        """The request's k, shared out when more requests speculate than the draft can serve:
        together they ask at most draft_token_budget draft tokens per round; a share under
        MIN_SHARED_K means rounds without drafts (they would cost the draft more than they save)."""
        budget = self.config.draft_token_budget
        if budget <= 0 or self.speculating <= 1:
            return run.req.k
        share = min(run.req.k, budget // self.speculating)
        return share if share >= MIN_SHARED_K else 0

    def _round_k(self, run: Run, probing: bool = True) -> int:
        """The round's k: at most the request's k (shared out under load, clipped to what is left);
        with adaptive_k, the k that the measured costs and this request's acceptance say is best
        (probing=False: never a probe, for sizing a speculation: the round after one that drafts
        is not a probe)."""
        room = self.backends.target.max_context - len(run.committed) - 1
        k_max = max(0, min(self._k_under_load(run), run.remaining - 1, room))
        if not run.req.adaptive_k or run.draft is None:
            return k_max
        return self.costs[run.req.mode].choose(run.req.mode, k_max, run.history,
                                                run.rounds_without if probing else 0)

    def _start_catch_up(self, run: Run, drafts: Drafts) -> None:
        """A round without drafts, a few rounds before a probe: the draft feeds what was committed
        (a propose of k = 0) while the target verifies (see CATCH_UP_LEAD). Not when the round is
        without drafts because the draft is shared out (it has no time to spare) or the request ends."""
        if (drafts.tokens or run.draft is None or run.catching_up is not None or not run.req.adaptive_k
                or run.history.rounds_to_probe(run.rounds_without + 1) > CATCH_UP_LEAD
                or self._k_under_load(run) == 0 or run.remaining <= CATCH_UP_LEAD + 1):
            return
        holds = list(run.committed)
        keep = _common_prefix_len(run.draft_holds, holds)
        if len(holds) - keep >= CATCH_UP_MIN:
            run.catching_up = asyncio.ensure_future(_catch_up(run.draft, keep, holds))

    async def _finish_catch_up(self, run: Run) -> None:
        """Take the catch-up's result (before any other call on the draft's stream)."""
        task, run.catching_up = run.catching_up, None
        holds = await self._draft_call(run, task)
        if holds is not None:
            run.draft_holds = holds

    async def _stop_catch_up(self, run: Run) -> None:
        task, run.catching_up = run.catching_up, None
        await cancel_and_wait(task)

    async def _get_drafts(self, run: Run, k: int) -> Drafts:
        ready, run.ready = run.ready, None
        if run.catching_up is not None and (k > 0 or run.catching_up.done()):
            await self._finish_catch_up(run)
        if run.draft is None or k == 0:
            return Drafts()
        if ready is not None:
            return Drafts(ready.tokens[:k], ready.dists[:k], ready.draft_ms, from_speculation=True)
        keep = _common_prefix_len(run.draft_holds, run.committed)
        t0 = time.perf_counter()
        res = await self._draft_call(run, run.draft.propose(keep, run.committed[keep:], k, run.next_seed()))
        if res is None:
            return Drafts()
        # what a fresh proposal costs the round, as the round sees it (catch-up and RPC included)
        self.costs[run.req.mode].observe_draft((time.perf_counter() - t0) * 1e3, len(res.token_ids))
        run.draft_holds = run.committed + res.token_ids
        return Drafts(res.token_ids, res.dists, res.draft_ms)

    def _start_speculation(self, run: Run, drafts: Drafts) -> Speculation | None:
        """Pipelined: draft k+1 tokens after this round's drafts while the target verifies them."""
        room = self.backends.target.max_context - len(run.committed) - 1
        n = len(drafts.tokens)
        # the next round's k as it would be chosen now (a hit's drafts are cut to the k chosen then);
        # none when that is 0: a guess of the bonus token alone would only slow the verify
        next_k = self._round_k(run, probing=False) if run.req.adaptive_k else self._k_under_load(run)
        spec_k = min(next_k + 1, run.remaining - n - 1, room - n - 1)
        if run.req.mode != Mode.PIPELINED or run.draft is None or not drafts.tokens or next_k <= 0 or spec_k <= 0:
            return None
        return Speculation(asyncio.ensure_future(
            _timed(run.draft.propose, len(run.committed) + n, [], spec_k, run.next_seed(), True)))

    async def _verify(self, run: Run, drafts: Drafts, spec: Speculation | None):
        """The target's verdict. A round the target refuses (our fault: a malformed draft) is
        logged and verified again without drafts, and the draft is dropped for this request."""
        try:
            return await run.target.verify(drafts.tokens, drafts.dists)
        except RoundRejected as e:
            await cancel_and_wait(spec.task if spec else None)
            if not drafts.tokens:
                raise
            log.error("the target refused a round of %d drafts (%s); verifying it again without drafts",
                      len(drafts.tokens), e)
            await self._drop_draft(run, e)
            drafts.tokens, drafts.dists = [], []
            return await run.target.verify([], [])
        except BaseException:
            await cancel_and_wait(spec.task if spec else None)
            raise

    async def _reconcile(self, run: Run, drafts: Drafts, v, spec: Speculation | None,
                         t_verify: float) -> RoundRecord:
        """Set up the next round from the speculation (a hit keeps its drafts) and record this one."""
        t_verified = time.perf_counter()
        rec = RoundRecord(k=len(drafts.tokens), accepted=v.num_accepted, draft_ms=drafts.draft_ms,
                          verify_ms=v.verify_ms, rpc_ms=max(0.0, v.rtt_ms - v.verify_ms), wire_bytes=v.wire_bytes,
                          pipeline_hit=drafts.from_speculation)
        if spec is not None and run.draft is not None:
            await self._take_speculation(run, drafts, v, spec, rec, t_verify, t_verified)
        self._learn(run, rec, v.rtt_ms + rec.spec_wait_ms)
        return rec

    async def _take_speculation(self, run: Run, drafts: Drafts, v, spec: Speculation, rec: RoundRecord,
                                t_verify: float, t_verified: float) -> None:
        """Wait for the speculation (cut short on a rejection); a hit makes it the next round's drafts."""
        if v.num_accepted < len(drafts.tokens) and self.config.cut_speculation_on_miss and not spec.task.done():
            await run.draft.cut()  # it builds on a rejected draft: whatever it drafts now is thrown away
        res = await self._draft_call(run, spec.task)
        if res is None:
            return
        run.draft_holds = run.committed + drafts.tokens + res.token_ids
        rec.spec_wait_ms = max(0.0, res.finished - t_verified) * 1e3
        rec.overlap_ms = max(0.0, min(t_verified, res.finished) - max(t_verify, res.started)) * 1e3
        all_accepted = v.num_accepted == len(drafts.tokens) and bool(res.token_ids)
        hit = all_accepted and res.token_ids[0] == v.next_token
        if all_accepted:
            run.history.record_guess(hit)
        if hit:
            run.ready = Drafts(res.token_ids[1:], res.dists[1:], res.draft_ms)
        else:
            rec.wasted_draft_tokens = len(res.token_ids)

    def _learn(self, run: Run, rec: RoundRecord, verify_ms: float) -> None:
        """What adaptive k learns from a verified round: its cost (the verify's round trip, and in
        pipelined mode the wait for the speculation that ran alongside), and the request's acceptance.
        A round without drafts costs the same in every mode: each mode learns it."""
        for mode in (Mode if rec.k == 0 else (run.req.mode,)):
            self.costs[mode].observe_round(rec.k, rec.accepted, verify_ms)
        if rec.k:
            run.history.record(rec.k, rec.accepted)
        run.rounds_without = run.rounds_without + 1 if rec.k == 0 and run.draft is not None else 0

    def _commit(self, run: Run, new: list[int], rec: RoundRecord | None, t0: float | None) -> Event:
        """Append the round's tokens; emit what is new, up to a finish (EOS, stop, length)."""
        run.committed += new
        take: list[int] = []
        stop_at = None
        for t in new[:run.remaining]:
            take.append(t)
            stop_at = run.text.push(t)
            if t in run.eos:
                run.finish_reason = "eos"
            elif stop_at is not None:
                run.finish_reason = "stop"
            if run.finish_reason:
                break
        run.out += take
        if not run.finish_reason and run.remaining <= 0:
            run.finish_reason = "length"
        if rec is not None:
            # a draft whose session is still opening (its prefill) is there, not a fallback; one
            # whose open has failed (a full draft, a draft that is down) is not
            opening = run.attaching is not None and not run.attaching.done()
            rec.draft_available = run.draft is not None or opening or not run.wants_draft
            rec.round_ms = (time.perf_counter() - t0) * 1e3
            run.rounds.append(rec)
        return run.event(take, run.text.take(bool(run.finish_reason), stop_at), rec)

    def _summary(self, run: Run) -> Event:
        total_ms = (time.perf_counter() - run.started) * 1e3
        ev = run.event([], "")
        ev.summary = summarize(run.rounds, len(run.req.prompt_ids), len(run.out), run.ttft_ms, total_ms)
        return ev


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


async def _settled(task: asyncio.Future):
    """Await a task; if this request is cancelled meanwhile, cancel the task and wait for it to end
    (a cancelled request does not wait for a prefill)."""
    try:
        return await task
    except BaseException:
        await cancel_and_wait(task)
        raise


async def _catch_up(draft: DraftSession, keep: int, holds: list[int]) -> list[int]:
    """Feed the draft `holds` (it keeps its first `keep`) -> what it holds then."""
    await draft.propose(keep, holds[keep:], 0, 0)
    return holds


async def _timed(propose, *args) -> DraftResult:
    started = time.perf_counter()
    res = await propose(*args)
    res.started, res.finished = started, time.perf_counter()
    return res
