"""One session per stream (`specdec.rpc.serve_session`), without a network: calls are answered one
at a time and in order; a signal (the draft's `cut`) is handled while a call is still running."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from fake_peers import ThreadedServer, add_draft
from orchestrator.clients import GrpcDraftSession, Replica
from specdec.rpc import StreamSession, serve_session
from specdec.sampling_params import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        raise Aborted(f"{code.name}: {details}")


def request(kind: str) -> draft_pb2.DraftRequest:
    return draft_pb2.DraftRequest(**{kind: getattr(draft_pb2, {"open": "DraftOpen", "propose": "DraftPropose",
                                                               "cut": "DraftCut"}[kind])()})


async def stream(*kinds: str):
    for kind in kinds:
        await asyncio.sleep(0)
        yield request(kind)


def serve(kinds: list[str], handlers, signals, closed: list) -> list:
    async def go():
        return [r async for r in serve_session(stream(*kinds), Context(), handlers, closed.append, signals)]
    return asyncio.run(asyncio.wait_for(go(), 5))


def test_a_signal_reaches_the_call_in_flight_and_gets_no_reply():
    cut = asyncio.Event()
    log = []

    async def open_(msg, owner: StreamSession):
        owner.session_id = "s"
        return "opened"

    async def propose(msg, owner):
        log.append("propose waits")
        await cut.wait()  # only a cut handled meanwhile lets it finish
        return "proposal"

    def on_cut(msg, owner):
        log.append(f"cut {owner.session_id}")
        cut.set()

    closed = []
    replies = serve(["open", "propose", "cut"], {"open": open_, "propose": propose}, {"cut": on_cut}, closed)
    assert replies == ["opened", "proposal"]
    assert log == ["propose waits", "cut s"]
    assert closed == ["s"]


@pytest.mark.parametrize("kinds, needle", [(["cut"], "cut before open"), (["propose"], "propose before open"),
                                           (["open", "open"], "already open")])
def test_a_stream_out_of_order_is_refused_and_the_session_closed(kinds, needle):
    async def open_(msg, owner):
        owner.session_id = "s"
        return "opened"

    async def propose(msg, owner):
        return "proposal"

    closed = []
    with pytest.raises(Aborted, match=needle):
        serve(kinds, {"open": open_, "propose": propose}, {"cut": lambda m, o: None}, closed)
    assert closed == (["s"] if kinds[0] == "open" else [])


def test_calls_sent_without_waiting_are_read_one_ahead_at_most():
    pulled = []
    release = asyncio.Event()

    async def many():
        for kind in ["open"] + ["propose"] * 10:
            pulled.append(kind)
            yield request(kind)

    async def open_(msg, owner):
        owner.session_id = "s"
        return "opened"

    async def propose(msg, owner):
        if not release.is_set():
            for _ in range(20):
                await asyncio.sleep(0)  # the reader runs meanwhile
            read_during_first_call.append(len(pulled))
            release.set()
        return "proposal"

    read_during_first_call: list[int] = []

    async def go():
        return [r async for r in serve_session(many(), Context(), {"open": open_, "propose": propose}, lambda s: None)]

    replies = asyncio.run(asyncio.wait_for(go(), 5))
    assert replies == ["opened"] + ["proposal"] * 10
    assert read_during_first_call == [3]  # open, the propose being handled, and the next one


def test_a_refusal_read_while_a_call_fails_is_not_a_second_abort():
    """The reader sees a broken message while the call before it is running; that call then
    fails. The RPC ends once, with the call's own error (grpc refuses a second abort)."""
    class OnceContext(Context):
        aborts = 0

        async def abort(self, code, details):
            OnceContext.aborts += 1
            if OnceContext.aborts > 1:
                raise RuntimeError("Abort already called!")
            await super().abort(code, details)

    class CallFailed(Exception):
        pass

    async def open_(msg, owner):
        owner.session_id = "s"
        for _ in range(20):
            await asyncio.sleep(0)  # the reader reads the second open meanwhile
        raise CallFailed("the open failed")

    async def go():
        return [r async for r in serve_session(stream("open", "open"), OnceContext(), {"open": open_},
                                               lambda s: None)]

    with pytest.raises(CallFailed):
        asyncio.run(asyncio.wait_for(go(), 5))
    assert OnceContext.aborts == 0


def test_a_handler_cancelled_mid_call_closes_its_session_at_once():
    """The RPC is cancelled (a client gone, a deadline) while a call runs and the stream is still
    open; grpc may cancel the handler again while it cleans up: the session is closed anyway."""
    closed = []
    started = asyncio.Event()

    async def endless():
        yield request("open")
        yield request("propose")
        await asyncio.Event().wait()  # the client neither sends more nor closes its side

    async def open_(msg, owner):
        owner.session_id = "s"
        return "opened"

    async def propose(msg, owner):
        started.set()
        await asyncio.sleep(10)

    async def consume():
        async for _ in serve_session(endless(), Context(), {"open": open_, "propose": propose}, closed.append):
            pass

    async def go():
        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        await asyncio.sleep(0)
        task.cancel()  # again, during the cleanup
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(go(), 5))
    assert closed == ["s"]


# -- over gRPC: the orchestrator's session client against serve_session --------------------------

class CutWaitingDraft(draft_pb2_grpc.DraftServiceServicer):
    """Opens a session; a propose waits for a cut (at most 5 s), then answers with nothing."""

    def __init__(self):
        self.closed: list[str] = []
        self.cut = asyncio.Event()

    async def Session(self, request_iterator, context):
        async def open_(msg, owner):
            owner.session_id = msg.session_id
            return draft_pb2.DraftResponse(opened=draft_pb2.DraftOpened())

        async def propose(msg, owner):
            await asyncio.wait_for(self.cut.wait(), 5)
            return draft_pb2.DraftResponse(proposal=draft_pb2.DraftProposal())

        async for reply in serve_session(request_iterator, context, {"open": open_, "propose": propose},
                                         self.closed.append, signals={"cut": lambda m, o: self.cut.set()}):
            yield reply


def test_a_cut_sent_while_the_propose_is_still_being_written_waits_its_turn_and_the_session_closes():
    """The speculation's propose is still being written (a long catch-up: more than a flow-control
    window) when the round sends its cut. grpc takes one write at a time on a stream: a second
    one is refused by grpc core, which fails the call locally with INTERNAL and leaves the
    service's side open (its session was held until the stream's deadline, and the orchestrator
    ejected a healthy replica). The cut waits for the write, reaches the propose, and closing
    the session ends it in the service."""
    draft = CutWaitingDraft()
    with ThreadedServer(add_draft(draft)) as server:
        async def go():
            channel = grpc.aio.insecure_channel(server.address)
            replica = Replica(server.address, channel, draft_pb2_grpc.DraftServiceStub(channel))
            ds = GrpcDraftSession(replica, "s", 10.0, None)
            await ds.open([1, 2, 3], SamplingParams(), "", 0, 0, 0)
            propose = asyncio.ensure_future(ds.propose(3, [5] * 300_000, 4, 0))
            for _ in range(3):
                await asyncio.sleep(0)  # the propose's write has begun
            await ds.cut()
            await asyncio.wait_for(propose, 10)
            await ds.close()
            await channel.close()

        asyncio.run(asyncio.wait_for(go(), 20))
        for _ in range(100):
            if draft.closed:
                break
            time.sleep(0.02)
        assert draft.closed == ["s"]
