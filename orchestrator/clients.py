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
from specdec.errors import InvalidArgument, ResourceExhausted, SpecdecError, Unavailable
from specdec.rpc import CHANNEL_OPTIONS, sampling_to_proto
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger("specdec.orchestrator")


class _Stream:
    def __init__(self, open_stream, timeout_s: float, peer: str):
        self._open_stream = open_stream
        self.timeout_s = timeout_s
        self.peer = peer
        self.call = None

    async def ask(self, request):
        if self.call is None:
            self.call = self._open_stream()
        await asyncio.wait_for(self.call.write(request), self.timeout_s)
        reply = await asyncio.wait_for(self.call.read(), self.timeout_s)
        if reply is grpc.aio.EOF:
            code = await self.call.code()
            raise Unavailable(f"{self.peer} closed the session stream ({code})")
        return reply

    async def close(self, grace_s: float = 0.5) -> None:
        """End the stream and wait (at most `grace_s`) for the service to end it too, i.e. to have
        closed the session, so that its slot is free before the next request opens one. A call
        that already ended (failed, or cancelled locally) has nothing to drain; a peer that is
        down or slow is not waited for: the call is cancelled (the service closes the session
        on cancellation too)."""
        call, self.call = self.call, None
        if call is None:
            return
        try:
            if not call.done() and not cancelled_by_caller():  # a cancelled request waits for nothing
                await quietly(asyncio.wait_for(_drain(call), grace_s), f"{self.peer} stream close")
        finally:
            call.cancel()


async def _drain(call) -> None:
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


def _target_error(e: BaseException, during: str) -> Exception:
    """A target-side failure as the error the request ends with, saying that it was the target."""
    if isinstance(e, asyncio.TimeoutError):
        return Unavailable(f"target service did not answer {during} in time")
    if isinstance(e, SpecdecError):  # raised by _Stream, already naming the target
        return e
    if not isinstance(e, grpc.aio.AioRpcError):
        return Unavailable(f"target service failed {during}: {type(e).__name__}: {e}")
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"target service is full: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument(details)
    return Unavailable(f"target service unavailable {during} ({code.name}: {details})")


class GrpcTargetSession:
    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, sid: str, timeout_s: float,
                 on_unavailable: Callable[[BaseException], None] = lambda e: None):
        self.sid = sid
        self.stream = _Stream(stub.Session, timeout_s, "target")
        self.on_unavailable = on_unavailable

    async def _ask(self, request, during: str):
        try:
            return await self.stream.ask(request)
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - translated at this edge
            err = _target_error(e, during)
            if isinstance(err, Unavailable):
                self.on_unavailable(err)
            raise err from e

    async def open(self, prompt_ids, sampling, seed) -> TargetOpenResult:
        r = await self._ask(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling), seed=seed)),
            "at session open")
        return TargetOpenResult(r.opened.first_token, r.opened.prefill_ms)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        req = target_pb2.TargetRequest(verify=target_pb2.TargetVerify(
            draft_token_ids=draft_ids,
            draft_dists=[common_pb2.SparseDistribution(token_ids=i, probs=q) for i, q in dists]))
        t0 = time.perf_counter()
        r = await self._ask(req, "during a round")
        rtt = (time.perf_counter() - t0) * 1e3
        v = r.verified
        metrics.RPC_LATENCY.labels("target").observe(max(0.0, rtt - v.verify_ms) / 1e3)
        return VerifyResult(v.num_accepted, v.next_token, v.verify_ms, rtt, req.ByteSize())

    async def close(self):
        await self.stream.close()


class GrpcDraftSession:
    def __init__(self, stub: draft_pb2_grpc.DraftServiceStub, sid: str, timeout_s: float, max_support: int = 0):
        self.sid = sid
        self.max_support = max_support
        self.stream = _Stream(stub.Session, timeout_s, "draft")

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size) -> float:
        r = await self.stream.ask(draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling),
            target_tokenizer_fingerprint=target_fingerprint, target_vocab_size=target_vocab_size,
            max_support=self.max_support)))
        return r.opened.prefill_ms

    async def propose(self, keep, append, k, seed) -> DraftResult:
        t0 = time.perf_counter()
        r = await self.stream.ask(draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(
            keep=keep, append_token_ids=append, k=k, seed=seed)))
        rtt = (time.perf_counter() - t0) * 1e3
        p = r.proposal
        metrics.RPC_LATENCY.labels("draft").observe(max(0.0, rtt - p.draft_ms) / 1e3)
        return DraftResult(list(p.token_ids), [(list(d.token_ids), list(d.probs)) for d in p.dists], p.draft_ms)

    async def close(self):
        await self.stream.close()


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
        try:
            self.draft_info = await self.draft_stub.Info(common_pb2.InfoRequest(), timeout=2.0)
            return True
        except grpc.aio.AioRpcError:
            return False

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

    def new_target_session(self, sid: str) -> GrpcTargetSession:
        return GrpcTargetSession(self.target_stub, sid, self.timeout_s, self.target_failed)

    def new_draft_session(self, sid: str) -> GrpcDraftSession | None:
        if self.draft_stub is None or not self.draft_up:
            return None
        return GrpcDraftSession(self.draft_stub, sid, self.timeout_s)

    def draft_failed(self, error: BaseException) -> None:
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return  # the draft is up but full: this request goes target-only, others keep drafting
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
