"""The draft engine: sessions over one drafter (torch, llama.cpp or n-gram). No network."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from draft_service.drafters import Drafter, DraftSequence, SparseDist
from specdec.config import DraftConfig
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from specdec.sampling import SamplingParams, make_generator

MAX_K = 64


@dataclass
class Proposal:
    token_ids: list[int]
    dists: list[SparseDist]
    draft_ms: float


@dataclass
class _Session:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_support: int
    seq: DraftSequence | None = None  # the drafter's state, made by `prefill`
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the job in flight
    closed: bool = False


class DraftEngine:
    """Draft sessions over one drafter. `close` is synchronous and safe at any moment: a session
    closed while a job of its own runs is released by whichever of the two finishes last."""

    def __init__(self, drafter: Drafter, config: DraftConfig | None = None):
        config = config or DraftConfig()
        self.drafter = drafter
        self.max_sessions = config.max_sessions
        self.default_max_support = config.max_support
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens_in_use(self) -> int:
        return sum(s.seq.fed for s in list(self._sessions.values()) if s.seq is not None)

    def open(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams,
             target_fingerprint: str, target_vocab_size: int, max_support: int = 0) -> None:
        """Admit a session (validation, limits, registration); no model work. See `prefill`."""
        sampling.validate("draft_")
        if max_support < 0:
            raise InvalidArgument(f"max_support must be >= 0, got {max_support}")
        fp = self.drafter.fingerprint
        if fp and target_fingerprint and fp != target_fingerprint:
            raise FailedPrecondition(
                f"draft model {self.drafter.model!r} uses a different tokenizer than the target "
                f"(fingerprints {fp[:12]} vs {target_fingerprint[:12]}); speculative decoding needs the same one")
        if self.drafter.vocab_size and target_vocab_size and self.drafter.vocab_size > target_vocab_size:
            raise FailedPrecondition(
                f"draft vocabulary ({self.drafter.vocab_size}) is larger than the target's ({target_vocab_size})")
        if not prompt_ids:
            raise InvalidArgument("prompt is empty")
        if len(prompt_ids) >= self.drafter.max_context:
            raise InvalidArgument(f"prompt does not fit the draft context of {self.drafter.max_context}")
        with self._lock:
            if session_id in self._sessions:
                raise FailedPrecondition(f"draft session {session_id!r} already open")
            if len(self._sessions) >= self.max_sessions:
                raise ResourceExhausted(f"draft is at its limit of {self.max_sessions} sessions")
            self._sessions[session_id] = _Session(list(prompt_ids), sampling,
                                                  max_support or self.default_max_support)

    def prefill(self, session_id: str) -> float:
        """The model work of an open: feed the prompt. Returns its milliseconds."""
        s = self._get(session_id)
        with self._job(s):
            t0 = time.perf_counter()
            s.seq = self.drafter.new_sequence(s.prompt_ids)
            return (time.perf_counter() - t0) * 1e3

    def propose(self, session_id: str, keep: int, append: list[int], k: int, seed: int) -> Proposal:
        s = self._get(session_id)
        if not 0 <= k <= MAX_K:
            raise InvalidArgument(f"k must be in [0, {MAX_K}], got {k}")
        with self._job(s):
            seq = s.seq
            if seq is None:
                raise FailedPrecondition("propose before the session's prefill finished")
            if not 0 <= keep <= len(seq.tokens):
                raise InvalidArgument(f"keep={keep} but the draft holds {len(seq.tokens)} tokens")
            if keep + len(append) + k > self.drafter.max_context:
                raise InvalidArgument(f"draft context of {self.drafter.max_context} tokens is full")
            if self.drafter.vocab_size and append and (min(append) < 0 or max(append) >= self.drafter.vocab_size):
                raise InvalidArgument("appended token ids are outside the draft vocabulary")
            t0 = time.perf_counter()
            self.drafter.rewind(seq, keep)
            seq.tokens.extend(append)
            tokens, dists = self.drafter.propose(seq, k, s.sampling, s.max_support, make_generator(seed))
            return Proposal(tokens, dists, (time.perf_counter() - t0) * 1e3)

    def close(self, session_id: str) -> None:
        """Forget the session (idempotent, never blocks); its drafter state is released now, or
        by its job in flight when that ends."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is not None:
            s.closed = True
            self._release_if_idle(s)

    # -- internals -------------------------------------------------------------------------------
    def _get(self, session_id: str) -> _Session:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"no draft session {session_id!r}")
        return s

    @contextmanager
    def _job(self, s: _Session):
        try:
            with s.lock:
                if s.closed:
                    raise NotFound("draft session closed")
                yield
        finally:
            self._release_if_idle(s)  # after the lock: close() may have found it held

    def _release_if_idle(self, s: _Session) -> None:
        if s.closed and s.lock.acquire(blocking=False):
            try:
                seq, s.seq = s.seq, None
                if seq is not None:
                    self.drafter.release(seq)
            finally:
                s.lock.release()
