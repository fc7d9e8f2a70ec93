"""In-process backends for tests: the orchestrator engine over the target and draft engines, no network.

Used by tests that exercise the real speculative path without gRPC.
Engine calls run in worker threads, one per engine, so that drafting and verifying
overlap as they do across processes.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from draft_service.engine import DraftEngine
from orchestrator.engine import DraftResult, TargetFacts, TargetOpenResult, VerifyResult
from specdec.sampling import SamplingParams
from target_service.engine import TargetEngine


class LocalTargetSession:
    def __init__(self, engine: TargetEngine, pool: ThreadPoolExecutor, sid: str):
        self.engine, self.pool, self.sid = engine, pool, sid

    async def _run(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *a)

    async def open(self, prompt_ids, sampling: SamplingParams, seed: int) -> TargetOpenResult:
        self.engine.open(self.sid, list(prompt_ids), sampling, seed)
        o = await self._run(self.engine.prefill, self.sid)
        return TargetOpenResult(o.first_token, o.prefill_ms)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        t0 = time.perf_counter()
        v = await self._run(self.engine.verify, self.sid, list(draft_ids), list(dists))
        return VerifyResult(v.num_accepted, v.next_token, v.verify_ms, (time.perf_counter() - t0) * 1e3, 0)

    async def close(self):
        self.engine.close(self.sid)


class LocalDraftSession:
    def __init__(self, engine: DraftEngine, pool: ThreadPoolExecutor, sid: str):
        self.engine, self.pool, self.sid = engine, pool, sid

    async def _run(self, fn, *a):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *a)

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size) -> float:
        self.engine.open(self.sid, list(prompt_ids), sampling, target_fingerprint, target_vocab_size)
        return await self._run(self.engine.prefill, self.sid)

    async def propose(self, keep, append, k, seed) -> DraftResult:
        p = await self._run(self.engine.propose, self.sid, keep, list(append), k, seed)
        return DraftResult(p.token_ids, p.dists, p.draft_ms)

    async def close(self):
        self.engine.close(self.sid)


class LocalBackends:
    def __init__(self, target: TargetEngine, draft: DraftEngine | None):
        self.target_engine = target
        self.draft_engine = draft
        r = target.runner
        self.target = TargetFacts(r.fingerprint, r.vocab_size, r.max_context, r.eos_token_ids)
        self._tpool = ThreadPoolExecutor(1, thread_name_prefix="target")
        self._dpool = ThreadPoolExecutor(1, thread_name_prefix="draft")
        self.draft_failures = 0

    def new_target_session(self, sid, deadline=None):
        return LocalTargetSession(self.target_engine, self._tpool, sid)

    def new_draft_session(self, sid, deadline=None):
        return LocalDraftSession(self.draft_engine, self._dpool, sid) if self.draft_engine else None

    def draft_failed(self, error):
        self.draft_failures += 1
