"""Admission to a fixed KV pool: reserve a new sequence's worst case, or wait for room.

A request is admitted only if its blocks can be guaranteed (see `BlockManager.reserve`), so
an admitted request never fails for lack of KV. When the pool is full, newcomers wait in a
bounded FIFO queue for at most `wait_s`, then get RESOURCE_EXHAUSTED with a clear message;
running requests are not affected, and nobody overtakes a waiting request. A closed session's
sequence is freed by the model thread between steps: until then its room counts as on its way
(`releasing`), so even in a service that does not queue a newcomer waits for it, for as long as
room is still on its way (a stalled machine must not turn a returning slot into a refusal), at
most `RELEASE_WAIT_S`, and is refused as soon as every closed session has given its room back
and it still does not fit. Lives on the service's event loop; `released` may be called from any
thread.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

from specdec.errors import ResourceExhausted
from specdec.serving.blocks import BlockManager, PoolFull


@dataclass
class _Waiter:
    tokens: int
    future: asyncio.Future  # -> the sequence id, set by _admit
    taken: bool = False  # the waiting request got its sequence


RELEASE_WAIT_S = 10.0  # the most a newcomer waits for room that closed sessions are giving back (a stall bound;
# it is refused as soon as nothing is on its way any more)


class Admission:
    def __init__(self, blocks: BlockManager, wait_s: float, max_waiting: int, what: str = "KV pool"):
        self.blocks = blocks
        self.wait_s = wait_s
        self.max_waiting = max_waiting
        self.what = what
        self._waiting: deque[_Waiter] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._releasing = 0  # sequences closed whose free has not run yet
        self._lock = threading.Lock()
        self.refused = 0  # requests refused for capacity
        self.last_wait_s = 0.0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def reserve(self, tokens: int) -> int:
        """A sequence id whose `tokens` are guaranteed; raises ResourceExhausted."""
        self._loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        need, total = self.blocks.blocks_for(tokens), self.blocks.num_blocks
        if need > total:
            self.refused += 1
            raise ResourceExhausted(f"the request needs {tokens} tokens of KV but the whole {self.what} holds "
                                    f"{self.blocks.capacity_tokens}")
        releasing = self._releasing  # read before trying: the model thread may free them meanwhile
        if not self._waiting:  # FIFO: nobody overtakes a waiting request
            try:
                return self.blocks.reserve(tokens)
            except PoolFull:
                pass
        queues = self.wait_s > 0
        if queues and len(self._waiting) >= self.max_waiting:
            self.refused += 1
            raise ResourceExhausted(f"the {self.what} is full ({self._usage()}) and "
                                    f"{len(self._waiting)} requests are already waiting")
        if not queues and not (releasing or self._releasing or self._waiting):
            self.refused += 1
            raise ResourceExhausted(f"the {self.what} is full ({self._usage()}) and this service does not queue")
        wait_s = self.wait_s if queues else RELEASE_WAIT_S
        waiter = _Waiter(tokens, self._loop.create_future())
        self._waiting.append(waiter)
        self._admit()  # room freed since the try above, or nothing on its way any more
        try:
            seq = await asyncio.wait_for(asyncio.shield(waiter.future), wait_s)
        except asyncio.TimeoutError:
            self.refused += 1
            raise ResourceExhausted(f"the {self.what} stayed full for {wait_s:g} s ({self._usage()}); "
                                    f"try again later") from None
        except ResourceExhausted:
            self.refused += 1
            raise
        else:
            waiter.taken = True
            self.last_wait_s = time.monotonic() - t0
            return seq
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            f = waiter.future
            if not waiter.taken and f.done() and not f.cancelled() and f.exception() is None:
                self.blocks.free(f.result())  # admitted just as it gave up: give it back
                self._admit()

    def releasing(self) -> None:
        """A session was closed; the model thread will free its sequence."""
        with self._lock:
            self._releasing += 1

    def released(self) -> None:
        """A closed session's sequence was freed (any thread): admit whoever now fits, in order."""
        with self._lock:
            self._releasing = max(0, self._releasing - 1)
        if self._waiting and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._admit)

    def _admit(self) -> None:
        """(event loop) Admit the waiters that now fit, in order; in a service that does not queue,
        refuse those that cannot fit once no closed session's room is on its way any more."""
        while self._waiting:
            w = self._waiting[0]
            releasing = self._releasing  # read before the check: a free lands before its count drops
            if w.future.done():
                self._waiting.popleft()
            elif self.blocks.can_reserve(w.tokens):
                self._waiting.popleft()
                w.future.set_result(self.blocks.reserve(w.tokens))
            elif self.wait_s <= 0 and not releasing:
                self._waiting.popleft()
                w.future.set_exception(ResourceExhausted(
                    f"the {self.what} is full ({self._usage()}), the room closed sessions gave back was not "
                    f"enough, and this service does not queue"))
            else:
                return

    def _usage(self) -> str:
        s = self.blocks.stats()
        return (f"{s.reserved_blocks} of {s.num_blocks} blocks of {s.block_size} tokens reserved, "
                f"{s.sequences} of {self.blocks.max_seqs} sequences")
