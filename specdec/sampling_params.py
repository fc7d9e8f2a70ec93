"""A request's sampling controls and its seeds: plain Python, no torch.

The client SDK, the command line and the orchestrator use these without importing torch (which
costs a second and a few hundred MB); the math over them is in specdec.sampling.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specdec.errors import InvalidArgument


@dataclass(frozen=True)
class SamplingParams:
    """Sampling controls for one model. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, prefix: str = "") -> "SamplingParams":
        """Raise InvalidArgument naming the offending parameter (e.g. `draft_temperature`)."""
        t, k, p = self.temperature, self.top_k, self.top_p
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidArgument(f"{prefix}temperature must be a finite number >= 0 (0 = greedy), got {t}")
        if not isinstance(k, (int, float)) or not math.isfinite(k) or int(k) != k or k < 0:
            raise InvalidArgument(f"{prefix}top_k must be an integer >= 0 (0 = off), got {k}")
        if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
            raise InvalidArgument(f"{prefix}top_p must be in (0, 1], got {p}")
        return self


def derive_seed(seed: int, *salt: int) -> int:
    """A reproducible 63-bit seed for a sub-stream (e.g. one draft call), from a request seed."""
    h = seed & 0xFFFF_FFFF_FFFF_FFFF
    for s in salt:
        h = (h * 6364136223846793005 + 1442695040888963407 + (s & 0xFFFF_FFFF_FFFF_FFFF)) & 0xFFFF_FFFF_FFFF_FFFF
        h ^= h >> 29
    return h & 0x7FFF_FFFF_FFFF_FFFF
