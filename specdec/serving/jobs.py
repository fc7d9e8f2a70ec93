"""Work for one sequence, spread over steps: feed tokens (in chunks), read logits, decide.

A `Job` holds the tokens it still has to feed and how many logits it wants after the last
of them. The scheduler takes chunks of it into steps; when its last chunk has run, the job
gets its logits (`on_logits`) and either finishes with a result or asks to feed more (a
draft proposal feeds one sampled token per step). Subclasses hold the math; the loop that
drives them knows nothing of verify or drafting.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import torch

from specdec.serving.batch import SeqChunk


class Job:
    """Feed `tokens` after the sequence's `start` cached tokens; logits for the last `num_logits`."""

    splittable = True  # may the feed be cut into several steps (a prompt) or not (a verify)

    def __init__(self, seq: int, start: int, tokens: list[int], num_logits: int):
        self.seq = seq
        self.future: Future = Future()
        self.submitted = time.perf_counter()
        self.started: float | None = None  # when its first chunk went into a step (the loop sets it)
        self.forward_ms = 0.0  # the forward that carried its last chunk (the loop sets it)
        self._feed(start, tokens, num_logits)

    def _feed(self, start: int, tokens: list[int], num_logits: int) -> None:
        assert 0 <= num_logits <= len(tokens)
        self.start, self.pending, self.num_logits = start, list(tokens), num_logits

    @property
    def want(self) -> int:
        """Tokens this job would feed in its next step if nothing limited it."""
        return len(self.pending)

    def min_chunk(self) -> int:
        """The smallest chunk worth taking now: a job that cannot be split takes all or nothing,
        and a split one ends with at least its logit rows in the final chunk."""
        return len(self.pending) if not self.splittable else min(len(self.pending), max(1, self.num_logits))

    def take(self, budget: int) -> SeqChunk:
        """The next chunk, at most `budget` tokens (at least `min_chunk()`)."""
        n = len(self.pending)
        if self.splittable and budget < n:
            n = max(budget, self.min_chunk())
            if n < len(self.pending) and len(self.pending) - n < self.num_logits:
                n = len(self.pending) - self.num_logits  # keep the logit rows together at the end
        chunk = SeqChunk(self.seq, self.pending[:n], self.start, self.num_logits if n == len(self.pending) else 0)
        self.start += n
        del self.pending[:n]
        return chunk

    @property
    def fed(self) -> bool:
        return not self.pending

    def on_logits(self, logits: torch.Tensor) -> None:
        """logits [num_logits, V]: the last chunk ran. Call `finish(result)` or `_feed(...)` again."""
        raise NotImplementedError

    def elapsed_ms(self) -> float:
        """Since its first chunk went into a step."""
        return (time.perf_counter() - (self.started or self.submitted)) * 1e3

    def finish(self, result: Any) -> None:
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)

    @property
    def done(self) -> bool:
        return self.future.done()


class Command:
    """Work for the model thread that is not a forward (freeing a sequence): runs between steps."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args
        self.future: Future = Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn(*self.args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.future.set_exception(e)
