"""gRPC backends for the orchestrator engine: one bidirectional stream per session.

Each call of a session writes one request on its stream and reads one reply. The draft
service is optional at every moment: when a call to it fails it is marked down, and a
monitor polls its health until it answers again.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from orchestrator.engine import DraftResult, TargetFacts, TargetOpenResult, VerifyResult
from specdec import metrics
from specdec.errors import Unavailable
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
        closed the session, so that its slot is free before the next request opens one (a burst of
        short requests otherwise finds the draft at its session limit and falls back to target-only).
        A peer that is down or slow is not waited for: the call is cancelled."""
        call, self.call = self.call, None
        if call is None:
            return
        try:
            await asyncio.wait_for(_drain(call), grace_s)
        except Exception:  # noqa: BLE001 - a broken or slow peer: cancelling is enough
            pass
        finally:
            call.cancel()


async def _drain(call) -> None:
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


class GrpcTargetSession:
    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, sid: str, timeout_s: float):
        self.sid = sid
        self.stream = _Stream(stub.Session, timeout_s, "target")

    async def open(self, prompt_ids, sampling, seed) -> TargetOpenResult:
        r = await self.stream.ask(target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling), seed=seed)))
        return TargetOpenResult(r.opened.first_token, r.opened.prefill_ms)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        req = target_pb2.TargetRequest(verify=target_pb2.TargetVerify(
            draft_token_ids=draft_ids,
            draft_dists=[common_pb2.SparseDistribution(token_ids=i, probs=q) for i, q in dists]))
        t0 = time.perf_counter()
        r = await self.stream.ask(req)
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
    """Channels to the target and draft services, and the draft's availability."""

    def __init__(self, target_address: str, draft_address: str, timeout_s: float = 60.0,
                 retry_interval_s: float = 1.0):
        self.target_channel = grpc.aio.insecure_channel(target_address, options=CHANNEL_OPTIONS)
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.target_channel)
        self.draft_address = draft_address
        self.draft_channel = grpc.aio.insecure_channel(draft_address, options=CHANNEL_OPTIONS) if draft_address else None
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel) if self.draft_channel else None
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self.target: TargetFacts | None = None
        self.target_info: common_pb2.ModelInfo | None = None
        self.draft_info: common_pb2.ModelInfo | None = None
        self.draft_up = False
        self._monitor: asyncio.Task | None = None
        self._wake = asyncio.Event()

    async def connect_target(self, wait_s: float = 600.0) -> common_pb2.ModelInfo:
        """Wait until the target answers Info (it answers UNAVAILABLE while loading)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = await self.target_stub.Info(common_pb2.InfoRequest(), timeout=5.0)
                self.target_info = info
                self.target = TargetFacts(info.tokenizer_fingerprint, info.vocab_size, info.max_context,
                                          list(info.eos_token_ids))
                return info
            except grpc.aio.AioRpcError as e:
                if time.monotonic() > deadline:
                    raise Unavailable(f"target service did not come up: {e.details()}") from e
                await asyncio.sleep(0.5)

    async def _probe_draft(self) -> bool:
        try:
            self.draft_info = await self.draft_stub.Info(common_pb2.InfoRequest(), timeout=2.0)
            return True
        except grpc.aio.AioRpcError:
            return False

    def start_monitor(self) -> None:
        if self.draft_stub is not None and self._monitor is None:
            self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        """Probe the draft's Info every interval: marks it up or down, and notices a swapped draft."""
        while True:
            up = await self._probe_draft()
            if up and not self.draft_up:
                log.info("draft service %s is available (%s, %s)", self.draft_address,
                         self.draft_info.engine, self.draft_info.model)
            elif not up and self.draft_up:
                log.warning("draft service %s stopped answering", self.draft_address)
            self.draft_up = up
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.retry_interval_s)
            except asyncio.TimeoutError:
                pass

    def new_target_session(self, sid: str) -> GrpcTargetSession:
        return GrpcTargetSession(self.target_stub, sid, self.timeout_s)

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
