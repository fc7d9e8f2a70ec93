"""The draft service: a thin gRPC shell over `DraftEngine` (a model in a KV pool) or `NgramDraftEngine`."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import grpc

from draft_service.engine import DraftEngine, NgramDraftEngine
from specdec import metrics, security
from specdec.config import DraftConfig
from specdec.devices import configure_process, resolve_device, resolve_draft_engine
from specdec.errors import InvalidArgument
from specdec.rpc import ModelServicer, Server, add_servicer, StreamSession, boundary, sampling_from_proto, serve_session
from specdec.serving.runners import load_runner
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger("specdec.draft")
SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"]
SERVICE_NAME = SERVICE.full_name


def make_engine(cfg: DraftConfig, device: str) -> DraftEngine | NgramDraftEngine:
    if cfg.engine == "ngram":
        return NgramDraftEngine(cfg)
    if cfg.engine in ("llamacpp", "torch"):
        return DraftEngine(load_runner(cfg, device), cfg, metrics.step_observer("draft"))
    raise InvalidArgument(f"unknown draft engine {cfg.engine!r}: use llamacpp, torch or ngram")


class DraftServicer(ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    loading = "the draft model is loading"

    cfg: DraftConfig
    engine: DraftEngine | NgramDraftEngine | None  # None while the model loads: RPCs answer UNAVAILABLE

    @boundary
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        async for reply in serve_session(request_iterator, context, {"open": self._open, "propose": self._propose},
                                         self.engine.close, signals={"cut": self._cut}):
            yield reply

    async def _open(self, o: draft_pb2.DraftOpen, owner: StreamSession) -> draft_pb2.DraftResponse:
        await self.engine.open(o.session_id, list(o.prompt_token_ids), sampling_from_proto(o.sampling),
                               o.target_tokenizer_fingerprint, o.target_vocab_size, o.max_support, o.max_tokens,
                               o.max_draft)
        owner.session_id = o.session_id
        ms = await asyncio.wrap_future(self.engine.prefill(o.session_id))
        return draft_pb2.DraftResponse(opened=draft_pb2.DraftOpened(prefill_ms=ms))

    def _cut(self, _: draft_pb2.DraftCut, owner: StreamSession) -> None:
        self.engine.cut(owner.session_id)

    async def _propose(self, p: draft_pb2.DraftPropose, owner: StreamSession) -> draft_pb2.DraftResponse:
        res = await asyncio.wrap_future(
            self.engine.propose(owner.session_id, p.keep, list(p.append_token_ids), p.k, p.seed, p.guess_first))
        if p.k:  # a catch-up (k = 0) drafts nothing
            metrics.DRAFT_SECONDS.observe(res.draft_ms / 1e3)
        return draft_pb2.DraftResponse(proposal=draft_pb2.DraftProposal(
            token_ids=res.token_ids, draft_ms=res.draft_ms,
            dists=[common_pb2.SparseDistribution(token_ids=i, probs=q) for i, q in res.dists]))


async def serve(cfg: DraftConfig) -> None:
    device = resolve_device(cfg.device)
    cfg = replace(cfg, engine=resolve_draft_engine(cfg.engine, device))
    configure_process(device, cfg.cpu_cores, cfg.num_threads, cfg.gpu_memory_fraction)
    server = Server(cfg.host, cfg.port, [SERVICE_NAME], credentials=security.server_credentials(cfg))
    servicer = DraftServicer(cfg, device)
    add_servicer(server.server, servicer, SERVICE)
    await server.start()
    await server.set_serving(False)
    log.info("draft service on %s, loading %s engine %s", server.address, cfg.engine, cfg.model)
    servicer.engine = engine = (await asyncio.to_thread(make_engine, cfg, device)).start()
    metrics.watch("draft", engine, device)
    metrics.start(cfg.host, cfg.metrics_port)
    await server.set_serving(True)
    log.info("draft service ready on %s (%s, %s)", server.address, cfg.engine, cfg.model)
    await server.run_until_signal(cfg.shutdown_grace_s, lambda: asyncio.to_thread(engine.stop))
