"""The scheduler's policy and the step loop's mechanics, with a recording runner (no model: the
runner's numerics are tested in test_paged_llama.py and test_llamacpp_runner.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from specdec.serving.batch import ModelFacts, SeqChunk, StepAborted
from specdec.serving.blocks import BlockManager
from specdec.serving.jobs import Job
from specdec.serving.scheduler import Scheduler, SchedulerConfig
from specdec.serving.step_loop import StepLoop

V = 8


class RecordingRunner:
    """Keeps the BatchRunner contract (lengths, one chunk per sequence) and records every batch."""

    def __init__(self):
        self.blocks = BlockManager(256, 4, 16)
        self.facts = ModelFacts("rec", "test", "", V, 1024)
        self.batches: list[list[SeqChunk]] = []
        self.gate: threading.Event | None = None

    def forward(self, chunks, stop=None):
        if self.gate is not None:
            assert self.gate.wait(10)
        assert len({c.seq for c in chunks}) == len(chunks)
        for c in chunks:
            assert c.start == self.blocks.length(c.seq), (c, self.blocks.length(c.seq))
            self.blocks.ensure(c.seq, c.start + len(c.tokens))
        self.batches.append(list(chunks))
        return [torch.full((c.num_logits, V), float(c.seq)) for c in chunks]

    def truncate(self, seq, length):
        self.blocks.truncate(seq, length)

    def free(self, seq):
        self.blocks.free(seq)


class Feed(Job):
    def on_logits(self, logits):
        self.finish(logits.shape[0])


class Whole(Feed):
    splittable = False


def test_verifies_go_first_and_prompts_fill_the_rest_in_chunks():
    runner = RecordingRunner()
    seqs = [runner.blocks.reserve(120) for _ in range(4)]
    sched = Scheduler(SchedulerConfig(max_step_tokens=64, max_prefill_tokens=32))
    prompt = Feed(seqs[0], 0, list(range(100)), 1)
    verifies = [Whole(s, 0, [1] * 9, 9) for s in seqs[1:]]
    for j in [prompt, *verifies]:
        sched.add(j)
    batch = sched.schedule()
    assert [j for j, _ in batch][:3] == verifies  # the running streams first, whole
    assert [len(c.tokens) for _, c in batch] == [9, 9, 9, 32]  # the prompt gets at most 32 of what is left
    assert batch[3][1].num_logits == 0  # no logits for a middle chunk
    for j, c in batch:
        runner.forward([c])
        if j.fed:
            j.on_logits(torch.zeros(c.num_logits, V))
        sched.settle(j)
    assert len(sched) == 1 and prompt.start == 32
    while len(sched):
        (j, c), = sched.schedule()
        runner.forward([c])
        if j.fed:
            j.on_logits(torch.zeros(c.num_logits, V))
        sched.settle(j)
    assert prompt.future.result() == 1


def test_a_sequence_runs_its_jobs_in_order_one_per_step():
    sched = Scheduler(SchedulerConfig(64, 32))
    a, b = Whole(0, 0, [1, 2], 2), Whole(0, 2, [3], 1)
    sched.add(a)
    sched.add(b)
    assert [j for j, _ in sched.schedule()] == [a]


def test_a_verify_too_big_for_any_step_is_refused():
    with pytest.raises(ValueError, match="cannot fit"):
        Scheduler(SchedulerConfig(16, 8)).add(Whole(0, 0, [1] * 17, 17))


def test_the_loop_batches_every_waiting_session_and_skips_cancelled_work():
    runner = RecordingRunner()
    runner.gate = threading.Event()
    loop = StepLoop(runner, Scheduler(SchedulerConfig(512, 128))).start()
    try:
        seqs = [runner.blocks.reserve(64) for _ in range(5)]
        first = loop.submit(Whole(seqs[0], 0, [1] * 3, 3))  # the loop takes it and waits at the gate
        later = [loop.submit(Whole(s, 0, [1] * 9, 9)) for s in seqs[1:]]
        dropped = loop.submit(Whole(seqs[4], 9, [1], 1))
        dropped.cancel()  # nobody waits for it any more: it must never run
        runner.gate.set()
        assert first.result(10) == 3
        assert [f.result(10) for f in later] == [9] * 4
        assert loop.call(lambda: runner.blocks.length(seqs[4])).result(10) == 9
        # the first may have gone alone, before the others arrived; the ones that waited went in one forward
        assert sum(len(b) for b in runner.batches) == 5 and len(runner.batches) <= 2
    finally:
        loop.stop()


def test_a_failing_forward_fails_its_jobs_and_the_loop_goes_on():
    runner = RecordingRunner()
    loop = StepLoop(runner, Scheduler(SchedulerConfig(512, 128))).start()
    try:
        seq = runner.blocks.reserve(64)
        bad = loop.submit(Whole(seq, 5, [1], 1))  # starts where nothing is cached: the runner refuses
        with pytest.raises(AssertionError):
            bad.result(10)
        assert loop.submit(Whole(seq, 0, [1, 2], 2)).result(10) == 2
    finally:
        loop.stop()


class LayeredRunner(RecordingRunner):
    """A forward of `layers` slow layers that asks stop() before each, like the paged runner."""

    def __init__(self, layers: int = 200, layer_s: float = 0.01):
        super().__init__()
        self.layers, self.layer_s = layers, layer_s
        self.started = threading.Event()

    def forward(self, chunks, stop=None):
        import time

        self.started.set()
        for i in range(self.layers):
            if stop is not None and stop():
                raise StepAborted(f"stopped before layer {i}")
            time.sleep(self.layer_s)
        return super().forward(chunks)


def test_a_step_of_closed_sequences_stops_part_way_and_others_run_to_the_end():
    import time

    runner = LayeredRunner()  # a step takes 2 s unless stopped
    loop = StepLoop(runner, Scheduler(SchedulerConfig(512, 128))).start()
    try:
        a, b = runner.blocks.reserve(64), runner.blocks.reserve(64)
        job = loop.submit(Whole(a, 0, [1] * 9, 9))
        assert runner.started.wait(10)
        t0 = time.monotonic()
        loop.abandon(a)
        with pytest.raises(StepAborted):
            job.result(10)
        assert time.monotonic() - t0 < 0.5 and loop.aborted_steps == 1
        assert loop.call(lambda: runner.blocks.length(a)).result(10) == 0  # nothing kept
        loop.forget(a)
        runner.started.clear()
        both = [loop.submit(Whole(s, 0, [1] * 3, 3)) for s in (a, b)]
        assert runner.started.wait(10)
        loop.abandon(b)  # one of the two is closed: the other still needs the step
        assert [f.result(10) for f in both] == [3, 3] and loop.aborted_steps == 1
    finally:
        loop.stop()
