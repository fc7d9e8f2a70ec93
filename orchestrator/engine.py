"""The orchestrator engine: drives speculative rounds over a target and a draft session.

Pure asyncio over two small session interfaces, so it runs the same over gRPC
(`orchestrator.clients`) and in-process (`orchestrator.local`, used by tests).

Modes:
- target-only: each round is a verify with no drafts (one target forward per token);
- sequential: draft k tokens, then verify them;
- pipelined: while the target verifies round n, the draft already drafts round n+1,
  assuming round n is fully accepted: it drafts k+1 tokens after the last draft, the
  first of which is its guess of the target's bonus token. When round n accepts all
  drafts and the bonus equals that guess, the other k tokens are the next round's
  drafts (a hit); otherwise that work is thrown away and the draft redrafts (a miss).
  Reusing drafts on a hit stays exact: they were sampled from the q~ sent with them,
  conditioned on a prefix that the target then produced.

When the draft fails mid-request the rounds go on target-only; the draft is picked
up again, within the same request, as soon as the backend reports it healthy.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from specdec.aio import cancel_and_wait, quietly
from specdec.errors import FailedPrecondition, InvalidArgument, SpecdecError
from specdec.sampling import SamplingParams, derive_seed
from specdec.stats import RoundRecord, Summary, summarize

log = logging.getLogger(__name__)

MAX_STOP_SEQUENCES = 8
MAX_STOP_LENGTH = 128


class Mode(enum.IntEnum):  # values match specdec.v1.Mode
    PIPELINED = 1
    SEQUENTIAL = 2
    TARGET_ONLY = 3


MODE_NAMES = {"pipelined": Mode.PIPELINED, "sequential": Mode.SEQUENTIAL, "target-only": Mode.TARGET_ONLY}


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    draft_sampling: SamplingParams | None = None  # None = default for the target's sampling
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    k: int = 0  # 0 = default
    mode: Mode | None = None  # None = default


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
    dists: list[tuple[list[int], list[float]]]
    draft_ms: float
    started: float = 0.0  # perf_counter at send
    finished: float = 0.0  # perf_counter at reply


class TargetSession(Protocol):
    async def open(self, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> TargetOpenResult: ...

    async def verify(self, draft_ids: list[int], dists: list[tuple[list[int], list[float]]]) -> VerifyResult: ...

    async def close(self) -> None: ...


class DraftSession(Protocol):
    async def open(self, prompt_ids: list[int], sampling: SamplingParams, target_fingerprint: str,
                   target_vocab_size: int) -> float: ...

    async def propose(self, keep: int, append: list[int], k: int, seed: int) -> DraftResult: ...

    async def close(self) -> None: ...


@dataclass
class TargetFacts:
    fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_ids: list[int]


class Backends(Protocol):
    target: TargetFacts

    def new_target_session(self, session_id: str) -> TargetSession: ...

    def new_draft_session(self, session_id: str) -> DraftSession | None:
        """None while the draft is known to be unavailable."""

    def draft_failed(self, error: BaseException) -> None: ...


@dataclass
class OrchestratorSettings:
    default_k: int = 8
    max_k: int = 32
    default_mode: Mode = Mode.PIPELINED
    # draft sampling when the request sets none: greedy for a greedy target; otherwise the
    # target's own sampling when default_draft_temperature < 0 (measured best for the default
    # pair, whose draft is a quantized copy of the target), else these values
    default_draft_temperature: float = -1.0
    default_draft_top_k: int = 0
    default_draft_top_p: float = 1.0
    probe_interval_s: float = 1.0  # within a request, how often to try a down draft again


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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Detokenizer:
    """Incremental text with stop sequences; holds back incomplete UTF-8."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self.decode = decode
        self.stop = stop
        self.emitted = ""

    def find_stop(self, tokens: list[int]) -> tuple[list[int], str] | None:
        text = self.decode(tokens)
        hits = [(text.find(s), s) for s in self.stop if s and s in text]
        if not hits:
            return None
        idx = min(h[0] for h in hits)
        n = len(tokens)
        while n > 1 and any(s in self.decode(tokens[: n - 1]) for s in self.stop if s):
            n -= 1
        return tokens[:n], text[:idx]

    def delta(self, text: str, final: bool) -> str:
        if not final and text.endswith("\ufffd"):
            return ""
        if not text.startswith(self.emitted):
            return ""
        d = text[len(self.emitted):]
        self.emitted = text
        return d


class Orchestrator:
    def __init__(self, backends: Backends, decode: Callable[[list[int]], str],
                 settings: OrchestratorSettings | None = None):
        self.backends = backends
        self.decode = decode
        self.settings = settings or OrchestratorSettings()

    # -- validation ----------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> GenerationRequest:
        t = self.backends.target
        if not req.prompt_ids:
            raise InvalidArgument("prompt is empty")
        if req.max_new_tokens <= 0:
            raise InvalidArgument(f"max_new_tokens must be > 0, got {req.max_new_tokens}")
        if len(req.prompt_ids) + req.max_new_tokens > t.max_context:
            raise InvalidArgument(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) exceeds the "
                f"target context limit of {t.max_context}")
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= t.vocab_size:
            raise InvalidArgument(f"prompt token ids must be in [0, {t.vocab_size})")
        if req.k == 0:
            req.k = self.settings.default_k
        if not 1 <= req.k <= self.settings.max_k:
            raise InvalidArgument(f"k must be in [1, {self.settings.max_k}], got {req.k}")
        if req.mode is None:
            req.mode = self.settings.default_mode
        if req.mode not in tuple(Mode):
            raise InvalidArgument(f"unknown mode {req.mode!r}: use pipelined, sequential or target-only")
        req.mode = Mode(req.mode)
        req.sampling.validate()
        if req.draft_sampling is None:
            s = self.settings
            if req.sampling.greedy:
                req.draft_sampling = SamplingParams()
            elif s.default_draft_temperature < 0:
                req.draft_sampling = req.sampling
            else:
                req.draft_sampling = SamplingParams(s.default_draft_temperature, s.default_draft_top_k,
                                                    s.default_draft_top_p)
        req.draft_sampling.validate("draft_")
        if len(req.stop) > MAX_STOP_SEQUENCES:
            raise InvalidArgument(f"stop: at most {MAX_STOP_SEQUENCES} stop sequences, got {len(req.stop)}")
        for s in req.stop:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise InvalidArgument(f"stop: each stop sequence must have 1 to {MAX_STOP_LENGTH} characters")
        if req.seed is None:
            req.seed = random.getrandbits(63)
        return req

    # -- the loop ------------------------------------------------------------------------
    async def _open_draft(self, sid: str, committed: list[int], req: GenerationRequest) -> DraftSession | None:
        ds = self.backends.new_draft_session(sid)
        if ds is None:
            return None
        try:
            t = self.backends.target
            await ds.open(committed, req.draft_sampling, t.fingerprint, t.vocab_size)
            return ds
        except FailedPrecondition:
            raise
        except Exception as e:  # draft down or full: serve target-only
            if getattr(e, "code", None) is not None and _is_precondition(e):
                raise FailedPrecondition(str(getattr(e, "details", lambda: e)())) from e
            log.warning("draft session could not be opened (%s); serving target-only", e)
            self.backends.draft_failed(e)
            await quietly(ds.close(), "draft session close")
            return None

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Event]:
        req = self.validate(req)
        t_start = time.perf_counter()
        sid = uuid.uuid4().hex
        seed = int(req.seed)
        mode = req.mode
        want_draft = mode != Mode.TARGET_ONLY
        facts = self.backends.target
        eos = set() if req.ignore_eos else set(facts.eos_token_ids)
        detok = _Detokenizer(self.decode, req.stop)
        target = self.backends.new_target_session(sid)
        draft: DraftSession | None = None
        draft_calls = 0
        rounds: list[RoundRecord] = []
        try:
            target_open = asyncio.ensure_future(target.open(req.prompt_ids, req.sampling, derive_seed(seed, 0)))
            if want_draft:
                draft_open = asyncio.ensure_future(self._open_draft(sid + "-d0", list(req.prompt_ids), req))
                try:
                    opened = await target_open
                finally:
                    draft = await draft_open
            else:
                opened = await target_open
            committed = list(req.prompt_ids) + [opened.first_token]
            mirror: list[int] = list(req.prompt_ids)  # what the draft holds
            out = [opened.first_token]
            ttft_ms = (time.perf_counter() - t_start) * 1e3
            finish = self._finish(out, req, eos, detok)
            out = finish[0] if finish else out
            text = finish[1] if finish and finish[1] is not None else self.decode(out)
            yield Event(list(out), detok.delta(text, bool(finish)), finish_reason=finish[2] if finish else "",
                        seed=seed, k=req.k, mode=mode)
            ready: DraftResult | None = None  # drafts prepared by the pipeline for the next round
            attach_no = 1
            next_attach = time.perf_counter() + self.settings.probe_interval_s
            while not finish:
                t_round = time.perf_counter()
                remaining = req.max_new_tokens - len(out)
                room = facts.max_context - len(committed) - 1
                k_round = max(0, min(req.k, remaining - 1, room))
                if want_draft and draft is None and time.perf_counter() >= next_attach:
                    draft = await self._open_draft(f"{sid}-d{attach_no}", list(committed), req)
                    attach_no += 1
                    next_attach = time.perf_counter() + self.settings.probe_interval_s
                    mirror = list(committed)
                    ready = None
                drafts: list[int] = []
                dists: list = []
                draft_ms = 0.0
                hit = False
                if draft is not None and k_round > 0:
                    if ready is not None and ready.token_ids:
                        drafts, dists, draft_ms = ready.token_ids[:k_round], ready.dists[:k_round], ready.draft_ms
                        hit = True
                    else:
                        keep = common_prefix_len(mirror, committed)
                        try:
                            draft_calls += 1
                            res = await draft.propose(keep, committed[keep:], k_round, derive_seed(seed, 1, draft_calls))
                            mirror = committed + res.token_ids
                            drafts, dists, draft_ms = res.token_ids, res.dists, res.draft_ms
                        except Exception as e:
                            draft = await self._drop_draft(draft, e)
                ready = None
                # pipelined: speculate on the next round while this one verifies
                spec_task = None
                spec_k = min(req.k + 1, remaining - len(drafts) - 1, room - len(drafts) - 1)
                if mode == Mode.PIPELINED and draft is not None and drafts and spec_k > 0:
                    draft_calls += 1
                    spec_task = asyncio.ensure_future(
                        _timed(draft.propose(len(committed) + len(drafts), [], spec_k, derive_seed(seed, 1, draft_calls))))
                t_v0 = time.perf_counter()
                try:
                    v = await target.verify(drafts, dists)
                except BaseException:
                    await cancel_and_wait(spec_task)
                    raise
                t_v1 = time.perf_counter()
                new = drafts[: v.num_accepted] + [v.next_token]
                overlap_ms = wasted = spec_wait_ms = 0
                if spec_task is not None:
                    try:
                        spec = await spec_task
                        spec_wait_ms = max(0.0, spec.finished - t_v1) * 1e3
                        mirror = committed + drafts + spec.token_ids
                        overlap_ms = max(0.0, min(t_v1, spec.finished) - max(t_v0, spec.started)) * 1e3
                        if v.num_accepted == len(drafts) and spec.token_ids and spec.token_ids[0] == v.next_token:
                            ready = DraftResult(spec.token_ids[1:], spec.dists[1:], spec.draft_ms)
                            wasted = 0
                        else:
                            wasted = len(spec.token_ids)
                    except Exception as e:
                        draft = await self._drop_draft(draft, e)
                committed = committed + new
                take = new[:remaining]
                out.extend(take)
                finish = self._finish(out, req, eos, detok)
                if finish:
                    emitted_before = len(out) - len(take)
                    out = finish[0]
                    take = out[emitted_before:]
                rec = RoundRecord(k=len(drafts), accepted=v.num_accepted, draft_ms=draft_ms,
                                  verify_ms=v.verify_ms, overlap_ms=overlap_ms, wasted_draft_tokens=wasted,
                                  rpc_ms=max(0.0, v.rtt_ms - v.verify_ms),
                                  draft_available=draft is not None or not want_draft,
                                  wire_bytes=v.wire_bytes, round_ms=(time.perf_counter() - t_round) * 1e3,
                                  pipeline_hit=hit, spec_wait_ms=spec_wait_ms)
                rounds.append(rec)
                text = finish[1] if finish and finish[1] is not None else self.decode(out)
                yield Event(list(take), detok.delta(text, bool(finish)), round=rec,
                            finish_reason=finish[2] if finish else "", seed=seed, k=req.k, mode=mode)
            total_ms = (time.perf_counter() - t_start) * 1e3
            summary = summarize(rounds, len(req.prompt_ids), len(out), ttft_ms, total_ms)
            yield Event([], "", summary=summary, finish_reason=finish[2], seed=seed, k=req.k, mode=mode)
        finally:
            await quietly(target.close(), "target session close")
            if draft is not None:
                await quietly(draft.close(), "draft session close")

    async def _drop_draft(self, draft: DraftSession, error: BaseException) -> None:
        log.warning("draft failed mid-request (%s); continuing target-only", error)
        self.backends.draft_failed(error)
        await quietly(draft.close(), "draft session close")
        return None

    def _finish(self, out: list[int], req: GenerationRequest, eos: set[int], detok: _Detokenizer):
        """-> None, or (tokens kept, final text or None, finish reason)."""
        for i, t in enumerate(out):
            if t in eos:
                kept = out[: i + 1]
                return kept, self.decode(kept), "eos"
        if req.stop:
            hit = detok.find_stop(out)
            if hit:
                return hit[0], hit[1], "stop"
        if len(out) >= req.max_new_tokens:
            return out[: req.max_new_tokens], None, "length"
        return None


async def _timed(coro) -> DraftResult:
    started = time.perf_counter()
    res = await coro
    res.started, res.finished = started, time.perf_counter()
    return res


def _is_precondition(e: BaseException) -> bool:
    import grpc

    code = getattr(e, "code", None)
    try:
        return callable(code) and code() == grpc.StatusCode.FAILED_PRECONDITION
    except Exception:
        return False
