"""Which work goes into the next step: one flat batch under a token budget.

Policy (one forward per step, every sequence at most once in it):
1. work that cannot be split (verifies, draft tokens) goes first, oldest first: running
   streams never wait behind a new prompt;
2. what is left of the budget goes to splittable work (prompts, long appends), oldest first,
   cut into chunks: a long prompt is prefilled over several steps while the running
   streams keep stepping (chunked prefill), and at most `max_prefill_tokens` of it per step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from specdec.serving.batch import SeqChunk
from specdec.serving.jobs import Job


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 512  # tokens in one forward, all sequences together
    max_prefill_tokens: int = 128  # of which prompt (splittable) tokens, so that one prompt does not stall the rest


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        if config.max_prefill_tokens <= 0 or config.max_step_tokens < config.max_prefill_tokens:
            raise ValueError("need 0 < max_prefill_tokens <= max_step_tokens")
        self.config = config
        self.waiting: deque[Job] = deque()

    def add(self, job: Job) -> None:
        if not job.splittable and job.want > self.config.max_step_tokens:
            raise ValueError(f"a job of {job.want} tokens cannot fit a step of {self.config.max_step_tokens}")
        self.waiting.append(job)

    def __len__(self) -> int:
        return len(self.waiting)

    def drop(self, seq: int) -> list[Job]:
        """Remove (and return) every job of `seq`."""
        gone = [j for j in self.waiting if j.seq == seq]
        self.waiting = deque(j for j in self.waiting if j.seq != seq)
        return gone

    def schedule(self) -> list[tuple[Job, SeqChunk]]:
        """The next step's batch: (job, chunk) pairs, each sequence at most once."""
        heads = self._heads()
        budget = self.config.max_step_tokens
        batch: list[tuple[Job, SeqChunk]] = []
        for job in heads:  # 1. whole work: verifies and draft steps
            if not job.splittable and job.want <= budget:
                batch.append((job, job.take(job.want)))
                budget -= len(batch[-1][1].tokens)
        prefill = min(budget, self.config.max_prefill_tokens)
        for job in heads:  # 2. chunks of prompts in what is left
            if job.splittable and 0 < job.min_chunk() <= prefill:
                batch.append((job, job.take(prefill)))
                prefill -= len(batch[-1][1].tokens)
        if not batch and heads:  # a lone job bigger than the budget: give it the whole step
            batch.append((heads[0], heads[0].take(self.config.max_step_tokens)))
        return batch

    def _heads(self) -> list[Job]:
        """The oldest waiting job of each sequence (a sequence's jobs run in order, one per step)."""
        seen: set[int] = set()
        heads = []
        for job in self.waiting:
            if job.seq not in seen:
                seen.add(job.seq)
                heads.append(job)
        return heads

    def settle(self, job: Job) -> None:
        """After a step: a job that is done leaves; one that still has tokens to feed stays."""
        if job.done:
            self.waiting.remove(job)
