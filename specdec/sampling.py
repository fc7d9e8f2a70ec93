"""Sampling math: pure functions from logits to the processed distribution a token is drawn from.

Vocabulary used across specdec:
- p: the target's processed distribution (after its temperature, top-k, top-p).
- q~ ("q tilde"): the draft's processed distribution, truncated to at most `max_support`
  tokens and renormalised *before* sampling, so the token really comes from what is sent.
Greedy (temperature 0) is the one-hot distribution on the argmax: every mode of the
speculative step is then a special case of the same rejection-sampling function.
"""
from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [n, V] (any float dtype) -> probs: [n, V] float32, rows sum to 1.

    Applies temperature, then top-k, then top-p (nucleus, always keeping the top token).
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)  # [n, V]
        out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        return out
    # shift by the row max first: a tiny temperature then saturates instead of overflowing
    x = (logits - logits.amax(dim=-1, keepdim=True)) / params.temperature  # [n, V]
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [n, V]
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)  # [n, V]
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each entry
        drop_sorted = before >= params.top_p  # keeps the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


# Draft tokens in the far tail (together at most this much mass) are dropped before sampling:
# it keeps low-temperature rounds at a few hundred bytes and costs at most this much acceptance.
DRAFT_TAIL_MASS = 1e-5


def truncate_support(probs: torch.Tensor, max_support: int,
                     tail_mass: float = DRAFT_TAIL_MASS) -> tuple[torch.Tensor, torch.Tensor]:
    """probs: [V] -> (token_ids [m] int64, probs [m] float32), m <= max_support, renormalised.

    Keeps the most likely tokens: at most `max_support` of them (0 = no cap), and no more
    than needed to cover 1 - tail_mass of the mass.
    """
    nonzero = int((probs > 0).sum())
    m = max(1, min(nonzero, max_support)) if max_support > 0 else max(1, nonzero)
    top = torch.topk(probs, m)
    vals = top.values.float()  # [m], descending
    if tail_mass > 0 and m > 1:
        covered = torch.cumsum(vals, 0) / probs.sum()
        m = min(m, int((covered < 1.0 - tail_mass).sum()) + 1)
        vals = vals[:m]
    return top.indices[:m], vals / vals.sum()


def sample_index(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [m] (sums to 1) -> one index drawn from it."""
    if probs.numel() == 1:
        return 0
    return int(torch.multinomial(probs, 1, generator=generator))


def draft_token(logits: torch.Tensor, params: SamplingParams, max_support: int,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor, torch.Tensor]:
    """One draft step. logits: [V] -> (token, support ids [m], q~ [m]).

    The token is sampled from exactly the returned sparse q~.
    """
    if params.greedy:
        tok = int(logits.argmax())
        return tok, torch.tensor([tok]), torch.ones(1)
    probs = processed_probs(logits.unsqueeze(0), params)[0]  # [V]
    ids, q = truncate_support(probs, max_support)  # [m], [m]
    return int(ids[sample_index(q, generator)]), ids, q


def dense_from_sparse(token_ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(ids [m], probs [m]) -> dense [V] float32."""
    out = torch.zeros(vocab_size, dtype=torch.float32)
    out[token_ids.long()] = probs.float()
    return out


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


