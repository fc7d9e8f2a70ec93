"""In-process backends for tests: the orchestrator engine over the real target and draft engines,
no network. Each engine runs its own model thread (its step loop), so drafting and verifying
overlap, and sessions are batched, as they are across processes.
"""
from __future__ import annotations

import asyncio
import time

from orchestrator.engine import DraftResult, TargetFacts, TargetOpenResult, VerifyResult
from specdec.sampling_params import SamplingParams


class LocalTargetSession:
    def __init__(self, engine, sid: str):
        self.engine, self.sid = engine, sid

    async def open(self, prompt_ids, sampling: SamplingParams, seed: int, max_tokens: int,
                   max_draft: int) -> TargetOpenResult:
        await self.engine.open(self.sid, list(prompt_ids), sampling, seed, max_tokens, max_draft)
        o = await asyncio.wrap_future(self.engine.prefill(self.sid))
        return TargetOpenResult(o.first_token, o.prefill_ms)

    async def verify(self, draft_ids, dists) -> VerifyResult:
        t0 = time.perf_counter()
        v = await asyncio.wrap_future(self.engine.verify(self.sid, list(draft_ids), list(dists)))
        return VerifyResult(v.num_accepted, v.next_token, v.verify_ms, (time.perf_counter() - t0) * 1e3, 0)

    async def close(self):
        self.engine.close(self.sid)


class LocalDraftSession:
    def __init__(self, engine, sid: str):
        self.engine, self.sid = engine, sid

    async def open(self, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_tokens,
                   max_draft) -> float:
        await self.engine.open(self.sid, list(prompt_ids), sampling, target_fingerprint, target_vocab_size, 0,
                               max_tokens, max_draft)
        return await asyncio.wrap_future(self.engine.prefill(self.sid))

    async def propose(self, keep, append, k, seed, guess_first=False) -> DraftResult:
        p = await asyncio.wrap_future(self.engine.propose(self.sid, keep, list(append), k, seed, guess_first))
        return DraftResult(p.token_ids, p.dists, p.draft_ms)

    async def cut(self):
        self.engine.cut(self.sid)

    async def close(self):
        self.engine.close(self.sid)


class LocalBackends:
    def __init__(self, target, draft=None):
        self.target_engine = target.start()
        self.draft_engine = draft.start() if draft is not None else None
        f = target.runner.facts
        self.target = TargetFacts(f.fingerprint, f.vocab_size, f.max_context, f.eos_token_ids)
        self.draft_failures = 0

    def new_target_session(self, sid, deadline=None):
        return LocalTargetSession(self.target_engine, sid)

    async def replacement_target_session(self, failed, sid, deadline=None):
        return None  # one target engine

    def new_draft_session(self, sid, deadline=None):
        return LocalDraftSession(self.draft_engine, sid) if self.draft_engine else None

    def draft_failed(self, error):
        self.draft_failures += 1

    def stop(self) -> None:
        self.target_engine.stop()
        if self.draft_engine is not None:
            self.draft_engine.stop()
