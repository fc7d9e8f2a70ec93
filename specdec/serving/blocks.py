"""The block manager: a fixed pool of KV blocks, sized at startup, that never grows.

Tokens live in blocks of `block_size` slots. Each sequence has a block table (its blocks
in position order), so token position p of a sequence sits in slot
`table[p // block_size] * block_size + p % block_size` of the pool.

Admission is by reservation: a sequence is admitted only if its worst case
(`reserve(tokens)`) fits next to everything already reserved, so an admitted sequence
never fails for lack of KV. Blocks are allocated lazily up to the reservation as the
sequence grows; rollback frees whole tail blocks; `free` returns all blocks and the
reservation. All methods are thread-safe (admission runs on the event loop, growth in
the model thread).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field


class PoolFull(Exception):
    """Not enough unreserved blocks (or sequence slots) for a new sequence."""


@dataclass
class _Seq:
    reserved: int  # blocks reserved for this sequence (its worst case)
    table: list[int] = field(default_factory=list)  # block ids in position order
    length: int = 0  # tokens covered by the table's contents


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    block_size: int
    used_blocks: int  # allocated to some sequence
    reserved_blocks: int  # promised to admitted sequences (>= used)
    sequences: int

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - self.used_blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int = 16, max_seqs: int = 64):
        if num_blocks <= 0 or block_size <= 0 or max_seqs <= 0:
            raise ValueError("num_blocks, block_size and max_seqs must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_seqs = max_seqs
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: low ids first
        self._free_ids = list(range(max_seqs - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-max(0, tokens) // self.block_size)

    # -- admission -----------------------------------------------------------------------
    def can_reserve(self, tokens: int) -> bool:
        with self._lock:
            return bool(self._free_ids) and self._reserved + self.blocks_for(tokens) <= self.num_blocks

    def reserve(self, tokens: int) -> int:
        """Admit a sequence whose length will never pass `tokens`; returns its id."""
        need = self.blocks_for(tokens)
        with self._lock:
            if not self._free_ids:
                raise PoolFull(f"all {self.max_seqs} sequence slots are in use")
            if self._reserved + need > self.num_blocks:
                raise PoolFull(f"needs {need} blocks of {self.block_size} tokens; "
                               f"{self.num_blocks - self._reserved} of {self.num_blocks} are unreserved")
            seq = self._free_ids.pop()
            self._seqs[seq] = _Seq(need)
            self._reserved += need
            return seq

    # -- growth and rollback (model thread) ----------------------------------------------------
    def ensure(self, seq: int, length: int) -> None:
        """Make `seq`'s table cover `length` tokens (allocating blocks within its reservation)."""
        with self._lock:
            s = self._seqs[seq]
            need = self.blocks_for(length)
            if need > s.reserved:
                raise ValueError(f"sequence {seq} would need {need} blocks but reserved {s.reserved}")
            while len(s.table) < need:
                s.table.append(self._free_blocks.pop())
            s.length = max(s.length, length)

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first `length` tokens; whole blocks past them go back to the pool."""
        with self._lock:
            s = self._seqs[seq]
            keep = self.blocks_for(length)
            while len(s.table) > keep:
                self._free_blocks.append(s.table.pop())
            s.length = min(s.length, length)

    def free(self, seq: int) -> None:
        """Return all of `seq`'s blocks and its reservation; a second call does nothing."""
        with self._lock:
            s = self._seqs.pop(seq, None)
            if s is None:
                return
            self._free_blocks.extend(reversed(s.table))
            self._reserved -= s.reserved
            self._free_ids.append(seq)

    # -- lookups -----------------------------------------------------------------------------
    def length(self, seq: int) -> int:
        return self._seqs[seq].length

    def table(self, seq: int) -> list[int]:
        return list(self._seqs[seq].table)

    def slots(self, seq: int, start: int, n: int) -> list[int]:
        """Pool slot of each position start .. start+n-1 (the table must cover them)."""
        t, bs = self._seqs[seq].table, self.block_size
        return [t[p // bs] * bs + p % bs for p in range(start, start + n)]

    def stats(self) -> PoolStats:
        with self._lock:
            used = self.num_blocks - len(self._free_blocks)
            return PoolStats(self.num_blocks, self.block_size, used, self._reserved, len(self._seqs))
