"""The target engine: sessions in a fixed KV pool, verified in batches by one model thread. No network.

Each session is a sequence of the runner's pool, admitted by reserving its worst case
(prompt + max_tokens + max_draft + 1 tokens): once admitted it never fails for lack of KV;
when the pool is full, newcomers wait (bounded) and then get RESOURCE_EXHAUSTED. The gRPC
handlers only submit jobs; the step loop runs every waiting prefill chunk and verify of all
sessions as one forward per step.

A session's committed sequence is its cached tokens + [pending]: `pending` is the last
output token, which is not in the cache yet. A verify feeds [pending] + drafts, applies the
acceptance rule to the k+1 logit rows, and rolls the cache back to the accepted prefix.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from specdec.acceptance import verify_drafts
from specdec.config import TargetConfig
from specdec.errors import InvalidArgument
from specdec.sampling import make_generator, processed_probs, sample_index
from specdec.sampling_params import SamplingParams
from specdec.serving.batch import BatchRunner
from specdec.serving.engine import PooledEngine
from specdec.serving.jobs import Job

MAX_DRAFT_TOKENS = 64
SparseDist = tuple[list[int], list[float]]


@dataclass
class Opened:
    first_token: int
    prefill_ms: float
    kv_tokens: int


@dataclass
class Verified:
    num_accepted: int
    next_token: int
    verify_ms: float  # the step's forward + the acceptance rule
    kv_tokens: int


@dataclass
class _Session:
    seq: int
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    max_draft: int  # most draft tokens per round (declared at open; the pool holds them)
    cached: int = 0  # tokens in the cache
    pending: int = -1  # the last output token (not in the cache yet)


class _Prefill(Job):
    """The prompt, in chunks; the first token from the last position's logits."""

    def __init__(self, s: _Session):
        super().__init__(s.seq, 0, s.prompt, 1)
        self.s = s

    def on_logits(self, logits: torch.Tensor) -> None:  # logits [1, V]
        s = self.s
        p = processed_probs(logits, s.sampling)[0]  # [V]
        s.pending, s.cached = sample_index(p, s.generator), len(s.prompt)
        self.finish(Opened(s.pending, self.elapsed_ms(), s.cached))


class _Verify(Job):
    """[pending] + k drafts in one step (never split); the acceptance rule on the k+1 rows."""

    splittable = False

    def __init__(self, s: _Session, runner: BatchRunner, drafts: list[int], q: torch.Tensor):
        super().__init__(s.seq, s.cached, [s.pending, *drafts], len(drafts) + 1)
        self.s, self.runner, self.drafts, self.q = s, runner, drafts, q  # q: [k, V] q~ per draft

    def on_logits(self, logits: torch.Tensor) -> None:  # logits [k+1, V]
        s, t0 = self.s, time.perf_counter()
        p = processed_probs(logits, s.sampling)  # [k+1, V]
        out = verify_drafts(torch.tensor(self.drafts, dtype=torch.long), self.q, p, s.generator)
        s.cached += 1 + out.num_accepted  # pending and the accepted drafts stay; the rest is rolled back
        self.runner.truncate(s.seq, s.cached)
        s.pending = out.next_token
        self.finish(Verified(out.num_accepted, out.next_token,
                             self.forward_ms + (time.perf_counter() - t0) * 1e3, s.cached))


class TargetEngine(PooledEngine[_Session]):
    role = "target"

    def __init__(self, runner: BatchRunner, config: TargetConfig | None = None, on_step=None):
        super().__init__(runner, config or TargetConfig(), on_step)

    # -- the API (event loop) ----------------------------------------------------------------------
    async def open(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, seed: int,
                   max_tokens: int, max_draft: int) -> None:
        """Admit a session: validation, then its worst case reserved in the pool (waiting, bounded,
        while the pool is full). No model work: see `prefill`."""
        sampling.validate()
        f = self.runner.facts
        if not prompt_ids:
            raise InvalidArgument("prompt is empty")
        if min(prompt_ids) < 0 or max(prompt_ids) >= f.vocab_size:
            raise InvalidArgument(f"prompt token ids must be in [0, {f.vocab_size})")
        if max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {max_tokens}")
        if not 0 <= max_draft <= MAX_DRAFT_TOKENS:
            raise InvalidArgument(f"max_draft must be in [0, {MAX_DRAFT_TOKENS}], got {max_draft}")
        need = len(prompt_ids) + max_tokens + max_draft + 1
        if need > f.max_context:
            raise InvalidArgument(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) + drafts "
                                  f"({max_draft + 1}) exceed the target context of {f.max_context}")
        seq = await self._admit(session_id, need)
        self._sessions[session_id] = _Session(seq, list(prompt_ids), sampling, make_generator(seed), max_draft)

    def prefill(self, session_id: str) -> Future:
        """-> Future[Opened]: the prompt's forward (chunked) and the first token."""
        return self.loop.submit(_Prefill(self._get(session_id)))

    def verify(self, session_id: str, draft_ids: list[int], draft_dists: list[SparseDist]) -> Future:
        """-> Future[Verified]. Raises InvalidArgument, before anything changes, when the round is malformed."""
        s = self._get(session_id)
        q = self._draft_probs(s, draft_ids, draft_dists)
        return self.loop.submit(_Verify(s, self.runner, list(draft_ids), q))

    # -- internals ----------------------------------------------------------------------------------
    def _draft_probs(self, s: _Session, draft_ids: list[int], dists: list[SparseDist]) -> torch.Tensor:
        """The dense q~ [k, V] of a round, after checking everything about it."""
        k, vocab = len(draft_ids), self.runner.facts.vocab_size
        if k > s.max_draft:
            raise InvalidArgument(f"{k} draft tokens, but the session was opened for at most {s.max_draft}")
        if len(dists) != k:
            raise InvalidArgument(f"{k} draft tokens but {len(dists)} draft distributions")
        if k and (min(draft_ids) < 0 or max(draft_ids) >= vocab):
            raise InvalidArgument(f"draft token ids must be in [0, {vocab})")
        q = torch.zeros(k, vocab)  # [k, V]
        for i, (ids, probs) in enumerate(dists):
            if len(ids) != len(probs) or not ids:
                raise InvalidArgument(f"draft distribution {i} is malformed")
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidArgument(f"draft distribution {i} has token ids outside [0, {vocab})")
            pr = torch.tensor(probs, dtype=torch.float32)  # [m]
            if not torch.isfinite(pr).all() or (pr < 0).any() or not math.isclose(float(pr.sum()), 1.0, abs_tol=1e-3):
                raise InvalidArgument(f"draft distribution {i} must be finite, >= 0 and sum to 1")
            q[i, torch.tensor(ids, dtype=torch.long)] = pr
            if q[i, draft_ids[i]] <= 0:
                raise InvalidArgument(f"draft token {i} has probability 0 in its own distribution")
        return q
