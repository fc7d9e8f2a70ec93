"""CUDA-graph bookkeeping on the CPU: buckets, padding, lazy capture and its limit, fallback.

The capture is injected: here a fake that counts captures and "replays" by running the step
eagerly on the bucket's static buffers, so the padded step's output is checked against the
unpadded one (tests/test_paged_llama.py runs the mixed-batch test with graphs on as well).
"""
from __future__ import annotations

import pytest
import torch

from specdec.serving.batch import SeqChunk
from specdec.serving.graphs import (Bucket, GraphConfig, block_widths, pad_rows, parse_sizes, pick_bucket)
from specdec.serving.paged_llama import PagedLlamaRunner
from test_paged_llama import VOCAB, tiny_model

CFG = GraphConfig(batches=(1, 2, 4, 8), tokens=(1, 2, 4, 8, 12), min_blocks=4, max_graphs=64)


def test_sizes_and_widths():
    assert parse_sizes("8, 1,4,2,4", "batches") == (1, 2, 4, 8)
    for bad in ("", "0,1", "a,2", "-1"):
        with pytest.raises(ValueError):
            parse_sizes(bad, "batches")
    assert block_widths(4, 40) == (4, 8, 16, 32, 40)
    assert block_widths(8, 8) == (8,)


@pytest.mark.parametrize("batch, tokens, blocks, bucket", [
    (1, 1, 1, Bucket(1, 1, 4)),  # a single decode
    (3, 9, 5, Bucket(4, 12, 8)),  # 3 verifies of k = 8 (9 rows), tables 5 wide
    (8, 1, 40, Bucket(8, 1, 40)),  # the widest table the pool allows
    (9, 1, 1, None),  # more sequences than the largest bucket
    (1, 13, 1, None),  # a prefill chunk: eager
    (1, 1, 41, None),  # wider than the widest table
])
def test_pick_bucket_takes_the_smallest_that_fits(batch, tokens, blocks, bucket):
    assert pick_bucket(CFG, 40, batch, tokens, blocks) == bucket


def test_pad_rows_puts_each_sequence_in_its_rows_and_the_rest_in_scratch():
    rows = pad_rows(Bucket(batch=3, tokens=4, blocks=3),
                    [([7, 8, 9], 5, [21, 22, 23], [4, 5], 3), ([6], 2, [9], [2], 1)], scratch_slot=99)
    assert rows.token_ids == [7, 8, 9, 0, 6, 0, 0, 0, 0, 0, 0, 0]
    assert rows.positions == [5, 6, 7, 0, 2, 0, 0, 0, 0, 0, 0, 0]
    assert rows.slots == [21, 22, 23, 99, 9, 99, 99, 99, 99, 99, 99, 99]
    assert rows.block_tables == [[4, 5, 0], [2, 0, 0], [0, 0, 0]]
    assert rows.logit_rows == [0, 1, 2, 4]


class CountingCapture:
    def __init__(self):
        self.captures = 0

    def __call__(self, fn):
        self.captures += 1
        return fn


def test_a_bucket_is_captured_once_replays_match_eager_and_the_limit_sends_the_rest_eager():
    model = tiny_model("llama")
    eager = PagedLlamaRunner.from_hf_model(model, num_blocks=40, block_size=4, max_seqs=8)
    graphed = PagedLlamaRunner.from_hf_model(model, num_blocks=40, block_size=4, max_seqs=8)
    capture = CountingCapture()
    graphed.enable_graphs(GraphConfig(batches=(1, 2, 4), tokens=(1, 4), min_blocks=4, max_graphs=2), capture)
    seqs = {}
    for r in (eager, graphed):
        seqs[id(r)] = [r.blocks.reserve(40) for _ in range(3)]
    prompts = [[1, 2, 3, 4, 5, 6], [9, 8, 7], [5, 5, 5, 5, 5, 5, 5, 5, 5]]

    def step(r, chunks):
        ids = seqs[id(r)]
        return r.forward([SeqChunk(ids[i], toks, start, n) for i, toks, start, n in chunks])

    # prefill (chunks of up to 9 tokens): no bucket holds them, eager
    for r in (eager, graphed):
        step(r, [(i, p, 0, 1) for i, p in enumerate(prompts)])
    assert capture.captures == 0
    # three decodes of 3 sequences (bucket 4 x 1), then verifies of 3 tokens (bucket 4 x 4)
    lengths = [len(p) for p in prompts]
    for round_ in range(3):
        chunks = [(i, [10 + round_ + i], lengths[i] + round_, 1) for i in range(3)]
        for a, b in zip(step(eager, chunks), step(graphed, chunks)):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    lengths = [n + 3 for n in lengths]
    chunks = [(i, [20, 21, 22], lengths[i], 3) for i in range(3)]
    for a, b in zip(step(eager, chunks), step(graphed, chunks)):
        assert b.shape == (3, VOCAB)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert capture.captures == 2 and graphed.graphs.replays == 4
    # a third shape (one sequence, one token): over max_graphs, so it runs eagerly
    for a, b in zip(step(eager, [(0, [3], lengths[0] + 3, 1)]), step(graphed, [(0, [3], lengths[0] + 3, 1)])):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert capture.captures == 2 and graphed.graphs.replays == 4
    # the scratch slot is outside every sequence's blocks, and padded rows wrote only there
    owned = {b for s in seqs[id(graphed)] for b in graphed.blocks.table(s)}
    assert graphed.scratch_slot // 4 not in owned


# -- the KV pool sized from a share of GPU memory ------------------------------------------------------

def test_pool_from_a_memory_share_is_what_is_left_after_weights_and_reserve_in_whole_blocks():
    from specdec.devices import kv_pool_tokens_for_memory

    gib = 2**30
    # a 7B bf16 target (15.2 GB) in 0.6 of an H200's 141 GB, 10% kept: KV of 128 KiB per token
    tokens = kv_pool_tokens_for_memory(int(0.6 * 141 * gib), int(15.2e9), 128 * 1024, 0.1, 16)
    assert tokens % 16 == 0
    left = 0.6 * 141 * gib * 0.9 - 15.2e9
    assert left - 16 * 128 * 1024 < tokens * 128 * 1024 <= left
    with pytest.raises(ValueError, match="raise gpu_memory_fraction"):
        kv_pool_tokens_for_memory(16 * gib, 15 * gib, 128 * 1024, 0.1, 16)
    with pytest.raises(ValueError, match="not set"):
        kv_pool_tokens_for_memory(0, 1, 1, 0.1, 16)


def test_a_runner_loaded_with_pool_tokens_0_sizes_its_pool_from_the_share(tiny_models):
    share = 64 * 2**20
    r = PagedLlamaRunner.load(str(tiny_models["target"]), "float32", "cpu", pool_tokens=0, block_size=16,
                              memory_share_bytes=share, activation_reserve=0.25)
    weights = r.facts.weight_bytes
    pool = r.blocks.capacity_tokens * r.facts.kv_bytes_per_token
    assert 0.75 * share - weights - 16 * r.facts.kv_bytes_per_token < pool <= 0.75 * share - weights


# -- the draft engine chosen for the device the draft runs on -----------------------------------------

def test_draft_engine_auto_is_resolved_for_the_drafts_own_device(monkeypatch):
    from specdec.config import DraftConfig
    from specdec.devices import resolve_draft_engine

    assert DraftConfig().engine == "auto"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert resolve_draft_engine("auto", "cpu") == "llamacpp"  # torch's int4 step does not pay without AVX-512
    assert resolve_draft_engine("auto", "cuda:0") == "torch"  # a GPU host's draft on its GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_draft_engine("auto", "cpu") == "llamacpp"  # ... and on that host's AVX2 CPU: judged by the CPU
    assert resolve_draft_engine("auto", "auto") == "torch"
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert resolve_draft_engine("auto", "cpu") == "torch"
    for explicit in ("torch", "llamacpp", "ngram"):
        assert resolve_draft_engine(explicit, "cpu") == explicit
