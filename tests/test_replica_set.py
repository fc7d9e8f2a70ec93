"""Replica placement without processes: what an address names, the least loaded replica, ejection."""
from __future__ import annotations

import asyncio
import socket
import time


from orchestrator.clients import ReplicaSet, resolve_addresses


class _Stub:
    def __init__(self, channel):
        self.channel = channel


class _Channel:
    def __init__(self, address, server_name):
        self.address, self.server_name, self.closed = address, server_name, False

    async def close(self):
        self.closed = True


def _answers(table):
    """A getaddrinfo that answers from `table` (host -> [(family, ip)])."""
    async def getaddrinfo(host, port, type=0):
        if host not in table:
            raise socket.gaierror("no such host")
        return [(fam, socket.SOCK_STREAM, 6, "", (ip, port)) for fam, ip in table[host]]
    return getaddrinfo


def _resolve(spec, table, monkeypatch):
    async def go():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", _answers(table))
        return await resolve_addresses(spec)
    return asyncio.run(go())


def test_a_name_with_several_addresses_is_several_replicas_with_its_name_for_tls(monkeypatch):
    table = {"specdec-target": [(socket.AF_INET, "10.0.0.7"), (socket.AF_INET, "10.0.0.5"),
                                (socket.AF_INET6, "fd00::5")],
             "localhost": [(socket.AF_INET6, "::1"), (socket.AF_INET, "127.0.0.1")]}
    assert _resolve("specdec-target:50052", table, monkeypatch) == {
        "10.0.0.5:50052": "specdec-target", "10.0.0.7:50052": "specdec-target"}
    # one answer (per family preferred), listed addresses and IPs stay as written
    assert _resolve("localhost:1, 10.1.1.1:2,gone:3", table, monkeypatch) == {
        "localhost:1": "", "10.1.1.1:2": "", "gone:3": ""}


def _set(*addresses, ejection_s=10.0) -> ReplicaSet:
    rs = ReplicaSet("target", ",".join(addresses), _Stub, ejection_s, _Channel)
    for r in rs.replicas.values():
        r.up = True
    return rs


def test_sessions_go_to_the_least_loaded_available_replica():
    rs = _set("a:1", "b:1", "c:1")
    rs.replicas["a:1"].sessions = 2
    rs.replicas["b:1"].sessions = 1
    rs.replicas["c:1"].sessions = 1
    rs.replicas["c:1"].up = False
    assert rs.pick().address == "b:1"
    assert rs.pick(exclude={"b:1"}).address == "a:1"


def test_an_ejected_replica_gets_no_new_session_while_another_answers():
    rs = _set("a:1", "b:1")
    rs.replicas["b:1"].sessions = 5
    rs.eject(rs.replicas["a:1"], RuntimeError("stream reset"))
    assert rs.pick().address == "b:1"
    rs.replicas["a:1"].up = True  # its probe answers again, but it is still ejected
    assert rs.pick().address == "b:1"
    rs.replicas["b:1"].up = False  # the only other one is down: an answering ejected one beats none
    assert rs.pick().address == "a:1"
    assert rs.pick(exclude={"a:1"}, worst="up") is None  # a failover never goes to a down replica
    assert rs.pick(exclude={"a:1"}).address == "b:1"  # a new request tries: a call finds out


def test_ejection_ends_after_its_time():
    rs = _set("a:1", "b:1", ejection_s=0.05)
    rs.replicas["a:1"].sessions = 0
    rs.replicas["b:1"].sessions = 3
    rs.eject(rs.replicas["a:1"], RuntimeError("x"))
    rs.replicas["a:1"].up = True
    assert rs.pick().address == "b:1"
    time.sleep(0.06)
    assert rs.pick().address == "a:1"


def test_a_request_that_outlives_two_failures_goes_back_to_a_restarted_replica():
    """a failed, the request moved to b; a was restarted (its probe answers); b fails: back to a."""
    rs = _set("a:1", "b:1", "c:1")
    rs.replicas["c:1"].up = False
    rs.eject(rs.replicas["a:1"], RuntimeError("killed"))
    assert rs.pick_replacement(["a:1"]).address == "b:1"
    rs.replicas["a:1"].up = True  # restarted: answers again (still inside its ejection time)
    rs.eject(rs.replicas["b:1"], RuntimeError("killed"))
    assert rs.pick_replacement(["a:1", "b:1"]).address == "a:1"
    rs.replicas["c:1"].up = True  # one the request has not been on comes first
    assert rs.pick_replacement(["a:1", "b:1"]).address == "c:1"
    rs.replicas["a:1"].up = rs.replicas["c:1"].up = False
    assert rs.pick_replacement(["a:1", "b:1"]) is None  # none answers
    rs.replicas["b:1"].up = True
    assert rs.pick_replacement(["a:1", "b:1"]) is None  # never straight back to the one just left


def test_replicas_that_leave_the_dns_answer_are_retired_once_their_sessions_end(monkeypatch):
    table = {"t": [(socket.AF_INET, "10.0.0.1"), (socket.AF_INET, "10.0.0.2")]}

    async def go():
        monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", _answers(table))
        rs = ReplicaSet("target", "t:9", _Stub, 10.0, _Channel)
        await rs.resolve()
        assert set(rs.replicas) == {"10.0.0.1:9", "10.0.0.2:9"}
        assert all(r.channel.server_name == "t" for r in rs.replicas.values())
        gone = rs.replicas["10.0.0.2:9"]
        gone.sessions = 1
        table["t"] = [(socket.AF_INET, "10.0.0.1"), (socket.AF_INET, "10.0.0.3")]
        await rs.resolve()
        assert set(rs.replicas) == {"10.0.0.1:9", "10.0.0.3:9"}
        assert not gone.channel.closed  # a session still runs on it
        gone.sessions = 0
        await rs.resolve()
        assert gone.channel.closed
    asyncio.run(go())


def test_a_replica_back_since_the_last_probe_takes_over_a_failed_request():
    """A request's target fails while the only other replica has restarted but was down at the
    last probe, and its channel is still in reconnect backoff (a quick probe fails, one that waits
    for the channel answers): the failover waits for it (FAILOVER_PROBE_S) and moves the request
    there. With nothing answering, there is no replacement (the client gets UNAVAILABLE)."""
    import inspect
    from types import SimpleNamespace

    import grpc

    from orchestrator.clients import GrpcBackends
    from specdec.v1 import common_pb2

    info = common_pb2.ModelInfo(tokenizer_fingerprint="f", vocab_size=10)
    refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "connection refused")

    class Answers:
        async def Info(self, request, timeout=None, wait_for_ready=None):
            return info

    class Reconnecting:  # back, but its channel retries only after a backoff
        async def Info(self, request, timeout=None, wait_for_ready=None):
            if not wait_for_ready:
                raise refused
            return info

    class Down:
        async def Info(self, request, timeout=None, wait_for_ready=None):
            raise refused

    async def replacement(b, failed):
        found = b.replacement_target_session(failed, "r-t1", None)
        return await found if inspect.isawaitable(found) else found

    async def go():
        b = GrpcBackends("127.0.0.1:1,127.0.0.1:2", "", probe_interval_s=60)
        b._target_session = lambda replica, sid, deadline: SimpleNamespace(replica=replica)  # no stream opened
        first, other = b.targets.replicas.values()
        first.stub = other.stub = Answers()
        await b._probe_targets()
        other.up, other.stub = False, Reconnecting()  # restarted: down at the last probe, channel in backoff
        await b._probe_targets()  # a regular probe fails fast: still down
        assert not other.up
        b.targets.eject(first, RuntimeError("killed mid-request"))
        first.stub = Down()
        failed = [SimpleNamespace(replica=first)]
        moved = await replacement(b, failed)
        assert moved is not None and moved.replica is other
        other.up, other.stub = False, Down()  # really down: no replacement
        assert await replacement(b, failed) is None
        await b.close()

    asyncio.run(go())
