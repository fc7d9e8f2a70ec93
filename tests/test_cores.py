"""Borrowing the other model service's core while it is idle: the core board, the governor, and
the step loop that drives them (a recording runner, no model)."""
from __future__ import annotations

import threading

from specdec.serving.cores import CoreBoard, ThreadGovernor, governor_for
from specdec.serving.jobs import Job
from specdec.serving.scheduler import Scheduler, SchedulerConfig
from specdec.serving.step_loop import StepLoop
from test_step_loop import RecordingRunner


class Feed(Job):
    def on_logits(self, logits):
        self.finish(logits.shape[0])


def test_the_board_shows_each_service_the_others_work(tmp_path):
    path = str(tmp_path / "board")
    target, draft = CoreBoard(path, "target"), CoreBoard(path, "draft")
    assert not target.other_busy() and not draft.other_busy()
    draft.set_busy(True)
    assert target.other_busy() and not draft.other_busy()
    target.set_busy(True)
    draft.close()  # a service that stops clears its byte
    assert not target.other_busy()
    assert CoreBoard(path, "draft").other_busy()  # a new one sees the target still busy


def test_the_governor_borrows_only_while_the_other_is_idle_and_gives_back(tmp_path):
    path = str(tmp_path / "board")
    other = CoreBoard(path, "target")
    applied: list[int] = []
    gov = governor_for("draft", [0], 1, path, applied.append)
    assert gov is not None and (gov.base, gov.idle) == (1, 2)
    gov.adjust()  # the target idle: the draft steps on both cores
    other.set_busy(True)
    gov.adjust()
    gov.adjust()  # unchanged: not applied again
    other.set_busy(False)
    gov.adjust()
    gov.close()  # back to its own threads
    assert applied == [2, 1, 2, 1]
    assert gov.borrowed_steps == 2
    assert governor_for("draft", [], 1, path, applied.append) is None  # nothing to borrow: no governor


def test_the_step_loop_says_when_it_has_work_and_chooses_threads_between_layers(tmp_path):
    path = str(tmp_path / "board")
    target = CoreBoard(path, "target")
    seen: list[tuple[bool, int]] = []  # (the draft busy on the board, its threads) at each layer

    class LayeredRunner(RecordingRunner):
        def forward(self, chunks, stop=None):
            for layer in range(3):
                if layer == 1:
                    target.set_busy(True)  # the target starts a verify mid-step
                stop()
                seen.append((target.other_busy(), gov.threads))
            return super().forward(chunks)

    threads: list[int] = []
    gov = ThreadGovernor(CoreBoard(path, "draft"), 1, 2, threads.append)
    runner = LayeredRunner()
    loop = StepLoop(runner, Scheduler(SchedulerConfig()), governor=gov)
    s = runner.blocks.reserve(16)
    job = Feed(s, 0, [1, 2, 3], 1)
    loop.submit(job)
    loop.step(block=True)
    assert job.future.result(1) == 1
    assert seen == [(True, 2), (True, 1), (True, 1)]  # gave the core back at the next layer
    target.set_busy(False)
    done = threading.Event()
    loop.call(done.set)
    loop.step(block=True)  # nothing to run: the loop marks itself idle before it waits
    assert done.is_set() and not target.other_busy()
    assert threads == [2, 1]
