"""Per-round records and the request summary: pure arithmetic, tested on hand-made logs.

Definitions (vLLM's conventions):
- acceptance rate = accepted draft tokens / draft tokens;
- mean accepted length = 1 + accepted / rounds that carried drafts (includes the
  recovered-or-bonus token each round emits);
- acceptance by position i = rounds whose draft i was accepted / rounds that drafted
  a token at position i.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    k: int  # draft tokens verified this round
    accepted: int
    draft_ms: float = 0.0  # draft compute behind these drafts
    verify_ms: float = 0.0  # target compute
    overlap_ms: float = 0.0  # draft time that ran while the target verified
    wasted_draft_tokens: int = 0  # speculative tokens thrown away
    rpc_ms: float = 0.0  # verify round trip minus verify_ms
    draft_available: bool = True
    wire_bytes: int = 0
    round_ms: float = 0.0
    pipeline_hit: bool = False  # pipelined: drafts reused from the previous round's speculation
    spec_wait_ms: float = 0.0  # pipelined: verify result waiting for the speculative draft
    target_moved: bool = False  # the target replica failed: this round reopened the session on another


@dataclass
class Summary:
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    total_ms: float
    rounds: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float
    accepted_by_position: list[int] = field(default_factory=list)
    drafted_by_position: list[int] = field(default_factory=list)
    acceptance_by_position: list[float] = field(default_factory=list)
    tpot_ms: float = 0.0
    tokens_per_s: float = 0.0
    rpc_overhead_ms_per_round: float = 0.0
    wasted_draft_tokens: int = 0
    draft_ms_total: float = 0.0
    verify_ms_total: float = 0.0
    overlap_ms_total: float = 0.0
    draft_fallback_rounds: int = 0
    target_moves: int = 0
    mean_wire_bytes_per_round: float = 0.0


def position_counts(rounds: list[RoundRecord]) -> tuple[list[int], list[int]]:
    """-> (accepted_by_position, drafted_by_position), position 0 = first draft token."""
    width = max((r.k for r in rounds), default=0)
    drafted = [0] * width
    accepted = [0] * width
    for r in rounds:
        for i in range(r.k):
            drafted[i] += 1
        for i in range(r.accepted):
            accepted[i] += 1
    return accepted, drafted


def summarize(rounds: list[RoundRecord], prompt_tokens: int, completion_tokens: int,
              ttft_ms: float, total_ms: float) -> Summary:
    for r in rounds:
        if not 0 <= r.accepted <= r.k:
            raise ValueError(f"round accepted {r.accepted} of {r.k} draft tokens")
    draft_tokens = sum(r.k for r in rounds)
    accepted_tokens = sum(r.accepted for r in rounds)
    drafting_rounds = sum(1 for r in rounds if r.k > 0)
    acc_pos, drafted_pos = position_counts(rounds)
    decode_ms = max(total_ms - ttft_ms, 0.0)
    return Summary(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        ttft_ms=ttft_ms,
        total_ms=total_ms,
        rounds=len(rounds),
        draft_tokens=draft_tokens,
        accepted_tokens=accepted_tokens,
        acceptance_rate=accepted_tokens / draft_tokens if draft_tokens else 0.0,
        mean_accepted_length=1.0 + accepted_tokens / drafting_rounds if drafting_rounds else 1.0,
        accepted_by_position=acc_pos,
        drafted_by_position=drafted_pos,
        acceptance_by_position=[a / d if d else 0.0 for a, d in zip(acc_pos, drafted_pos)],
        tpot_ms=decode_ms / (completion_tokens - 1) if completion_tokens > 1 else 0.0,
        tokens_per_s=completion_tokens / (total_ms / 1e3) if total_ms > 0 else 0.0,
        rpc_overhead_ms_per_round=sum(r.rpc_ms for r in rounds) / len(rounds) if rounds else 0.0,
        wasted_draft_tokens=sum(r.wasted_draft_tokens for r in rounds),
        draft_ms_total=sum(r.draft_ms for r in rounds),
        verify_ms_total=sum(r.verify_ms for r in rounds),
        overlap_ms_total=sum(r.overlap_ms for r in rounds),
        draft_fallback_rounds=sum(1 for r in rounds if not r.draft_available),
        target_moves=sum(1 for r in rounds if r.target_moved),
        mean_wire_bytes_per_round=sum(r.wire_bytes for r in rounds) / len(rounds) if rounds else 0.0,
    )
