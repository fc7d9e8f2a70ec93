"""gRPC backends for the orchestrator engine: one bidirectional stream per session.

Each call of a session writes one request on its stream and reads one reply. The draft
service is optional at every moment: when a call to it fails it is marked down, and a
monitor polls its health until it answers again.
"""
from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
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

    Writes take turns (`_write`): grpc takes one at a time on a stream, and refuses a second
    one in grpc core, which fails the call on this side only (INTERNAL, "Internal error from
    Core") and leaves the service's side open, its session held until the stream's deadline.
    A signal (the draft's cut) is written while a call waits for its reply, so it may come
    while that call's request is still being written (a long catch-up).
    """

    def __init__(self, open_stream, timeout_s: float, peer: str, deadline: float | None, address: str = ""):
        self._open_stream = open_stream
        self.timeout_s = timeout_s
        self.peer = peer
        self.address = address
        self.deadline = deadline
        self.call = None
        self._writing = asyncio.Lock()  # one write at a time

    async def _write(self, call, request) -> None:
        async with self._writing:
            await call.write(request)

    def _wait_s(self) -> float:
        if self.deadline is None:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, self.deadline - time.monotonic()))

    async def ask(self, request, during: str):
        try:
            if self.call is None:
                left = None if self.deadline is None else max(0.001, self.deadline - time.monotonic())
                self.call = self._open_stream(timeout=left)
            await asyncio.wait_for(self._write(self.call, request), self._wait_s())
            reply = await asyncio.wait_for(self.call.read(), self._wait_s())
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - translated at this edge
            raise self._error(e, during) from e
        if reply is grpc.aio.EOF:
            raise Unavailable(f"the {self.peer} service {self.address} closed the session stream {during} "
                              f"({await self.call.code()})")
        return reply

    def _error(self, e: BaseException, during: str) -> SpecdecError:
        """A peer's failure as ours: say which peer, and whose fault it is."""
        peer = f"{self.peer} service" + (f" ({self.address})" if self.address else "")
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
        # grpc core itself answers INTERNAL ("Internal error from Core") now and then for a write on
        # a stream whose peer was just killed (grpc/grpc#36066): the peer is gone, not at fault
        core_lost_peer = code == grpc.StatusCode.INTERNAL and details.startswith("Internal error from Core")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN) or core_lost_peer:
            return Unavailable(f"the {peer} is unavailable {during} ({code.name}: {details})")
        return Internal(f"the {peer} failed {during} ({code.name}: {details})")

    async def signal(self, request, during: str) -> None:
        """Write a request that gets no reply of its own (it may overlap a call waiting for its reply);
        best effort: a failure is logged and dropped, the call in flight reports what is wrong."""
        if self.call is None:
            return
        await quietly(asyncio.wait_for(self._write(self.call, request), self._wait_s()), f"{self.peer} signal {during}")

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
                await quietly(asyncio.wait_for(self._drain(call), grace_s), f"{self.peer} stream close")
        finally:
            call.cancel()

    async def _drain(self, call) -> None:
        async with self._writing:  # after the write in flight, if any
            await call.done_writing()
        while await call.read() is not grpc.aio.EOF:
            pass


AT_OPEN = "at session open"
IN_ROUND = "during a round"


class _ReplicaSession:
    """A session on one replica: one stream, counted in the replica's load while open. A failed
    call for which `replica_failed(error)` says so reports the replica (`on_failure`)."""

    kind = ""

    def __init__(self, replica: "Replica", sid: str, timeout_s: float, deadline: float | None,
                 on_failure: Callable[["Replica", BaseException], None] = lambda r, e: None):
        self.sid = sid
        self.replica = replica
        self.stream = _Stream(replica.stub.Session, timeout_s, self.kind, deadline, replica.address)
        self.on_failure = on_failure
        replica.sessions += 1
        self._closed = False

    @staticmethod
    def replica_failed(error: Exception) -> bool:
        raise NotImplementedError

    async def _ask(self, request, during: str):
        try:
            return await self.stream.ask(request, during)
        except Exception as e:
            if self.replica_failed(e):
                self.on_failure(self.replica, e)
            raise

    async def close(self):
        if not self._closed:
            self._closed = True
            self.replica.sessions -= 1
        await self.stream.close()


class GrpcTargetSession(_ReplicaSession):
    """A target session on one target replica; a replica found unavailable is reported."""

    kind = "target"

    @staticmethod
    def replica_failed(error: Exception) -> bool:
        return isinstance(error, Unavailable)

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


class GrpcDraftSession(_ReplicaSession):
    """A draft session on one draft replica. A failure that says something about the replica's
    health (not a full draft, not the request's own deadline) reports the replica."""

    kind = "draft"

    def __init__(self, *args, max_support: int = 0, **kw):
        super().__init__(*args, **kw)
        self.max_support = max_support

    @staticmethod
    def replica_failed(error: Exception) -> bool:
        return not isinstance(error, (ResourceExhausted, DeadlineExceeded))

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_tokens, max_draft) -> float:
        r = await self._ask(draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id=self.sid, prompt_token_ids=prompt_ids, sampling=sampling_to_proto(sampling),
            target_tokenizer_fingerprint=target_fingerprint, target_vocab_size=target_vocab_size,
            max_support=self.max_support, max_tokens=max_tokens, max_draft=max_draft)), AT_OPEN)
        return r.opened.prefill_ms

    async def propose(self, keep, append, k, seed, guess_first=False) -> DraftResult:
        t0 = time.perf_counter()
        r = await self._ask(draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(
            keep=keep, append_token_ids=append, k=k, seed=seed, guess_first=guess_first)), IN_ROUND)
        rtt = (time.perf_counter() - t0) * 1e3
        p = r.proposal
        metrics.RPC_LATENCY.labels("draft").observe(max(0.0, rtt - p.draft_ms) / 1e3)
        return DraftResult(list(p.token_ids), [(list(d.token_ids), list(d.probs)) for d in p.dists], p.draft_ms)

    async def cut(self) -> None:
        await self.stream.signal(draft_pb2.DraftRequest(cut=draft_pb2.DraftCut()), IN_ROUND)


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


# -- replicas ----------------------------------------------------------------------------------------

@dataclass
class Replica:
    """One target or draft service process, as this orchestrator sees it."""

    address: str
    channel: grpc.aio.Channel
    stub: object
    info: common_pb2.ModelInfo | None = None
    up: bool = False  # its last probe answered (and, for a draft, it can draft for the target)
    problem: str = ""  # why it is not up
    ejected_until: float = 0.0  # time.monotonic(): a call to it failed, new sessions go elsewhere
    sessions: int = 0  # sessions this orchestrator has open on it

    def available(self, now: float) -> bool:
        return self.up and now >= self.ejected_until

    def load(self) -> tuple[int, int]:
        return self.sessions, self.info.active_sessions if self.info is not None else 0


def split_addresses(spec: str) -> list[str]:
    """"host:port", or several separated by commas."""
    return [a.strip() for a in spec.split(",") if a.strip()]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


async def resolve_addresses(spec: str) -> dict[str, str]:
    """Every replica `spec` names: each listed address, and each address a DNS name resolves to
    (a Kubernetes headless Service gives one per ready pod), with the name a replica's TLS
    certificate must carry when its address is an IP resolved from a name (else ""). IPv4
    answers are preferred, so that "localhost" is one replica and not two."""
    loop = asyncio.get_running_loop()
    out: dict[str, str] = {}
    for address in split_addresses(spec):
        host, _, port = address.rpartition(":")
        if not host or _is_ip(host) or not port.isdigit():
            out[address] = ""
            continue
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
        v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
        ips = v4 or v6
        if len(ips) <= 1:
            out[address] = ""  # one (or no) answer: let gRPC resolve it, as it always did
        else:
            out.update({f"{ip}:{port}" if ":" not in ip else f"[{ip}]:{port}": host for ip in ips})
    return out


class ReplicaSet:
    """The replicas of one service: where its address points, which of them answer, and the least
    loaded one for a new session. A replica whose call failed is ejected for `ejection_s`: new
    sessions go to the others, and it is used again before then only when no other one answers."""

    def __init__(self, kind: str, spec: str, make_stub, ejection_s: float,
                 channel_factory: Callable[[str, str], grpc.aio.Channel]):
        self.kind = kind
        self.spec = spec
        self.make_stub = make_stub
        self.ejection_s = ejection_s
        self.channel_factory = channel_factory
        self.replicas: dict[str, Replica] = {}
        self._retired: list[Replica] = []  # gone from DNS, channel closed when their sessions end
        for address in split_addresses(spec):
            self._add(address)

    def _add(self, address: str, server_name: str = "") -> None:
        channel = self.channel_factory(address, server_name)
        self.replicas[address] = Replica(address, channel, self.make_stub(channel))

    async def resolve(self) -> None:
        """Follow the address: new replicas join, replicas that are gone leave."""
        addresses = await resolve_addresses(self.spec)
        if not addresses:
            return
        for address, server_name in addresses.items():
            if address not in self.replicas:
                log.info("%s replica %s joined", self.kind, address)
                self._add(address, server_name)
        for address in [a for a in self.replicas if a not in addresses]:
            log.info("%s replica %s left", self.kind, address)
            self._retired.append(self.replicas.pop(address))
        for r in [r for r in self._retired if r.sessions == 0]:
            self._retired.remove(r)
            await r.channel.close()

    def pick(self, exclude: set[str] = frozenset(), worst: str = "any") -> Replica | None:
        """The least loaded replica not in `exclude`, from the best group that has one: available,
        then answering though ejected (when no other answers), then any (a call finds out whether it
        is back); `worst` names the last group to look in."""
        now = time.monotonic()
        candidates = [r for r in self.replicas.values() if r.address not in exclude]
        groups = {"available": lambda r: r.available(now), "up": lambda r: r.up, "any": lambda r: True}
        for name, usable in groups.items():
            pool = [r for r in candidates if usable(r)]
            if pool:
                return min(pool, key=Replica.load)
            if name == worst:
                break
        return None

    def pick_replacement(self, left: list[str]) -> Replica | None:
        """For a request whose replica failed: one it has not been on, else one it left earlier
        that has answered a probe since (restarted), never the one it has just left (`left[-1]`);
        only replicas that answer."""
        return self.pick(exclude=set(left), worst="up") or self.pick(exclude={left[-1]}, worst="up")

    def eject(self, replica: Replica, error: BaseException) -> None:
        if replica.up:
            log.warning("%s replica %s failed, ejected for %.0f s: %s", self.kind, replica.address,
                        self.ejection_s, error)
        replica.up = False
        replica.problem = str(error)
        replica.ejected_until = time.monotonic() + self.ejection_s

    @property
    def any_up(self) -> bool:
        return any(r.up for r in self.replicas.values())

    def first_up(self) -> Replica | None:
        return next((r for r in self.replicas.values() if r.up), None)

    def statuses(self) -> list[dict]:
        now = time.monotonic()
        return [dict(kind=self.kind, address=r.address, up=r.up, ejected=now < r.ejected_until,
                     sessions=r.sessions, problem="" if r.up else r.problem) for r in self.replicas.values()]

    async def close(self) -> None:
        for r in [*self.replicas.values(), *self._retired]:
            await r.channel.close()


# How long a failover waits for another target replica's channel to reconnect when none answered
# the last probe: the channels retry at most every 1 s (rpc.CHANNEL_OPTIONS), plus jitter.
FAILOVER_PROBE_S = 2.0


class GrpcBackends:
    """The target and draft replicas, and whether each is up.

    A monitor re-resolves the addresses and probes every replica's Info every `probe_interval_s`:
    a draft that answers again is re-attached by running requests, and whether any target answers
    is reported through `on_target_change` (the orchestrator's own health follows it). A failed
    call ejects its replica at once and wakes the monitor; a request whose target fails is moved
    to another target replica by the engine (`replacement_target_session`).
    """

    def __init__(self, target_address: str, draft_address: str, timeout_s: float = 60.0,
                 probe_interval_s: float = 1.0,
                 on_target_change: Callable[[bool], Awaitable[None]] | None = None,
                 ejection_s: float = 10.0,
                 channel_factory: Callable[[str, str], grpc.aio.Channel] | None = None):
        """`channel_factory(address, server_name)`: a channel to one replica (plaintext by default;
        `server_name` is the name its TLS certificate carries when `address` is a resolved IP)."""
        factory = channel_factory or (lambda a, name: grpc.aio.insecure_channel(a, options=CHANNEL_OPTIONS))
        self.targets = ReplicaSet("target", target_address, target_pb2_grpc.TargetServiceStub, ejection_s, factory)
        self.drafts = ReplicaSet("draft", draft_address, draft_pb2_grpc.DraftServiceStub, ejection_s, factory)
        self.target_address = target_address
        self.draft_address = draft_address
        self.timeout_s = timeout_s
        self.probe_interval_s = probe_interval_s
        self.on_target_change = on_target_change
        self.target: TargetFacts | None = None
        self.target_info: common_pb2.ModelInfo | None = None  # the first target to answer: the model served
        self.target_up = False
        self._monitor: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # -- what the orchestrator shows -----------------------------------------------------------
    @property
    def draft_up(self) -> bool:
        return self.drafts.any_up

    @property
    def draft_info(self) -> common_pb2.ModelInfo | None:
        r = self.drafts.first_up() or next(iter(self.drafts.replicas.values()), None)
        return r.info if r is not None else None

    @property
    def draft_problem(self) -> str:
        """Why no draft is offered ("" when one is)."""
        if self.draft_up or not self.drafts.replicas:
            return ""
        return "; ".join(r.problem for r in self.drafts.replicas.values() if r.problem)

    def replica_statuses(self) -> list[dict]:
        return self.targets.statuses() + self.drafts.statuses()

    # -- probing -------------------------------------------------------------------------------
    async def connect_target(self, wait_s: float = 600.0) -> common_pb2.ModelInfo:
        """Wait until a target replica answers Info (they answer UNAVAILABLE while loading)."""
        deadline = time.monotonic() + wait_s
        while True:
            await self.targets.resolve()
            await self._probe_targets()
            if self.targets.any_up:
                return self.target_info
            if time.monotonic() > deadline:
                raise Unavailable(f"no target service at {self.target_address} came up in {wait_s:.0f} s")
            await asyncio.sleep(0.5)

    async def _probe_targets(self) -> None:
        await asyncio.gather(*(self._probe_target(r) for r in list(self.targets.replicas.values())))

    async def _probe_target(self, r: Replica, wait_s: float | None = None) -> None:
        """Info from `r`: failing fast while its channel is not connected, or with `wait_s`
        waiting up to that long for the channel to (re)connect."""
        call = dict(timeout=wait_s, wait_for_ready=True) if wait_s else dict(timeout=2.0)
        try:
            info = await r.stub.Info(common_pb2.InfoRequest(), **call)
        except grpc.aio.AioRpcError as e:
            r.up, r.problem = False, f"the target service at {r.address} does not answer ({e.code().name})"
            return
        if self.target_info is None:
            self.target_info = info
            self.target = TargetFacts(info.tokenizer_fingerprint, info.vocab_size, info.max_context,
                                      list(info.eos_token_ids))
        problem = _replica_mismatch(info, self.target_info)
        if problem and problem != r.problem:
            log.error("target replica %s: %s", r.address, problem)
        r.info, r.up, r.problem = info, not problem, problem

    async def _probe_draft(self, r: Replica) -> None:
        """Up = it answers and can draft for this target (same tokenizer, vocabulary not larger)."""
        try:
            r.info = await r.stub.Info(common_pb2.InfoRequest(), timeout=2.0)
        except grpc.aio.AioRpcError as e:
            r.up, r.problem = False, f"the draft service at {r.address} does not answer ({e.code().name})"
            return
        problem = draft_mismatch(r.info, self.target_info)
        if problem and problem != r.problem:
            log.error("%s", problem)
        if not problem and not r.up:
            log.info("draft service %s is available (%s, %s)", r.address, r.info.engine, r.info.model)
        r.up, r.problem = not problem, problem

    async def _probe_all(self) -> None:
        await asyncio.gather(self.targets.resolve(), self.drafts.resolve())
        await self._probe_targets()
        await asyncio.gather(*(self._probe_draft(r) for r in list(self.drafts.replicas.values())))
        await self._set_target_up(self.targets.any_up)

    async def refresh(self) -> None:
        """Probe every replica now (their Info, with its live occupancy)."""
        await self._probe_all()

    def start_monitor(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.ensure_future(self._monitor_loop())

    async def _monitor_loop(self) -> None:
        while True:
            try:
                await self._probe_all()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one probe
                log.exception("replica probe failed")
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

    # -- sessions ------------------------------------------------------------------------------
    def _target_failed(self, replica: Replica, error: BaseException) -> None:
        """A call found this target replica unavailable: eject it now, let the monitor confirm."""
        self.targets.eject(replica, error)
        if self.target_up and not self.targets.any_up:
            asyncio.ensure_future(self._set_target_up(False))
        self._wake.set()

    def _draft_replica_failed(self, replica: Replica, error: BaseException) -> None:
        self.drafts.eject(replica, error)
        self._wake.set()

    def _target_session(self, replica: Replica, sid: str, deadline: float | None) -> GrpcTargetSession:
        return GrpcTargetSession(replica, sid, self.timeout_s, deadline, self._target_failed)

    def new_target_session(self, sid: str, deadline: float | None) -> GrpcTargetSession:
        replica = self.targets.pick()
        if replica is None:
            raise Unavailable(f"no target service at {self.target_address!r}")
        return self._target_session(replica, sid, deadline)

    async def replacement_target_session(self, failed: list[GrpcTargetSession], sid: str,
                                         deadline: float | None) -> GrpcTargetSession | None:
        """A session on another target replica that answers, for a request whose target failed
        (ReplicaSet.pick_replacement); None when there is none. When none is known to answer, the
        others are probed first, each waiting up to FAILOVER_PROBE_S (never past the request's
        deadline) for its channel to reconnect: a replica restarted since the last probe takes
        the request rather than the request failing. (CI saw it fail: the other replica had been
        ready for 1.0 s, but its channel was still in reconnect backoff, so probes failed fast.)"""
        left = [s.replica.address for s in failed]
        replica = self.targets.pick_replacement(left)
        if replica is None:
            wait_s = FAILOVER_PROBE_S if deadline is None else min(FAILOVER_PROBE_S, deadline - time.monotonic())
            others = [r for r in self.targets.replicas.values() if r.address != left[-1]]
            if wait_s > 0 and others:
                await asyncio.gather(*(self._probe_target(r, wait_s) for r in others))
                replica = self.targets.pick_replacement(left)
        return None if replica is None else self._target_session(replica, sid, deadline)

    def new_draft_session(self, sid: str, deadline: float | None) -> GrpcDraftSession | None:
        """A session on the least loaded draft replica that is up; None when none is."""
        replica = self.drafts.pick(worst="up")
        if replica is None:
            return None
        return GrpcDraftSession(replica, sid, self.timeout_s, deadline, self._draft_replica_failed)

    def draft_failed(self, error: BaseException) -> None:
        """A draft call failed and the request goes on target-only. The session already ejected
        its replica if the failure says the replica is unwell (a full draft, or a call cut by the
        request's own deadline, does not); the monitor probes at once."""
        self._wake.set()

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.targets.close()
        await self.drafts.close()


def _replica_mismatch(info: common_pb2.ModelInfo, first: common_pb2.ModelInfo) -> str:
    """Why a target replica cannot serve with the others ("" when it can): every replica must
    serve the same model, since a request may move from one to another."""
    if (info.tokenizer_fingerprint, info.vocab_size) != (first.tokenizer_fingerprint, first.vocab_size):
        return (f"it serves {info.model!r} ({info.tokenizer_fingerprint[:12]}, vocabulary {info.vocab_size}), "
                f"the first target served {first.model!r} ({first.tokenizer_fingerprint[:12]}, "
                f"vocabulary {first.vocab_size}): not used")
    return ""
