"""The draft service: a thin gRPC shell over `DraftEngine` and one configured drafter."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from draft_service.drafters import Drafter, NgramDrafter, llamacpp_drafter, torch_drafter
from draft_service.engine import DraftEngine
from specdec import metrics
from specdec.config import DraftConfig
from specdec.devices import configure_process, process_memory_bytes, resolve_device
from specdec.errors import InvalidArgument
from specdec.rpc import Server, Servicer, StreamSession, boundary, sampling_from_proto, serve_session
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger("specdec.draft")
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


def make_drafter(cfg: DraftConfig, device: str) -> Drafter:
    if cfg.engine == "llamacpp":
        return llamacpp_drafter(cfg.model, cfg.context_tokens, max(1, cfg.num_threads), cfg.max_sessions)
    if cfg.engine == "torch":
        return torch_drafter(cfg.model, cfg.dtype, device)
    if cfg.engine == "ngram":
        return NgramDrafter(max_ngram=cfg.ngram_max, min_ngram=cfg.ngram_min)
    raise InvalidArgument(f"unknown draft engine {cfg.engine!r}: use llamacpp, torch or ngram")


class DraftServicer(draft_pb2_grpc.DraftServiceServicer, Servicer):
    loading = "the draft model is loading"

    def __init__(self, cfg: DraftConfig, device: str, engine: DraftEngine | None = None):
        self.cfg, self.device = cfg, device
        self.engine = engine  # None while the model loads: RPCs answer UNAVAILABLE
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="draft-forward")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @boundary
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        d = self.engine.drafter
        return common_pb2.ModelInfo(
            model=d.model, engine=d.engine, tokenizer_fingerprint=d.fingerprint, vocab_size=d.vocab_size,
            max_context=min(d.max_context, 2**31 - 1), dtype=self.cfg.dtype if d.engine == "torch" else "",
            device=self.device, weight_bytes=d.weight_bytes, kv_bytes_per_token=d.kv_bytes_per_token,
            max_sessions=self.engine.max_sessions, active_sessions=self.engine.active_sessions,
            kv_tokens_in_use=self.engine.kv_tokens_in_use)

    @boundary
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        async for reply in serve_session(request_iterator, context, {"open": self._open, "propose": self._propose},
                                         self._close):
            yield reply

    async def _open(self, o: draft_pb2.DraftOpen, owner: StreamSession) -> draft_pb2.DraftResponse:
        self.engine.open(o.session_id, list(o.prompt_token_ids), sampling_from_proto(o.sampling),
                         o.target_tokenizer_fingerprint, o.target_vocab_size, o.max_support)
        owner.session_id = o.session_id
        ms = await self._run(self.engine.prefill, o.session_id)
        return draft_pb2.DraftResponse(opened=draft_pb2.DraftOpened(prefill_ms=ms))

    async def _propose(self, p: draft_pb2.DraftPropose, owner: StreamSession) -> draft_pb2.DraftResponse:
        res = await self._run(self.engine.propose, owner.session_id, p.keep, list(p.append_token_ids), p.k, p.seed)
        metrics.DRAFT_SECONDS.observe(res.draft_ms / 1e3)
        return draft_pb2.DraftResponse(proposal=draft_pb2.DraftProposal(
            token_ids=res.token_ids, draft_ms=res.draft_ms,
            dists=[common_pb2.SparseDistribution(token_ids=i, probs=q) for i, q in res.dists]))

    def _close(self, sid: str) -> None:
        self.engine.close(sid)


async def serve(cfg: DraftConfig) -> None:
    device = resolve_device(cfg.device)
    configure_process(device, cfg.cpu_cores, cfg.num_threads, cfg.gpu_memory_fraction)
    server = Server(cfg.host, cfg.port, [SERVICE_NAME])
    servicer = DraftServicer(cfg, device)
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server.server)
    await server.start()
    await server.set_serving(False)
    log.info("draft service on %s, loading %s engine %s", server.address, cfg.engine, cfg.model)
    drafter = await asyncio.to_thread(make_drafter, cfg, device)
    servicer.engine = engine = DraftEngine(drafter, cfg)
    metrics.DRAFT_SESSIONS.set_function(lambda: engine.active_sessions)
    metrics.start(cfg.host, cfg.metrics_port, "draft", lambda: process_memory_bytes(device), drafter.weight_bytes,
                  drafter.kv_bytes_per_token)
    await server.set_serving(True)
    log.info("draft service ready on %s (%s, %s)", server.address, cfg.engine, cfg.model)
    await server.run_until_signal(cfg.shutdown_grace_s)
