"""CUDA graphs for the paged runner's small steps: the draft's decode and the target's verify.

A graph replays a fixed sequence of kernels on fixed buffers, so a step runs as a graph only in
a shape captured before. Steps are padded up to a *bucket*:

    Bucket(batch, tokens, blocks): `batch` sequences of `tokens` query rows each, with block
    tables `blocks` wide (keys up to blocks * block_size positions).

Padding is exact: a padded row writes its K/V to a scratch slot that no sequence owns (the
pool's last block, kept out of the block manager), sits at position 0 and only attends key 0;
a padded sequence has an all-zero table; padded table columns point at keys past every real
query's position, which causality masks. Logits come out for every row and the wanted ones
are picked on the host. A step that fits no bucket (a long prefill chunk, a batch or context
larger than the largest bucket) runs eagerly, as it would without graphs.

Graphs are captured lazily, the first time a bucket is needed, up to `max_graphs`; all share
one memory pool. The capture itself is injected (`capture`): `cuda_capture` on a GPU, and in
the tests on the CPU a function that runs the step eagerly on the same static buffers, which
checks the padding and the bookkeeping without a GPU.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

log = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]  # runs the captured step; -> its (static) logits [batch*tokens, V]
Capture = Callable[[Callable[[], torch.Tensor]], Replay]


@dataclass(frozen=True, order=True)
class Bucket:
    batch: int  # sequences
    tokens: int  # query rows per sequence
    blocks: int  # block-table width


@dataclass(frozen=True)
class GraphConfig:
    """Which shapes get graphs. Batches and tokens are listed (config); block-table widths are
    powers of two from `min_blocks` up to the pool's widest table."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    min_blocks: int = 8
    max_graphs: int = 64


def parse_sizes(text: str, what: str) -> tuple[int, ...]:
    """"1,2,4,8" -> (1, 2, 4, 8), sorted, each > 0."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"{what} must list positive integers, got {text!r}")
    return tuple(sizes)


def _round_up(value: int, sizes: Sequence[int]) -> int | None:
    i = bisect.bisect_left(sizes, value)
    return sizes[i] if i < len(sizes) else None


def block_widths(min_blocks: int, max_blocks: int) -> tuple[int, ...]:
    """Powers of two from min_blocks, the last one capped at max_blocks (which it always includes)."""
    widths, w = [], max(1, min_blocks)
    while w < max_blocks:
        widths.append(w)
        w *= 2
    return (*widths, max_blocks)


def pick_bucket(cfg: GraphConfig, max_blocks: int, batch: int, tokens: int, blocks: int) -> Bucket | None:
    """The smallest bucket holding a step of `batch` sequences, at most `tokens` query rows each,
    and tables at most `blocks` wide; None when none does (the step runs eagerly)."""
    b = _round_up(batch, cfg.batches)
    t = _round_up(tokens, cfg.tokens)
    w = _round_up(blocks, block_widths(cfg.min_blocks, max_blocks))
    if b is None or t is None or w is None:
        return None
    return Bucket(b, t, w)


@dataclass
class PaddedRows:
    """Host-side index lists of one padded step (see the module docstring), and where each
    chunk's wanted logits sit among the padded rows."""

    token_ids: list[int]  # [batch*tokens]
    positions: list[int]  # [batch*tokens]
    slots: list[int]  # [batch*tokens]
    block_tables: list[list[int]]  # [batch][blocks]
    logit_rows: list[int]  # [R] the rows each chunk wants, in chunk order


def pad_rows(bucket: Bucket, chunks: Sequence[tuple[list[int], int, list[int], list[int], int]],
             scratch_slot: int) -> PaddedRows:
    """chunks: (tokens, start, slots, table, num_logits) per sequence, in order."""
    rows = bucket.batch * bucket.tokens
    token_ids, positions, slots = [0] * rows, [0] * rows, [scratch_slot] * rows
    tables = [[0] * bucket.blocks for _ in range(bucket.batch)]
    logit_rows: list[int] = []
    for b, (tokens, start, chunk_slots, table, num_logits) in enumerate(chunks):
        row0, n = b * bucket.tokens, len(tokens)
        token_ids[row0:row0 + n] = tokens
        positions[row0:row0 + n] = range(start, start + n)
        slots[row0:row0 + n] = chunk_slots
        tables[b][:len(table)] = table
        logit_rows.extend(range(row0 + n - num_logits, row0 + n))
    return PaddedRows(token_ids, positions, slots, tables, logit_rows)


class StepGraphs:
    """The captured steps of one runner, by bucket, over static input buffers.

    `step(inputs)` is the runner's tensor function (StepInputs -> logits [rows, V]); `make_inputs`
    turns a bucket's static tensors into StepInputs. `run(bucket, rows)` copies a padded step into
    the bucket's buffers, replays (capturing first if needed) and returns the wanted logits rows.
    """

    def __init__(self, cfg: GraphConfig, capture: Capture, device: torch.device):
        self.cfg = cfg
        self.capture = capture
        self.device = device
        self._graphs: dict[Bucket, tuple[dict[str, torch.Tensor], Replay]] = {}
        self.captured = 0
        self.replays = 0
        self.full = False  # max_graphs reached: new buckets run eagerly

    def has_room(self, bucket: Bucket) -> bool:
        return bucket in self._graphs or len(self._graphs) < self.cfg.max_graphs

    def run(self, bucket: Bucket, rows: PaddedRows, step: Callable[[dict[str, torch.Tensor]], torch.Tensor]
            ) -> torch.Tensor:
        """-> logits [R, V] of the wanted rows (on the device)."""
        if bucket not in self._graphs:
            buffers = self._buffers(bucket)
            self._fill(buffers, rows)
            replay = self.capture(lambda: step(buffers))
            self._graphs[bucket] = (buffers, replay)
            self.captured += 1
            log.info("captured a step graph for %s (%d so far)", bucket, self.captured)
        buffers, replay = self._graphs[bucket]
        self._fill(buffers, rows)
        logits = replay()  # [batch*tokens, V]
        self.replays += 1
        return logits.index_select(0, torch.tensor(rows.logit_rows, dtype=torch.long, device=logits.device))

    def _buffers(self, bucket: Bucket) -> dict[str, torch.Tensor]:
        rows = bucket.batch * bucket.tokens

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        return {"token_ids": longs(rows), "positions": longs(rows), "slots": longs(rows),
                "block_tables": longs(bucket.batch, bucket.blocks)}

    def _fill(self, buffers: dict[str, torch.Tensor], rows: PaddedRows) -> None:
        for name in ("token_ids", "positions", "slots", "block_tables"):
            buffers[name].copy_(torch.tensor(getattr(rows, name), dtype=torch.long), non_blocking=True)


def cuda_capture(pool=None) -> Capture:
    """Capture with torch.cuda.CUDAGraph after two warm-up runs on a side stream (what torch's
    documentation asks for); every graph of a runner shares one memory `pool`."""
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], torch.Tensor]) -> Replay:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay
    return capture


def eager_capture(fn: Callable[[], torch.Tensor]) -> Replay:
    """A stand-in for `cuda_capture` off the GPU: "replaying" runs the step again on the same
    static buffers (tests, and `gpu_check --tiny`)."""
    return fn
