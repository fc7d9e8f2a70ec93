"""Borrowing the other model service's core while it is idle (CPU hosts).

On a CPU the target and the draft each pin themselves to their own cores, so that they
really run at once. But in a round one of them often waits for the other: in a pipeline
whose draft is slower than the verify, the target's core idles for the rest of every round
once its verify is done (BENCHMARKS.md §6j). A service configured with `borrow_cores` (the
other's cores) may step with more threads, `num_threads + len(borrow_cores)`, while the
other service has no work, and with `num_threads` while it has.

Who has work is read from a `CoreBoard`: a two-byte file both services map (`core_board`),
one byte per role, set by each service's step loop while it has jobs waiting or running.
The thread count is chosen before every step and again between the layers of a torch step
(where the runner asks its stop check), so a service that borrowed a core gives it back
within a layer once the other one starts a step. A service that dies with its byte set
leaves the other one at its own threads (never more): the safe side.
"""
from __future__ import annotations

import logging
import mmap
import os
from typing import Callable

log = logging.getLogger(__name__)

ROLES = ("target", "draft")  # byte 0, byte 1
DEFAULT_BOARD = "/dev/shm/specdec-core-board"  # one per host: stacks side by side set their own


class CoreBoard:
    """One busy byte per model service in a shared file."""

    def __init__(self, path: str, role: str):
        if role not in ROLES:
            raise ValueError(f"a core board has the roles {ROLES}, got {role!r}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < len(ROLES):
                os.ftruncate(fd, len(ROLES))
            self._map = mmap.mmap(fd, len(ROLES))
        finally:
            os.close(fd)
        self.path = path
        self._mine = ROLES.index(role)
        self._other = 1 - self._mine
        self.set_busy(False)

    def set_busy(self, busy: bool) -> None:
        self._map[self._mine] = 1 if busy else 0

    def other_busy(self) -> bool:
        return self._map[self._other] != 0

    def close(self) -> None:
        self.set_busy(False)
        self._map.close()


class ThreadGovernor:
    """Chooses the threads of the next step (or layer): `base` while the other service is busy,
    `idle` while it is not, applied through `set_threads` only when the count changes."""

    def __init__(self, board: CoreBoard, base: int, idle: int, set_threads: Callable[[int], None]):
        self.board = board
        self.base, self.idle = base, idle
        self.set_threads = set_threads
        self.threads = base
        self.borrowed_steps = 0  # steps (or layers) that ran with the other's cores

    def busy(self, busy: bool) -> None:
        self.board.set_busy(busy)

    def adjust(self) -> None:
        n = self.base if self.board.other_busy() else self.idle
        if n != self.threads:
            self.set_threads(n)
            self.threads = n
        self.borrowed_steps += n > self.base

    def close(self) -> None:
        if self.threads != self.base:
            self.set_threads(self.base)
        self.board.close()


def governor_for(role: str, borrow_cores: list[int], num_threads: int, board_path: str,
                 set_threads: Callable[[int], None]) -> ThreadGovernor | None:
    """The governor of a service that borrows `borrow_cores` (None when it borrows none)."""
    if not borrow_cores:
        return None
    base = max(1, num_threads)
    board = CoreBoard(board_path or DEFAULT_BOARD, role)
    log.info("%s borrows cores %s while the other service is idle (%d threads, else %d; board %s)",
             role, borrow_cores, base + len(borrow_cores), base, board.path)
    return ThreadGovernor(board, base, base + len(borrow_cores), set_threads)
