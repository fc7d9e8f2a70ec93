"""gRPC backends for the orchestrator engine: one bidirectional stream per session.

Each call of a session writes one request on its stream and reads one reply. The draft
service is optional at every moment: when a call to it fails it is marked down, and a
monitor polls its health until it answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc

from orchestrator.engine import DraftResult, TargetFacts, TargetOpenResult, VerifyResult
from specdec import metrics
from specdec.aio import cancelled_by_caller, quietly
from specdec.errors import (DeadlineExceeded, FailedPrecondition, Internal, InvalidArgument, ResourceExhausted,
                            RoundRejected, SpecdecError, Unavailable)
from specdec.rpc import CHANNEL_OPTIONS, sampling_to_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class _Stream:
    """One session stream to a peer service: each `ask` writes one request and reads one reply.

    The stream carries the request's deadline to the service (as its gRPC deadline), and every
    call waits at most `timeout_s` (rpc_timeout_s), or until the deadline if that is sooner.
    Every failure leaves as a `SpecdecError` that names the peer (see `_peer_error`).
    """

    def __init__(self, open_stream, timeout_s: float, peer: str, deadline: float | None):
        self._open_stream = open_stream
        self.timeout_s = timeout_s
        self.peer = peer
        self.deadline = deadline
        self.call = None

    def _wait_s(self) -> float:
        if self.deadline is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, self.deadline - time.monotonic()))

    async def ask(self, request, during: str):
        try:
            if self.call is None:
                left = None if self.deadline is None else max(0.001, self.deadline - time.monotonic())
                self.call = self._open_stream(timeout=left)
            await asyncio.wait_for(self.call.write(request), self._wait_s())
            reply = await asyncio.wait_for(self.call.read(), self._wait_s())
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - translated at this edge
            raise self._error(e, during) from e
        if reply is grpc.aio.EOF:
            raise Unavailable(f"{self.peer} service closed the session stream {during} ({await self.call.code()})")
        return reply

    def _error(self, e: BaseException, during: str) -> SpecdecError:
        """A peer's failure as ours: say which peer, and whose fault it is."""
        peer = f"{self.peer} service"
        deadline_passed = self.deadline is not None and time.monotonic() >= self.deadline
        if isinstance(e, SpecdecError):
            return e
        if isinstance(e, asyncio.TimeoutError) or (
                isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            if deadline_passed:
                return DeadlineExceeded(f"the request's deadline passed while waiting for the {peer} {during}")
            return Unavailable(f"the {peer} did not answer {during} within {self.timeout_s:g} s (rpc_timeout_s)")
        if not isinstance(e, grpc.aio.AioRpcError):
            return Unavailable(f"the {peer} failed {during}: {type(e).__name__}: {e}")
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ResourceExhausted(f"the {peer} is full: {details}")
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            if during == AT_OPEN:
                return InvalidArgument(details)  # about the user's prompt or parameters
            return Internal(f"the {peer} refused what we sent {during}: {details}")  # our fault, not the user's
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            return FailedPrecondition(f"the {peer} refused {during}: {details}")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
            return Unavailable(f"the {peer} is unavailable {during} ({code.name}: {details})")
        return Internal(f"the {peer} failed {during} ({code.name}: {details})")

    async def close(self, grace_s: float = 0.5) -> None:
        """End the stream and wait (at most `grace_s`) for the service to end it too, i.e. to have
        closed the session, so that its slot is free before the next request opens one. A call
        that already ended (failed, or cancelled locally) has nothing to drain; a cancelled
        request waits for nothing; a peer that is down or slow is not waited for: the call is
        cancelled (the service closes the session on cancellation too)."""
        call, self.call = self.call, None
        if call is None:
            return
        try:
            if not call.done() and not cancelled_by_caller():
                await quietly(asyncio.wait_for(_drain(call), grace_s), f"{self.peer} stream close")
        finally:
            call.cancel()


async def _drain(call) -> None:
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


AT_OPEN = "at session open"
IN_ROUND = "during a round"


class GrpcTargetSession:
    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, sid: str, timeout_s: float, deadline: float | None,
                 on_unavailable: Callable[[BaseException], None] = lambda e: None):
        self.sid = sid
        self.stream = _Stream(stub.Session, timeout_s, "target", deadline)
        self.on_unavailable = on_unavailable

    async def _ask(self, request, during: str):
        try:
            return await self.stream.ask(request, during)
        except Unavailable as e:
            self.on_unavailable(e)
            raise

    async def open(self, prompt_ids, sampling, seed, max_tokens, max_draft) -> TargetOpenResult:
        r = await self._ask(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling), seed=seed,
            max_tokens=max_tokens, max_draft=max_draft)), AT_OPEN)
        return TargetOpenResult(r.opened.first_token, r.opened.prefill_ms)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        req = target_pb2.TargetRequest(verify=target_pb2.TargetVerify(
            draft_token_ids=draft_ids,
            draft_dists=[common_pb2.SparseDistribution(token_ids=i, probs=q) for i, q in dists]))
        t0 = time.perf_counter()
        r = await self._ask(req, IN_ROUND)
        rtt = (time.perf_counter() - t0) * 1e3
        if r.HasField("refused"):
            raise RoundRejected(f"the target service refused a round: {r.refused.message}")
        v = r.verified
        metrics.RPC_LATENCY.labels("target").observe(max(0.0, rtt - v.verify_ms) / 1e3)
        return VerifyResult(v.num_accepted, v.next_token, v.verify_ms, rtt, req.ByteSize())

    async def close(self):
        await self.stream.close()


class GrpcDraftSession:
    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub, sid: str, timeout_s: float, deadline: float | None,
                 max_support: int = 0):
        self.sid = sid
        self.max_support = max_support
        self.stream = _Stream(stub.Session, timeout_s, "draft", deadline)

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_tokens, max_draft) -> float:
        r = await self.stream.ask(draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling),
            target_tokenizer_fingerprint=target_fingerprint, target_vocab_size=target_vocab_size,
            max_support=self.max_support, max_tokens=max_tokens, max_draft=max_draft)), AT_OPEN)
        return r.opened.prefill_ms

    async def propose(self, keep, append, k, seed) -> DraftResult:
        t0 = time.perf_counter()
        r = await self.stream.ask(draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(
            keep=keep, append_token_ids=append, k=k, seed=seed)), IN_ROUND)
        rtt = (time.perf_counter() - t0) * 1e3
        p = r.proposal
        metrics.RPC_LATENCY.labels("draft").observe(max(0.0, rtt - p.draft_ms) / 1e3)
        return DraftResult(list(p.token_ids), [(list(d.token_ids), list(d.probs)) for d in p.dists], p.draft_ms)

    async def close(self):
        await self.stream.close()


def draft_mismatch(draft: common_pb2.ModelInfo, target: common_pb2.ModelInfo | None) -> str:
    """Why this draft cannot draft for this target ("" when it can)."""
    if target is None:
        return ""
    fd, ft = draft.tokenizer_fingerprint, target.tokenizer_fingerprint
    if fd and ft and fd != ft:
        return (f"the draft model {draft.model!r} uses a different tokenizer than the target {target.model!r} "
                f"(fingerprints {fd[:12]} vs {ft[:12]}); speculative decoding needs the same one: serving target-only")
    if draft.vocab_size and target.vocab_size and draft.vocab_size > target.vocab_size:
        return (f"the draft vocabulary ({draft.vocab_size}) is larger than the target's ({target.vocab_size}): "
                f"serving target-only")
    return ""


class GrpcBackends:
    """Channels to the target and draft services, and whether each is up.

    A monitor probes both services' Info every `probe_interval_s`: a draft that answers again
    is re-attached by running requests, and the target's availability is reported through
    `on_target_change` (the orchestrator's own health follows it). A failed call marks its
    peer down at once and wakes the monitor.
    """

    def __init__(self, target_address: str, draft_address: str, timeout_s: float = 60.0,
                 probe_interval_s: float = 1.0,
                 on_target_change: Callable[[bool], Awaitable[None]] | None = None):
        self.target_channel = grpc.aio.insecure_channel(target_address, options=CHANNEL_OPTIONS)
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.target_channel)
        self.target_address = target_address
        self.draft_address = draft_address
        self.draft_channel = grpc.aio.insecure_channel(draft_address, options=CHANNEL_OPTIONS) if draft_address else None
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel) if self.draft_channel else None
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.on_target_change = on_target_change
        self.target: TargetFacts | None = None
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None
        self.target_up = False
        self.draft_up = False
        self.draft_problem = ""  # why the draft is not offered, when it is not
        self._monitor: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def connect_target(self, wait_s: float = 600.0) -> common_pb2.ModelInfo:
        """Wait until the target answers Info (it answers UNAVAILABLE while loading)."""
        deadline = time.monotonic() + wait_s
        while not await self._probe_target():
            if time.monotonic() > deadline:
                raise Unavailable(f"target service at {self.target_address} did not come up in {wait_s:.0f} s")
            await asyncio.sleep(0.5)
        return self.target_info

    async def _probe_target(self) -> bool:
        try:
            info = await self.target_stub.Info(common_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        self.target_info = info
        self.target = TargetFacts(info.tokenizer_fingerprint, info.vocab_size, info.max_context,
                                  list(info.eos_token_ids))
        return True

    async def _probe_draft(self) -> bool:
        """Up = it answers and can draft for this target (same tokenizer, vocabulary not larger)."""
        try:
            self.draft_info = await self.draft_stub.Info(common_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            self.draft_problem = f"the draft service at {self.draft_address} does not answer ({e.code().name})"
            return False
        problem = draft_mismatch(self.draft_info, self.target_info)
        if problem and problem != self.draft_problem:
            log.error("%s", problem)
        self.draft_problem = problem
        return not problem

    async def refresh(self) -> None:
        """Probe both services now (their Info, with its live occupancy)."""
        await self._set_target_up(await self._probe_target())
        if self.draft_stub is not None:
            self.draft_up = await self._probe_draft()

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        while True:
            await self._set_target_up(await self._probe_target())
            if self.draft_stub is not None:
                up = await self._probe_draft()
                if up and not self.draft_up:
                    log.info("draft service %s is available (%s, %s)", self.draft_address,
                             self.draft_info.engine, self.draft_info.model)
                elif not up and self.draft_up:
                    log.warning("draft service %s stopped answering", self.draft_address)
                self.draft_up = up
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.probe_interval_s)
            except asyncio.TimeoutError:
                pass

    async def _set_target_up(self, up: bool) -> None:
        if up == self.target_up:
            return
        self.target_up = up
        if up:
            log.info("target service %s is available", self.target_address)
        else:
            log.warning("target service %s is unavailable", self.target_address)
        if self.on_target_change is not None:
            await self.on_target_change(up)

    def target_failed(self, error: BaseException) -> None:
        """A call to the target found it unavailable: report it now, and let the monitor confirm."""
        if self.target_up:
            asyncio.ensure_future(self._set_target_up(False))
        self._wake.set()

    def new_target_session(self, sid: str, deadline: float | None) -> GrpcTargetSession:
        return GrpcTargetSession(self.target_stub, sid, self.timeout_s, deadline, self.target_failed)

    def new_draft_session(self, sid: str, deadline: float | None) -> GrpcDraftSession | None:
        if self.draft_stub is None or not self.draft_up:
            return None
        return GrpcDraftSession(self.draft_stub, sid, self.timeout_s, deadline)

    def draft_failed(self, error: BaseException) -> None:
        """A draft call failed: the request goes on target-only. A full draft, or a call cut by the
        request's own deadline, says nothing about the draft's health: it stays offered to other
        requests; otherwise the draft is down until the monitor sees it answer again."""
        if isinstance(error, (ResourceExhausted, DeadlineExceeded)):
            return
        if self.draft_up:
            log.warning("draft service marked unavailable: %s", error)
        self.draft_up = False
        self._wake.set()

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.target_channel.close()
        if self.draft_channel is not None:
            await self.draft_channel.close()
