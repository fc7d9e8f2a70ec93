"""Prometheus metrics, served over HTTP at /metrics by each service (prometheus-client).

Names follow vLLM's conventions under the `specdec:` prefix. Each process registers
all of them; a service only moves the ones it owns:
- orchestrator: the spec-decode counters (drafts, draft tokens, accepted tokens, accepted
  tokens per position), request latencies (TTFT, time per output token, end to end),
  step times as seen from the orchestrator, RPC overhead, requests running;
- target: prefill and verify step times, sessions, KV tokens in use;
- draft: draft step times, sessions;
- all: memory (RSS / GPU allocator), weight bytes, KV bytes per token.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, REGISTRY

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
TARGET_SESSIONS = Gauge("specdec:target_sessions", "Open target sessions")
DRAFT_SESSIONS = Gauge("specdec:draft_sessions", "Open draft sessions")
KV_TOKENS = Gauge("specdec:kv_cache_tokens", "KV cache entries in use over all sessions")


class _MemoryCollector:
    def __init__(self, service: str, read: Callable[[], dict], weight_bytes: int, kv_bytes_per_token: int):
        self.service, self.read = service, read
        self.static = {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token}

    def collect(self):
        values = {**self.read(), **self.static}
        for name, value in values.items():
            g = GaugeMetricFamily(f"specdec:memory_{name}", f"Memory: {name.replace('_', ' ')}", labels=["service"])
            g.add_metric([self.service], float(value))
            yield g


_started: set[int] = set()


def start(host: str, port: int, service: str, read_memory: Callable[[], dict], weight_bytes: int = 0,
          kv_bytes_per_token: int = 0) -> None:
    """Serve /metrics on host:port (port 0 = off); call once per process."""
    REGISTRY.register(_MemoryCollector(service, read_memory, weight_bytes, kv_bytes_per_token))
    if port and port not in _started:
        start_http_server(port, addr=host)
        _started.add(port)
