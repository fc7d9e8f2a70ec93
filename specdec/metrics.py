"""Prometheus metrics, served over HTTP at /metrics by each service (prometheus-client).

Names follow vLLM's conventions under the `specdec:` prefix. Each process registers
all of them; a service only moves the ones it owns:
- orchestrator: the spec-decode counters (drafts, draft tokens, accepted tokens, accepted
  tokens per position), request latencies (TTFT, time per output token, end to end),
  step times as seen from the orchestrator, RPC overhead, requests running;
- target and draft (label `service`): prefill / verify / propose times, sequences and tokens
  per batched step, step time, queue wait; and, read from the engine at scrape time:
  sessions, KV tokens in use, KV pool blocks (total, used, free, reserved), sessions waiting
  for admission, requests refused for capacity, weight bytes, KV bytes per token;
- all: memory (RSS, or the GPU allocator's current/peak).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_REQ_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)

NUM_DRAFTS = Counter("specdec:spec_decode_num_drafts", "Rounds that verified at least one draft token")
NUM_DRAFT_TOKENS = Counter("specdec:spec_decode_num_draft_tokens", "Draft tokens sent for verification")
NUM_ACCEPTED_TOKENS = Counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target")
NUM_ACCEPTED_PER_POS = Counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted draft tokens by draft position (0 = first)", ["position"])
NUM_WASTED_TOKENS = Counter("specdec:spec_decode_num_wasted_draft_tokens",
                            "Pipelined speculative draft tokens thrown away")
FALLBACK_ROUNDS = Counter("specdec:draft_fallback_rounds", "Rounds served target-only because the draft was down")
TARGET_MOVES = Counter("specdec:target_moves", "Requests moved to another target replica because theirs failed")
PROMPT_TOKENS = Counter("specdec:prompt_tokens", "Prompt tokens processed")
GENERATION_TOKENS = Counter("specdec:generation_tokens", "Tokens generated")
REQUESTS = Counter("specdec:requests", "Finished requests", ["finish_reason"])
TTFT = Histogram("specdec:time_to_first_token_seconds", "Time to first token", buckets=_REQ_BUCKETS)
TPOT = Histogram("specdec:request_time_per_output_token_seconds", "Per request: decode time / (tokens - 1)",
                 buckets=_STEP_BUCKETS)
E2E = Histogram("specdec:e2e_request_latency_seconds", "End-to-end request latency", buckets=_REQ_BUCKETS)
REQUESTS_RUNNING = Gauge("specdec:num_requests_running", "Requests being generated")
DRAFT_STEP = Histogram("specdec:draft_step_seconds", "Draft compute per proposal (k tokens)", buckets=_STEP_BUCKETS)
VERIFY_STEP = Histogram("specdec:verify_step_seconds", "Target compute per verify round", buckets=_STEP_BUCKETS)
RPC_LATENCY = Histogram("specdec:rpc_overhead_seconds", "Round trip minus remote compute, per call",
                        ["peer"], buckets=_STEP_BUCKETS)
PREFILL_SECONDS = Histogram("specdec:prefill_seconds", "Prefill compute", buckets=_STEP_BUCKETS)
VERIFY_SECONDS = Histogram("specdec:target_verify_seconds", "Verify compute inside the target service",
                           buckets=_STEP_BUCKETS)
DRAFT_SECONDS = Histogram("specdec:draft_propose_seconds", "Propose compute inside the draft service",
                          buckets=_STEP_BUCKETS)
STEP_SEQUENCES = Histogram("specdec:step_sequences", "Sequences in one batched forward", ["service"],
                           buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
STEP_TOKENS = Histogram("specdec:step_tokens", "Tokens in one batched forward", ["service"],
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024))
STEP_SECONDS = Histogram("specdec:step_seconds", "One batched forward", ["service"], buckets=_STEP_BUCKETS)
QUEUE_WAIT = Histogram("specdec:queue_wait_seconds", "From a job's submission to its first step", ["service"],
                       buckets=_STEP_BUCKETS)


def step_observer(service: str):
    """The step loop's callback: per-step histograms."""
    seqs, tokens, secs, wait = (h.labels(service) for h in (STEP_SEQUENCES, STEP_TOKENS, STEP_SECONDS, QUEUE_WAIT))

    def observe(rec) -> None:
        seqs.observe(rec.sequences)
        tokens.observe(rec.tokens)
        secs.observe(rec.seconds)
        for w in rec.queue_waits:
            wait.observe(w)
    return observe


class _ServiceCollector:
    """Read at scrape time, so it can never drift from the truth: memory, and for a model service
    its occupancy (sessions, KV tokens, pool blocks, admission queue, refusals)."""

    def __init__(self, service: str, engine=None, device: str = "cpu"):
        self.service, self.engine, self.device = service, engine, device

    def collect(self):
        from specdec.devices import process_memory_bytes

        values = {f"memory_{k}": v for k, v in process_memory_bytes(self.device).items()}
        counters = {}
        e = self.engine
        if e is not None:
            values.update(sessions=e.active_sessions, kv_cache_tokens=e.kv_tokens_in_use,
                          memory_weight_bytes=e.facts.weight_bytes, memory_kv_bytes_per_token=e.facts.kv_bytes_per_token)
            if hasattr(e, "admission"):
                pool = e.runner.blocks.stats()
                values.update(kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.used_blocks,
                              kv_blocks_free=pool.free_blocks, kv_blocks_reserved=pool.reserved_blocks,
                              kv_block_size=pool.block_size, admission_waiting=e.admission.waiting)
                counters["requests_refused_for_capacity"] = e.admission.refused
        for name, value in values.items():
            g = GaugeMetricFamily(f"specdec:{name}", name.replace("_", " "), labels=["service"])
            g.add_metric([self.service], float(value))
            yield g
        for name, value in counters.items():
            c = CounterMetricFamily(f"specdec:{name}", name.replace("_", " "), labels=["service"])
            c.add_metric([self.service], float(value))
            yield c


def watch(service: str, engine=None, device: str = "cpu") -> None:
    """Export the service's memory (and its engine's occupancy) from now on; once per process."""
    REGISTRY.register(_ServiceCollector(service, engine, device))


_started: set[int] = set()


def start(host: str, port: int) -> None:
    """Serve /metrics on host:port (port 0 = off); once per process and port."""
    if port and port not in _started:
        start_http_server(port, addr=host)
        _started.add(port)
