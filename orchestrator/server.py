"""The orchestrator: the public SpecDec service, a thin gRPC shell over `Orchestrator`."""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import asdict
import grpc

from orchestrator.clients import GrpcBackends
from orchestrator.engine import GenerationRequest, Orchestrator
from specdec import hf_compat, metrics, models, security
from specdec.config import OrchestratorConfig
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.modes import Mode
from specdec.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS, Server, Servicer, add_servicer, boundary, sampling_from_proto
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2, specdec_pb2, specdec_pb2_grpc

log = logging.getLogger("specdec.orchestrator")
SERVICE = specdec_pb2.DESCRIPTOR.services_by_name["SpecDec"]
SERVICE_NAME = SERVICE.full_name
MAX_PROMPT_CHARS = 1_000_000


class Prompter:
    """Turns the public prompt forms into target token ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_ids(self, req: specdec_pb2.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind == "token_ids":
            return list(req.token_ids.ids)
        if kind == "text":
            if len(req.text) > MAX_PROMPT_CHARS:
                raise InvalidArgument(f"prompt is longer than {MAX_PROMPT_CHARS} characters")
            return list(self.tokenizer(req.text, add_special_tokens=False)["input_ids"]) if req.text else []
        if kind == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in req.chat.messages]
            if not msgs or all(not m["content"] for m in msgs):
                return []
            if any(m["role"] not in ("system", "user", "assistant") for m in msgs):
                raise InvalidArgument("chat roles must be system, user or assistant")
            return hf_compat.chat_token_ids(self.tokenizer, msgs)
        return []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def server_options(cfg: OrchestratorConfig) -> list[tuple[str, object]]:
    """SERVER_OPTIONS with the receive limit at max_request_bytes: grpc itself answers a larger
    request RESOURCE_EXHAUSTED ("Received message larger than max") before any handler runs."""
    limit = "grpc.max_receive_message_length"
    return [*(o for o in SERVER_OPTIONS if o[0] != limit), (limit, cfg.max_request_bytes)]


def _sampling(msg, has: bool, prefix: str) -> SamplingParams | None:
    if not has:
        return None
    p = sampling_from_proto(msg)
    return p.validate(prefix)


class SpecDecServicer(specdec_pb2_grpc.SpecDecServicer, Servicer):
    loading = "the orchestrator is starting (waiting for the target service)"

    def __init__(self, cfg: OrchestratorConfig, backends: GrpcBackends):
        Mode.parse(cfg.default_mode)  # a bad default fails at startup, not per request
        self.cfg = cfg
        self.backends = backends
        self.engine: Orchestrator | None = None
        self.prompter: Prompter | None = None
        self.running = 0

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def attach(self, tokenizer) -> None:
        self.prompter = Prompter(tokenizer)
        self.engine = Orchestrator(self.backends, self.prompter.decode, self.cfg)

    @boundary
    async def GetInfo(self, request, context) -> specdec_pb2.ServerInfo:
        await self.backends.refresh()  # live occupancy (active sessions), not the last probe's
        b = self.backends
        return specdec_pb2.ServerInfo(
            target=b.target_info, draft=b.draft_info or common_pb2.ModelInfo(), draft_available=b.draft_up,
            draft_problem="" if b.draft_up else b.draft_problem, default_k=self.cfg.default_k,
            max_k=self.cfg.max_k, default_mode=int(self.engine.default_mode),
            replicas=[specdec_pb2.ReplicaStatus(**r) for r in b.replica_statuses()])

    def _request(self, req: specdec_pb2.GenerateRequest, context) -> GenerationRequest:
        if req.mode not in (0, *[int(m) for m in Mode]):
            raise InvalidArgument(f"unknown mode {req.mode}: use pipelined (1), sequential (2) or target-only (3)")
        prompt_ids = self.prompter.token_ids(req)
        left = context.time_remaining()
        return GenerationRequest(
            prompt_ids=prompt_ids,
            max_tokens=req.max_tokens,
            sampling=_sampling(req.sampling, req.HasField("sampling"), "") or SamplingParams(),
            draft_sampling=_sampling(req.draft_sampling, req.HasField("draft_sampling"), "draft_"),
            seed=req.seed if req.HasField("seed") else None,
            stop=list(req.stop),
            ignore_eos=req.ignore_eos,
            k=req.k,
            mode=Mode(req.mode) if req.mode else None,
            adaptive_k=req.adaptive_k if req.HasField("adaptive_k") else None,
            deadline=None if left is None else time.monotonic() + left,
        )

    @boundary
    async def Generate(self, request: specdec_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.running >= self.cfg.max_sessions:
            raise ResourceExhausted(f"the orchestrator is at its limit of {self.cfg.max_sessions} concurrent requests")
        self.running += 1
        try:
            req = self._request(request, context)
            rounds = 0
            async for ev in self.engine.generate(req):
                chunk = specdec_pb2.GenerateChunk(text=ev.text, token_ids=ev.token_ids)
                if ev.round is not None:
                    rounds += 1
                    chunk.round.CopyFrom(specdec_pb2.RoundStats(round=rounds, **asdict(ev.round)))
                    _observe_round(ev.round)
                if ev.summary is not None:
                    chunk.summary.CopyFrom(specdec_pb2.Summary(
                        **asdict(ev.summary), finish_reason=ev.finish_reason, mode=int(ev.mode), k=ev.k,
                        seed=ev.seed, prompt_token_ids=req.prompt_ids))
                    _observe_summary(ev)
                yield chunk
        finally:
            self.running -= 1


def _observe_round(r) -> None:
    if r.k:
        metrics.NUM_DRAFTS.inc()
        metrics.NUM_DRAFT_TOKENS.inc(r.k)
        metrics.NUM_ACCEPTED_TOKENS.inc(r.accepted)
        for i in range(r.accepted):
            metrics.NUM_ACCEPTED_PER_POS.labels(str(i)).inc()
        if r.draft_ms:
            metrics.DRAFT_STEP.observe(r.draft_ms / 1e3)
    metrics.VERIFY_STEP.observe(r.verify_ms / 1e3)
    metrics.NUM_WASTED_TOKENS.inc(r.wasted_draft_tokens)
    if not r.draft_available:
        metrics.FALLBACK_ROUNDS.inc()
    if r.target_moved:
        metrics.TARGET_MOVES.inc()


def _observe_summary(ev) -> None:
    s = ev.summary
    metrics.PROMPT_TOKENS.inc(s.prompt_tokens)
    metrics.GENERATION_TOKENS.inc(s.completion_tokens)
    metrics.REQUESTS.labels(ev.finish_reason).inc()
    metrics.TTFT.observe(s.ttft_ms / 1e3)
    if s.completion_tokens > 1 and math.isfinite(s.tpot_ms):
        metrics.TPOT.observe(s.tpot_ms / 1e3)
    metrics.E2E.observe(s.total_ms / 1e3)


async def serve(cfg: OrchestratorConfig, tokenizer_spec: str = "") -> None:
    server = Server(cfg.host, cfg.port, [SERVICE_NAME], credentials=security.server_credentials(cfg),
                    options=server_options(cfg), interceptors=security.server_interceptors(cfg))
    servicer: SpecDecServicer | None = None

    async def follow_target(up: bool) -> None:  # our health is the target's, once we are ready
        if servicer is not None and servicer.ready:
            await server.set_serving(up)

    upstream = security.upstream_channel_credentials(cfg)  # TLS/mTLS to the target and draft, or None
    backends = GrpcBackends(cfg.target_address, cfg.draft_address, cfg.rpc_timeout_s, cfg.probe_interval_s,
                            on_target_change=follow_target, ejection_s=cfg.replica_ejection_s,
                            channel_factory=lambda a, name: security.open_channel(a, upstream, CHANNEL_OPTIONS,
                                                                                server_name=name))
    servicer = SpecDecServicer(cfg, backends)
    add_servicer(server.server, servicer, SERVICE)
    await server.start()
    await server.set_serving(False)
    log.info("orchestrator on %s, waiting for the target at %s", server.address, cfg.target_address)
    info = await backends.connect_target()
    spec = tokenizer_spec or info.model
    tokenizer = await asyncio.to_thread(lambda: models.load_tokenizer(models.resolve(spec)))
    servicer.attach(tokenizer)
    metrics.watch("orchestrator")
    metrics.start(cfg.host, cfg.metrics_port)
    metrics.REQUESTS_RUNNING.set_function(lambda: servicer.running)
    backends.start_monitor()
    log.info("orchestrator ready on %s (target %s, draft %s)", server.address, info.model,
             cfg.draft_address or "none")
    await server.run_until_signal(cfg.shutdown_grace_s, backends.close)
