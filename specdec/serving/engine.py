"""What every model service's engine is: sessions as sequences of a runner's fixed KV pool,
admitted by reservation, served by one model thread (the step loop).

Subclasses (the target's and the draft's engines) add the session state and the jobs; the
bookkeeping lives here once: admission, lookup, occupancy, and a close that never blocks
(the model thread frees the sequence between steps; a step that carries only closed
sessions stops at its next layer).
"""
from __future__ import annotations

from typing import Generic, TypeVar

from specdec.config import ModelServiceConfig
from specdec.errors import FailedPrecondition, NotFound
from specdec.serving.admission import Admission
from specdec.serving.batch import BatchRunner
from specdec.serving.scheduler import Scheduler, SchedulerConfig
from specdec.serving.step_loop import StepLoop

S = TypeVar("S")  # a session: anything with `seq` (its sequence id) and `cached` (tokens in the cache)


class PooledEngine(Generic[S]):
    role = "model"  # "target" | "draft": names the thread, the pool and the errors

    def __init__(self, runner: BatchRunner, config: ModelServiceConfig, on_step=None):
        self.runner = runner
        self.facts = runner.facts
        self.config = config
        self.loop = StepLoop(runner, Scheduler(SchedulerConfig(config.max_step_tokens, config.max_prefill_tokens)),
                             f"{self.role}-model", on_step)
        self.admission = Admission(runner.blocks, config.admission_wait_s, config.admission_queue,
                                   f"{self.role} KV pool")
        self._sessions: dict[str, S] = {}

    def start(self):
        self.loop.start()
        return self

    def stop(self) -> None:
        self.loop.stop()

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens_in_use(self) -> int:
        return sum(s.cached for s in list(self._sessions.values()))

    async def _admit(self, session_id: str, tokens: int) -> int:
        """Reserve `tokens` for a new session (waiting, bounded, while the pool is full): its sequence id.
        The caller registers the session right away, with no await in between."""
        if session_id in self._sessions:
            raise FailedPrecondition(f"{self.role} session {session_id!r} already open")
        return await self.admission.reserve(tokens)

    def _get(self, session_id: str) -> S:
        s = self._sessions.get(session_id)
        if s is None:
            raise NotFound(f"no {self.role} session {session_id!r}")
        return s

    def close(self, session_id: str) -> None:
        """Forget the session (idempotent, never blocks); the model thread frees its sequence
        between steps, after any work in flight for it."""
        s = self._sessions.pop(session_id, None)
        if s is not None:
            self.admission.releasing()
            self.loop.abandon(s.seq)  # a step of closed sessions only stops at its next layer
            self.loop.call(self._free, s.seq)

    def _free(self, seq: int) -> None:  # model thread
        for job in self.loop.scheduler.drop(seq):
            job.fail(NotFound("the session was closed"))
        self.loop.forget(seq)
        self.runner.free(seq)
        self.admission.released()
