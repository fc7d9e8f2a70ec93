"""The target service: a thin gRPC shell over `TargetEngine`."""
from __future__ import annotations

import asyncio
import logging

import grpc

from specdec import metrics, security
from specdec.config import TargetConfig
from specdec.devices import configure_process, resolve_device
from specdec.errors import InvalidArgument
from specdec.serving.runners import load_runner
from specdec.rpc import ModelServicer, Server, add_servicer, StreamSession, boundary, sampling_from_proto, serve_session
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

log = logging.getLogger("specdec.target")
SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
SERVICE_NAME = SERVICE.full_name


class TargetServicer(ModelServicer, target_pb2_grpc.TargetServiceServicer):
    loading = "the target model is loading"

    cfg: TargetConfig
    engine: TargetEngine | None  # None while the model loads: RPCs answer UNAVAILABLE

    @boundary
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        async for reply in serve_session(request_iterator, context, {"open": self._open, "verify": self._verify},
                                         self.engine.close):
            yield reply

    async def _open(self, o: target_pb2.TargetOpen, owner: StreamSession) -> target_pb2.TargetResponse:
        await self.engine.open(o.session_id, list(o.prompt_token_ids), sampling_from_proto(o.sampling), o.seed,
                               o.max_tokens, o.max_draft)
        owner.session_id = o.session_id
        opened = await asyncio.wrap_future(self.engine.prefill(o.session_id))
        metrics.PREFILL_SECONDS.observe(opened.prefill_ms / 1e3)
        return target_pb2.TargetResponse(opened=target_pb2.TargetOpened(
            first_token=opened.first_token, prefill_ms=opened.prefill_ms, kv_tokens=opened.kv_tokens))

    async def _verify(self, v: target_pb2.TargetVerify, owner: StreamSession) -> target_pb2.TargetResponse:
        dists = [(list(d.token_ids), list(d.probs)) for d in v.draft_dists]
        try:
            pending = self.engine.verify(owner.session_id, list(v.draft_token_ids), dists)
        except InvalidArgument as e:  # checked before the session changed: it stays open
            return target_pb2.TargetResponse(refused=target_pb2.RoundRefused(message=e.message))
        res = await asyncio.wrap_future(pending)
        metrics.VERIFY_SECONDS.observe(res.verify_ms / 1e3)
        return target_pb2.TargetResponse(verified=target_pb2.TargetVerified(
            num_accepted=res.num_accepted, next_token=res.next_token, verify_ms=res.verify_ms,
            kv_tokens=res.kv_tokens))


async def serve(cfg: TargetConfig) -> None:
    device = resolve_device(cfg.device)
    configure_process(device, cfg.cpu_cores, cfg.num_threads, cfg.gpu_memory_fraction)
    server = Server(cfg.host, cfg.port, [SERVICE_NAME], credentials=security.server_credentials(cfg))
    servicer = TargetServicer(cfg, device)
    add_servicer(server.server, servicer, SERVICE)
    await server.start()  # health answers NOT_SERVING while the model loads
    await server.set_serving(False)
    log.info("target service on %s, loading %s (%s engine)", server.address, cfg.model, cfg.engine)
    runner = await asyncio.to_thread(load_runner, cfg, device)
    servicer.engine = engine = TargetEngine(runner, cfg, metrics.step_observer("target")).start()
    metrics.watch("target", engine, device)
    metrics.start(cfg.host, cfg.metrics_port)
    await server.set_serving(True)
    log.info("target service ready on %s (%s, %s engine, KV pool %d tokens)", server.address, cfg.model,
             cfg.engine, runner.blocks.capacity_tokens)
    await server.run_until_signal(cfg.shutdown_grace_s, lambda: asyncio.to_thread(engine.stop))
