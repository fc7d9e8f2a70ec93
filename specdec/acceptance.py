"""The speculative acceptance rule (Leviathan et al. 2023; Chen et al. 2023) as one pure function.

Output tokens of a round = accepted tokens + (one recovered token | one bonus token):
- accepted: draft token x_i kept with probability min(1, p_i(x_i) / q~_i(x_i));
- recovered: at the first rejection i, a token drawn from norm(max(0, p_i - q~_i));
- bonus: when all k drafts are accepted, a token drawn from p_k.
Greedy target (p one-hot), greedy draft (q~ one-hot) and sampled draft are all special
cases of this function. The emitted tokens follow exactly the target's distribution p,
for any q~, as long as each draft token was really sampled from the q~ passed in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import sample_index


@dataclass(frozen=True)
class VerifyOutcome:
    num_accepted: int  # accepted draft tokens, 0..k
    next_token: int  # recovered token, or bonus token when num_accepted == k

    def output_tokens(self, draft_token_ids: list[int]) -> list[int]:
        return list(draft_token_ids[: self.num_accepted]) + [self.next_token]


def verify_drafts(
    draft_token_ids: torch.Tensor,  # [k] int64
    draft_probs: torch.Tensor,  # [k, V] float32, q~ per draft position (dense)
    target_probs: torch.Tensor,  # [k + 1, V] float32, p per position (last row for the bonus)
    generator: torch.Generator | None,
) -> VerifyOutcome:
    k = int(draft_token_ids.numel())
    assert target_probs.shape[0] == k + 1, (target_probs.shape, k)
    if k:
        rows = torch.arange(k)
        p_x = target_probs[rows, draft_token_ids]  # [k]
        q_x = draft_probs[rows, draft_token_ids]  # [k]
        u = torch.rand(k, generator=generator)  # [k]
        # u < p/q, written without division; q_x > 0 because x was drawn from q~.
        accepted = (u * q_x < p_x) & (q_x > 0)  # [k] bool
        rejected = torch.nonzero(~accepted)
        n = int(rejected[0]) if rejected.numel() else k
    else:
        n = 0
    if n < k:
        residual = (target_probs[n] - draft_probs[n]).clamp_min(0.0)  # [V]
        total = residual.sum()
        # p == q~ leaves no residual mass; then a rejection had probability 0 (rounding only).
        dist = residual / total if total > 0 else target_probs[n]
        return VerifyOutcome(n, sample_index(dist, generator))
    return VerifyOutcome(k, sample_index(target_probs[k], generator))
