"""Misbehaving peer services for error-boundary tests: they speak the real protocol, badly.

They stand in for a broken or hung *peer* of the orchestrator (never for a model in an
end-to-end test), and run in a thread of the test process on a loopback port.
"""
from __future__ import annotations

import asyncio
import threading

import grpc

from specdec.launcher import free_port
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class ThreadedServer:
    """A grpc.aio server with the given servicers, on its own event loop in a daemon thread."""

    def __init__(self, add_servicers):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._add = add_servicers
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self):
        self.server = grpc.aio.server()
        self._add(self.server)
        self.server.add_insecure_port(self.address)
        await self.server.start()

    def __enter__(self) -> "ThreadedServer":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class BrokenDraft(draft_pb2_grpc.DraftServiceServicer):
    """A draft that claims the target's tokenizer, then proposes tokens with malformed q~
    (probabilities summing to 0.5): a target must refuse such a round."""

    def __init__(self, info: common_pb2.ModelInfo):
        self.info = common_pb2.ModelInfo()
        self.info.CopyFrom(info)
        self.info.engine = "broken"
        self.proposals = 0

    async def Info(self, request, context):
        return self.info

    async def Session(self, request_iterator, context):
        async for req in request_iterator:
            if req.WhichOneof("kind") == "open":
                yield draft_pb2.DraftResponse(opened=draft_pb2.DraftOpened(prefill_ms=0.1))
            else:
                self.proposals += 1
                k = req.propose.k
                toks = [(100 + 7 * i) % self.info.vocab_size for i in range(k)]
                yield draft_pb2.DraftResponse(proposal=draft_pb2.DraftProposal(
                    token_ids=toks, draft_ms=0.1,
                    dists=[common_pb2.SparseDistribution(token_ids=[t], probs=[0.5]) for t in toks]))


class HungTarget(target_pb2_grpc.TargetServiceServicer):
    """A target that answers Info and accepts sessions, then never replies."""

    def __init__(self, info: common_pb2.ModelInfo):
        self.info = info

    async def Info(self, request, context):
        return self.info

    async def Session(self, request_iterator, context):
        async for _ in request_iterator:
            await asyncio.sleep(3600)
        if False:  # pragma: no cover - makes this an async generator
            yield target_pb2.TargetResponse()


def add_draft(servicer):
    return lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)


def add_target(servicer):
    return lambda server: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server)
