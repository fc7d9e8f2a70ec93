"""4-bit weight-only matrices for the paged runner's `int4` precision (CPU).

Each [in, out] weight is cut into groups of GROUP consecutive input rows per output column;
a group keeps 16 levels, w = (q - 8) * scale + zero with q in 0..15, scale and zero in bf16
(asymmetric min/max, the grid of GGUF's Q4_1: requantizing a model dequantized from a Q4_1
file finds its levels again, up to the bf16 rounding of scale and zero). Activations are
bf16; the matmul is torch's CPU int4 kernel (`hf_compat.int4_matmul`), which streams a
quarter of the bytes of bf16 and an eighth of fp32: a one-token step of the default model
costs 22.5 ms against 40.1 in fp32, one core (BENCHMARKS.md §6a).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import hf_compat

GROUP = 32
OUT_MULTIPLE = 16  # torch's CPU packing takes output features in multiples of 16


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor  # torch's packed CPU int4 layout of the codes [out, in]
    scales_zeros: torch.Tensor  # [in/group, out, 2] bf16: scale and zero of each group
    in_features: int
    out_features: int
    group: int = GROUP  # input rows per scale (torch's kernel takes 32, 64, 128 or 256)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int4Weight":
        """w [in, out] (any float dtype) -> 4-bit codes per group of GROUP input rows."""
        k, n = w.shape
        if k % GROUP or n % OUT_MULTIPLE:
            raise ValueError(f"int4 needs input features divisible by {GROUP} and output features by "
                             f"{OUT_MULTIPLE} (torch's packing), got [{k}, {n}]")
        groups = w.detach().float().t().reshape(n, k // GROUP, GROUP)  # [out, in/G, G]
        low, high = groups.amin(-1), groups.amax(-1)  # [out, in/G]
        scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)  # [out, in/G]
        codes = torch.round((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp_(0, 15)  # [out, in/G, G]
        zero = low + 8 * scale  # [out, in/G]: the value of code 8
        scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [in/G, out, 2]
        packed = hf_compat.int4_pack(codes.to(torch.int32).reshape(n, k))
        return cls(packed, scales_zeros, k, n)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, group: int
                   ) -> "Int4Weight":
        """A compressed-tensors int4 Linear as it is stored (no requantization): codes [out, in] in
        -8..7, scale [out, in/group], zero_point [out, in/group] in -8..7; w = (code - zero_point) * scale.
        Here w = (code + 8 - 8) * scale + zero with zero = -zero_point * scale: exact when the zero
        point is 0 (symmetric) and the scale is bf16, up to bf16's rounding of the zero otherwise."""
        n, k = codes.shape
        if k % group or n % OUT_MULTIPLE or group not in (32, 64, 128, 256):
            raise ValueError(f"int4 needs groups of 32, 64, 128 or 256 dividing the input features and output "
                             f"features divisible by {OUT_MULTIPLE}, got [{n}, {k}] in groups of {group}")
        scale = scale.float()  # [out, in/G]
        zero = -zero_point.float() * scale  # [out, in/G]
        scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)  # [in/G, out, 2]
        packed = hf_compat.int4_pack((codes.to(torch.int32) + 8).contiguous())  # [out, in] codes 0..15
        return cls(packed, scales_zeros, k, n, group)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] bf16."""
        return hf_compat.int4_matmul(x, self.packed, self.group, self.scales_zeros)

    def dequantize(self) -> torch.Tensor:
        """The [in, out] float32 matrix this stands for (tests)."""
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)  # [in, in]
        return self.matmul(eye).float()  # [in, out]

    def storages(self) -> list[torch.Tensor]:
        return [self.packed, self.scales_zeros]


@dataclass(frozen=True)
class Int8Weight:
    """An output head in 8 bits: each output row (one vocabulary entry) symmetric, w = code * scale,
    codes in -127..127, scale in bf16. Half the bytes of bf16: the int4 draft's one-token step
    reads its 49,152 x 576 head in 1.8 ms instead of 4.3; from about 8 rows bf16 is faster
    (paged_llama.SMALL_HEAD_ROWS)."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] bf16

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "Int8Weight":
        """w [in, out] (any float dtype) -> 8-bit codes per output row."""
        rows = w.detach().float().t()  # [out, in]
        scales = (rows.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        codes = torch.round(rows / scales.unsqueeze(1)).clamp_(-127, 127).to(torch.int8).contiguous()  # [out, in]
        return cls(codes, scales.to(torch.bfloat16))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] bf16."""
        return hf_compat.int8_matmul(x, self.codes, self.scales)

    def dequantize(self) -> torch.Tensor:
        """The [in, out] float32 matrix this stands for (tests)."""
        return (self.codes.float() * self.scales.float().unsqueeze(1)).t()  # [in, out]

    def storages(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]
