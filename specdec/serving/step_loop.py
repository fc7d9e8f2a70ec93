"""The model thread of a service: one forward per step over everything that is waiting.

gRPC handlers only submit work (`submit` a Job, `call` a Command) and await its future;
this thread owns the runner. Between steps it runs the commands (freeing a closed
session's sequence, for example), so no sequence is freed while a forward uses it. A
step whose sequences were all closed (`abandon`) stops at the runner's next layer instead
of running to its end: a long prefill chunk (1.3 s for 128 prompt tokens of the int4
draft on this CPU) does not keep a closed session's memory for its whole length.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from specdec.serving.batch import BatchRunner, StepAborted
from specdec.serving.jobs import Command, Job
from specdec.serving.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepRecord:
    sequences: int
    tokens: int
    seconds: float
    queue_waits: list[float]  # seconds from submit to first step, of the jobs that started in this step


class StepLoop:
    def __init__(self, runner: BatchRunner, scheduler: Scheduler, name: str = "model",
                 on_step: Callable[[StepRecord], None] | None = None):
        self.runner = runner
        self.scheduler = scheduler
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._abandoned: set[int] = set()  # closed sequences whose free has not run yet
        self.steps = 0
        self.aborted_steps = 0

    # -- any thread ------------------------------------------------------------------------------
    def start(self) -> "StepLoop":
        self._thread.start()
        return self

    def submit(self, job: Job) -> Future:
        self._inbox.put(job)
        return job.future

    def call(self, fn, *args) -> Future:
        """Run fn(*args) in the model thread between steps."""
        cmd = Command(fn, *args)
        self._inbox.put(cmd)
        return cmd.future

    def abandon(self, seq: int) -> None:
        """`seq` was closed (any thread): a step that carries nothing else may stop part way.
        Its free, queued with `call`, runs next and calls `forget`."""
        self._abandoned.add(seq)

    def forget(self, seq: int) -> None:
        """(model thread, before the sequence id can be handed out again)"""
        self._abandoned.discard(seq)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)

    # -- the model thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.step(block=True)
            except Exception:  # noqa: BLE001 - the loop must outlive one bad step
                log.exception("step failed")

    def step(self, block: bool = False) -> StepRecord | None:
        """Take in new work, run one forward over the next batch, hand out the logits."""
        self._take_inbox(block and not len(self.scheduler))
        for job in [j for j in self.scheduler.waiting if j.future.cancelled()]:  # nobody waits for it
            self.scheduler.waiting.remove(job)
        batch = self.scheduler.schedule()
        if not batch:
            return None
        t0 = time.perf_counter()
        for job, _ in batch:
            job.started = job.started or t0
        seqs = [job.seq for job, _ in batch]
        try:
            logits = self.runner.forward([chunk for _, chunk in batch],
                                         stop=lambda: all(s in self._abandoned for s in seqs))
        except Exception as e:  # noqa: BLE001 - the batch's jobs fail, the loop goes on
            if isinstance(e, StepAborted):
                self.aborted_steps += 1
            else:
                log.exception("forward failed")
            for job, _ in batch:
                job.fail(e)
                self.scheduler.settle(job)
            return None
        forward_ms = (time.perf_counter() - t0) * 1e3
        for (job, _), rows in zip(batch, logits):
            job.forward_ms = forward_ms
            if job.fed:
                try:
                    job.on_logits(rows)
                except Exception as e:  # noqa: BLE001 - handed to whoever waits for the job
                    job.fail(e)
            self.scheduler.settle(job)
        rec = StepRecord(len(batch), sum(len(c.tokens) for _, c in batch), time.perf_counter() - t0,
                         [t0 - job.submitted for job, _ in batch if job.started == t0])
        self.steps += 1
        if self.on_step is not None:
            self.on_step(rec)
        return rec

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                continue
            if isinstance(item, Command):
                item.run()
            else:
                try:
                    self.scheduler.add(item)
                except Exception as e:  # noqa: BLE001 - a job that can never run
                    item.fail(e)
