"""The target engine: sessions, prefill, and verification of draft tokens. No network.

A session's committed sequence is `tokens + [pending]`: `pending` is the last output
token, which is not yet in the KV cache. A verify round feeds `[pending] + drafts` in one
forward, applies the acceptance rule, and rolls the cache back to the accepted prefix.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import torch

from specdec.acceptance import verify_drafts
from specdec.config import TargetConfig
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.runner import ModelRunner, SessionCache
from specdec.sampling import SamplingParams, make_generator, processed_probs, sample_index

MAX_DRAFT_TOKENS = 64


@dataclass
class Opened:
    first_token: int
    prefill_ms: float
    kv_tokens: int


@dataclass
class Verified:
    num_accepted: int
    next_token: int
    verify_ms: float
    kv_tokens: int


@dataclass
class _Session:
    cache: SessionCache
    pending: int
    sampling: SamplingParams
    generator: torch.Generator
    reserved_tokens: int
    prompt_ids: list[int] = field(default_factory=list)
    num_committed: int = 0
    rounds: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class TargetEngine:
    def __init__(self, runner: ModelRunner, config: TargetConfig | None = None):
        self.runner = runner
        self.limits = config or TargetConfig()
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    # -- bookkeeping -------------------------------------------------------------------
    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens_in_use(self) -> int:
        return sum(s.cache.length for s in list(self._sessions.values()))

    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"no target session {session_id!r}")
        return s

    # -- API -----------------------------------------------------------------------------
    def open(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> None:
        """Admit a session (validation, limits, registration); no model work. See `prefill`."""
        sampling.validate()
        if not prompt_ids:
            raise InvalidArgument("prompt is empty")
        vocab = self.runner.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidArgument(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.runner.max_context:
            raise InvalidArgument(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                                  f"{self.runner.max_context}")
        with self._lock:
            if session_id in self._sessions:
                raise FailedPrecondition(f"target session {session_id!r} already open")
            if len(self._sessions) >= self.limits.max_sessions:
                raise ResourceExhausted(f"target is at its limit of {self.limits.max_sessions} sessions")
            reserved = sum(s.reserved_tokens for s in self._sessions.values())
            if reserved + len(prompt_ids) > self.limits.kv_budget_tokens:
                raise ResourceExhausted(
                    f"target KV budget full: {reserved} of {self.limits.kv_budget_tokens} tokens in use, "
                    f"prompt needs {len(prompt_ids)}")
            self._sessions[session_id] = _Session(self.runner.new_cache(), -1, sampling, make_generator(seed),
                                                  len(prompt_ids), prompt_ids=list(prompt_ids))

    def prefill(self, session_id: str) -> Opened:
        """The model work of an open: the prompt's forward and the first token. A session closed
        meanwhile just drops its cache when this returns."""
        s = self._get(session_id)
        with s.lock:
            t0 = time.perf_counter()
            logits = self.runner.forward(s.cache, s.prompt_ids)[-1:]  # [1, V]
            p = processed_probs(logits, s.sampling)[0]  # [V]
            s.pending = sample_index(p, s.generator)
            s.num_committed = len(s.prompt_ids) + 1
            return Opened(s.pending, (time.perf_counter() - t0) * 1e3, s.cache.length)

    def verify(self, session_id: str, draft_ids: list[int],
               draft_dists: list[tuple[list[int], list[float]]]) -> Verified:
        s = self._get(session_id)
        k = len(draft_ids)
        vocab = self.runner.vocab_size
        if k > MAX_DRAFT_TOKENS:
            raise InvalidArgument(f"at most {MAX_DRAFT_TOKENS} draft tokens per round, got {k}")
        if len(draft_dists) != k:
            raise InvalidArgument(f"{k} draft tokens but {len(draft_dists)} draft distributions")
        if k and (min(draft_ids) < 0 or max(draft_ids) >= vocab):
            raise InvalidArgument(f"draft token ids must be in [0, {vocab})")
        if s.cache.length + k + 1 > self.runner.max_context:
            raise InvalidArgument(f"round would pass the context limit of {self.runner.max_context}")
        q = torch.zeros(k, vocab)  # [k, V] q~ per draft position
        for i, (ids, probs) in enumerate(draft_dists):
            if len(ids) != len(probs) or not ids:
                raise InvalidArgument(f"draft distribution {i} is malformed")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidArgument(f"draft distribution {i} has token ids outside [0, {vocab})")
            pr = torch.tensor(probs, dtype=torch.float32)
            if not torch.isfinite(pr).all() or (pr < 0).any() or not math.isclose(float(pr.sum()), 1.0, abs_tol=1e-3):
                raise InvalidArgument(f"draft distribution {i} must be finite, >= 0 and sum to 1")
            q[i, torch.tensor(ids, dtype=torch.long)] = pr
            if q[i, draft_ids[i]] <= 0:
                raise InvalidArgument(f"draft token {i} has probability 0 in its own distribution")
        with s.lock:
            with self._lock:
                reserved = sum(x.reserved_tokens for x in self._sessions.values() if x is not s)
                need = s.cache.length + k + 1
                if reserved + need > self.limits.kv_budget_tokens:
                    raise ResourceExhausted(f"target KV budget full ({self.limits.kv_budget_tokens} tokens)")
                s.reserved_tokens = need
            t0 = time.perf_counter()
            base = s.cache.length
            logits = self.runner.forward(s.cache, [s.pending] + list(draft_ids))  # [k+1, V]
            p = processed_probs(logits, s.sampling)  # [k+1, V]
            out = verify_drafts(torch.tensor(draft_ids, dtype=torch.long), q, p, s.generator)
            s.cache.truncate(base + 1 + out.num_accepted)
            s.reserved_tokens = s.cache.length + 1
            s.pending = out.next_token
            s.num_committed += out.num_accepted + 1
            s.rounds += 1
            return Verified(out.num_accepted, out.next_token, (time.perf_counter() - t0) * 1e3, s.cache.length)

    def close(self, session_id: str) -> None:
        """Forget the session (idempotent, never blocks): its KV is dropped with it, after any
        forward in flight for it."""
        with self._lock:
            self._sessions.pop(session_id, None)
