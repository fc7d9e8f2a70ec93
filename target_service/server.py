"""The target service: a thin gRPC shell over `TargetEngine`."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec import metrics
from specdec.config import TargetConfig
from specdec.devices import configure_process, process_memory_bytes, resolve_device
from specdec.errors import InvalidArgument
from specdec.rpc import Server, Servicer, StreamSession, boundary, sampling_from_proto, serve_session
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from target_service.engine import TargetEngine

log = logging.getLogger("specdec.target")
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer, Servicer):
    loading = "the target model is loading"

    def __init__(self, model_spec: str, device: str, engine: TargetEngine | None = None):
        self.engine = engine  # None while the model loads: RPCs answer UNAVAILABLE
        self.model_spec = model_spec
        self.device = device
        # one worker: the model runs on this service's own cores, one forward at a time
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="target-forward")

    def model_info(self) -> common_pb2.ModelInfo:
        r = self.engine.runner
        return common_pb2.ModelInfo(
            model=self.model_spec, engine="torch", tokenizer_fingerprint=r.fingerprint, vocab_size=r.vocab_size,
            max_context=r.max_context, eos_token_ids=r.eos_token_ids, dtype=r.dtype, device=self.device,
            weight_bytes=r.weight_bytes, kv_bytes_per_token=r.kv_bytes_per_token,
            max_sessions=self.engine.limits.max_sessions, active_sessions=self.engine.active_sessions,
            kv_tokens_in_use=self.engine.kv_tokens_in_use)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @boundary
    async def Info(self, request: common_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> common_pb2.ModelInfo:
        return self.model_info()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @boundary
    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        async for reply in serve_session(request_iterator, context, {"open": self._open, "verify": self._verify},
                                         self._close):
            yield reply

    async def _open(self, o: target_pb2.TargetOpen, owner: StreamSession) -> target_pb2.TargetResponse:
        self.engine.open(o.session_id, list(o.prompt_token_ids), sampling_from_proto(o.sampling), o.seed)
        owner.session_id = o.session_id
        opened = await self._run(self.engine.prefill, o.session_id)
        metrics.PREFILL_SECONDS.observe(opened.prefill_ms / 1e3)
        return target_pb2.TargetResponse(opened=target_pb2.TargetOpened(
            first_token=opened.first_token, prefill_ms=opened.prefill_ms, kv_tokens=opened.kv_tokens))

    async def _verify(self, v: target_pb2.TargetVerify, owner: StreamSession) -> target_pb2.TargetResponse:
        dists = [(list(d.token_ids), list(d.probs)) for d in v.draft_dists]
        try:
            res = await self._run(self.engine.verify, owner.session_id, list(v.draft_token_ids), dists)
        except InvalidArgument as e:  # checked before the session changed: it stays open
            return target_pb2.TargetResponse(refused=target_pb2.RoundRefused(message=e.message))
        metrics.VERIFY_SECONDS.observe(res.verify_ms / 1e3)
        return target_pb2.TargetResponse(verified=target_pb2.TargetVerified(
            num_accepted=res.num_accepted, next_token=res.next_token, verify_ms=res.verify_ms,
            kv_tokens=res.kv_tokens))

    def _close(self, sid: str) -> None:
        self.engine.close(sid)


async def serve(cfg: TargetConfig) -> None:
    from specdec.runner import ModelRunner

    device = resolve_device(cfg.device)
    configure_process(device, cfg.cpu_cores, cfg.num_threads, cfg.gpu_memory_fraction)
    server = Server(cfg.host, cfg.port, [SERVICE_NAME])
    servicer = TargetServicer(cfg.model, device)
    target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, server.server)
    await server.start()  # health answers NOT_SERVING while the model loads
    await server.set_serving(False)
    log.info("target service on %s, loading %s", server.address, cfg.model)
    runner = await asyncio.to_thread(ModelRunner.load, cfg.model, cfg.dtype, device)
    engine = TargetEngine(runner, cfg)
    servicer.engine = engine
    metrics.TARGET_SESSIONS.set_function(lambda: engine.active_sessions)
    metrics.KV_TOKENS.set_function(lambda: engine.kv_tokens_in_use)
    metrics.start(cfg.host, cfg.metrics_port, "target", lambda: process_memory_bytes(device), runner.weight_bytes,
                  runner.kv_bytes_per_token)
    await server.set_serving(True)
    log.info("target service ready on %s (%s)", server.address, cfg.model)
    await server.run_until_signal(cfg.shutdown_grace_s)
