"""Wire cost of a verify round: sparse q~ keeps a k=16 round at a few KB even for a 262k vocabulary."""
from __future__ import annotations

import torch

from specdec.sampling import draft_token
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2, target_pb2


def round_bytes(vocab: int, k: int, params: SamplingParams, max_support: int) -> int:
    g = torch.Generator().manual_seed(0)
    dists, toks = [], []
    for _ in range(k):
        logits = torch.randn(vocab, generator=g) * 3  # [V]
        tok, ids, q = draft_token(logits, params, max_support, g)
        toks.append(tok)
        dists.append(common_pb2.SparseDistribution(token_ids=ids.tolist(), probs=q.tolist()))
    req = target_pb2.TargetRequest(verify=target_pb2.TargetVerify(draft_token_ids=toks, draft_dists=dists))
    return req.ByteSize()


def test_k16_round_is_a_few_kb_for_262k_vocab():
    sampled = round_bytes(262_144, 16, SamplingParams(temperature=1.0), max_support=64)
    greedy = round_bytes(262_144, 16, SamplingParams(), max_support=64)
    dense = 16 * 262_144 * 4
    assert sampled <= 16 * 64 * 9 + 256, sampled  # <= 9 bytes per (id, prob) entry
    assert sampled < 10_000
    assert greedy < 400  # one-hot: the token id and probability 1.0 per position
    assert dense / sampled > 1000
