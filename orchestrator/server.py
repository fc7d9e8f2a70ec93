"""The orchestrator: the public SpecDec service, a thin gRPC shell over `Orchestrator`."""
from __future__ import annotations

import asyncio
import logging
import math

import grpc

from orchestrator.clients import GrpcBackends
from orchestrator.engine import MODE_NAMES, GenerationRequest, Mode, Orchestrator, OrchestratorSettings
from specdec import metrics, models
from specdec.config import OrchestratorConfig
from specdec.aio import cancelled_by_caller
from specdec.devices import process_memory_bytes
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.rpc import Server, abort_with, sampling_from_proto
from specdec.sampling import SamplingParams
from specdec.v1 import common_pb2, specdec_pb2, specdec_pb2_grpc

log = logging.getLogger("specdec.orchestrator")
SERVICE_NAME = specdec_pb2.DESCRIPTOR.services_by_name["SpecDec"].full_name
MAX_PROMPT_CHARS = 1_000_000


def settings_from(cfg: OrchestratorConfig) -> OrchestratorSettings:
    if cfg.default_mode not in MODE_NAMES:
        raise InvalidArgument(f"default_mode must be one of {sorted(MODE_NAMES)}, got {cfg.default_mode!r}")
    return OrchestratorSettings(
        default_k=cfg.default_k, max_k=cfg.max_k, default_mode=MODE_NAMES[cfg.default_mode],
        default_draft_temperature=cfg.default_draft_temperature, default_draft_top_k=cfg.default_draft_top_k,
        default_draft_top_p=cfg.default_draft_top_p, probe_interval_s=cfg.probe_interval_s)


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
            ids = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return []

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _sampling(msg, has: bool, prefix: str) -> SamplingParams | None:
    if not has:
        return None
    p = sampling_from_proto(msg)
    return p.validate(prefix)


class SpecDecServicer(specdec_pb2_grpc.SpecDecServicer):
    def __init__(self, cfg: OrchestratorConfig, backends: GrpcBackends):
        self.cfg = cfg
        self.backends = backends
        self.settings = settings_from(cfg)
        self.engine: Orchestrator | None = None
        self.prompter: Prompter | None = None
        self.running = 0

    def attach(self, tokenizer) -> None:
        self.prompter = Prompter(tokenizer)
        self.engine = Orchestrator(self.backends, self.prompter.decode, self.settings)

    async def GetInfo(self, request, context) -> specdec_pb2.ServerInfo:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator is starting")
        await self.backends.refresh()  # live occupancy (active sessions), not the last probe's
        return specdec_pb2.ServerInfo(
            target=self.backends.target_info, draft=self.backends.draft_info or common_pb2.ModelInfo(),
            draft_available=self.backends.draft_up, default_k=self.settings.default_k, max_k=self.settings.max_k,
            default_mode=int(self.settings.default_mode))

    def _request(self, req: specdec_pb2.GenerateRequest) -> GenerationRequest:
        if req.mode not in (0, *[int(m) for m in Mode]):
            raise InvalidArgument(f"unknown mode {req.mode}: use pipelined (1), sequential (2) or target-only (3)")
        return GenerationRequest(
            prompt_ids=self.prompter.token_ids(req),
            max_new_tokens=req.max_new_tokens,
            sampling=_sampling(req.sampling, req.HasField("sampling"), "") or SamplingParams(),
            draft_sampling=_sampling(req.draft_sampling, req.HasField("draft_sampling"), "draft_"),
            seed=req.seed if req.HasField("seed") else None,
            stop=list(req.stop),
            ignore_eos=req.ignore_eos,
            k=req.k,
            mode=Mode(req.mode) if req.mode else None,
        )

    async def Generate(self, request: specdec_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "orchestrator is starting")
        if self.running >= self.cfg.max_sessions:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"orchestrator is at its limit of {self.cfg.max_sessions} concurrent requests")
        self.running += 1
        try:
            req = self._request(request)
            round_no = 0
            async for ev in self.engine.generate(req):
                chunk = specdec_pb2.GenerateChunk(text=ev.text, token_ids=ev.token_ids)
                if ev.round is not None:
                    r = ev.round
                    round_no += 1
                    chunk.round.CopyFrom(specdec_pb2.RoundStats(
                        round=round_no, k=r.k, accepted=r.accepted, draft_ms=r.draft_ms, verify_ms=r.verify_ms,
                        overlap_ms=r.overlap_ms, wasted_draft_tokens=r.wasted_draft_tokens, rpc_ms=r.rpc_ms,
                        draft_available=r.draft_available, wire_bytes=r.wire_bytes, round_ms=r.round_ms,
                        pipeline_hit=r.pipeline_hit, spec_wait_ms=r.spec_wait_ms))
                    _observe_round(r)
                if ev.summary is not None:
                    chunk.summary.CopyFrom(_summary_proto(ev, req))
                    _observe_summary(ev)
                yield chunk
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError as e:
            if cancelled_by_caller():
                raise
            await abort_with(context, e)  # a cancelled peer call, not ours: never end without a status
        except Exception as e:  # noqa: BLE001 - mapped to a status
            await abort_with(context, e)
        finally:
            self.running -= 1


def _summary_proto(ev, req: GenerationRequest) -> specdec_pb2.Summary:
    s = ev.summary
    return specdec_pb2.Summary(
        prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens, ttft_ms=s.ttft_ms, tpot_ms=s.tpot_ms,
        tokens_per_s=s.tokens_per_s, total_ms=s.total_ms, acceptance_rate=s.acceptance_rate,
        mean_accepted_length=s.mean_accepted_length, acceptance_by_position=s.acceptance_by_position,
        accepted_by_position=s.accepted_by_position, drafted_by_position=s.drafted_by_position, rounds=s.rounds,
        draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens, finish_reason=ev.finish_reason,
        mode=int(ev.mode), k=ev.k, seed=ev.seed, rpc_overhead_ms_per_round=s.rpc_overhead_ms_per_round,
        wasted_draft_tokens=s.wasted_draft_tokens, draft_ms_total=s.draft_ms_total,
        verify_ms_total=s.verify_ms_total, overlap_ms_total=s.overlap_ms_total,
        draft_fallback_rounds=s.draft_fallback_rounds, prompt_token_ids=req.prompt_ids,
        mean_wire_bytes_per_round=s.mean_wire_bytes_per_round)


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
    server = Server(cfg.host, cfg.port, [SERVICE_NAME])
    servicer: SpecDecServicer | None = None

    async def follow_target(up: bool) -> None:  # our health is the target's, once we are ready
        if servicer is not None and servicer.engine is not None:
            await server.set_serving(up)

    backends = GrpcBackends(cfg.target_address, cfg.draft_address, cfg.rpc_timeout_s, cfg.probe_interval_s,
                            on_target_change=follow_target)
    servicer = SpecDecServicer(cfg, backends)
    specdec_pb2_grpc.add_SpecDecServicer_to_server(servicer, server.server)
    await server.start()
    await server.set_serving(False)
    log.info("orchestrator on %s, waiting for the target at %s", server.address, cfg.target_address)
    info = await backends.connect_target()
    spec = tokenizer_spec or info.model
    tokenizer = await asyncio.to_thread(lambda: models.load_tokenizer(models.resolve(spec)))
    servicer.attach(tokenizer)
    metrics.start(cfg.host, cfg.metrics_port, "orchestrator", process_memory_bytes)
    metrics.REQUESTS_RUNNING.set_function(lambda: servicer.running)
    backends.start_monitor()
    log.info("orchestrator ready on %s (target %s, draft %s)", server.address, info.model,
             cfg.draft_address or "none")
    await server.run_until_signal(cfg.shutdown_grace_s, backends.close)
