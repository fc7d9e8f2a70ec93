"""specdec's own CPU kernels (csrc/), compiled for the machine they run on, called through ctypes.

- `PackedF32Weight` (csrc/skinny_gemm.c, AVX2 or AVX-512): float32 matmuls. A verify of k + 1
  tokens is a matmul of a few rows against every weight of the target; torch's fp32 matmul (MKL)
  is tuned for big matrices: on the AMD EPYC VM measured, the default target's decoder matrices
  cost 46.8 ms for 9 rows and 17.4 for one, where this kernel costs 20.6 and 12.4.
- `CodesF32Weight` (csrc/skinny_dequant.c, AVX-512): the same float32 arithmetic over a matrix
  whose every value is a GGUF's Q4_1 or Q8_0 value, read as those codes and dequantized in
  registers (exactly): `PackedF32Weight`'s results bit for bit from a sixth of the bytes. The
  default target's one-token step costs 16.4 ms against 29.9 (BENCHMARKS.md §6s).
- `PackedInt4Weight`, `PackedInt8Weight`, `PackedQ8Weight` (csrc/int4_gemm.c, AVX-512 VNNI): the
  int4 precision's 4-bit layers and 8-bit output head (one scale per row, or GGUF's Q8_0 blocks)
  against int8 activations: 7.5 ms against torch's int4 13.8 for 9 rows, and the int8 head 0.83
  ms against 1.82 for one row; or against 16-bit activations, where a draft of the target's
  own weights agrees with it (BENCHMARKS.md §6q).
- `FusedInt4Layers` (csrc/fused_int4.c, AVX-512 VNNI): the int4 draft's decoder layers in one
  call for small steps, with `paged_attention` (csrc/paged_attention.c): each row's attention
  over its own sequence's keys in the paged pool, no gather, no mask. The same kernel, called
  alone, attends for every other CPU step (paged_llama.attends_in_c).
(Numbers: BENCHMARKS.md §6o, scripts/cpu_kernels_probe.py; §6p, scripts/step_context_probe.py.)

Exactness: in skinny_gemm.c each output is one chain of fused multiply-adds over the inputs in
order, so a row's result does not depend on how many rows share the matmul: a verify's matmuls
give one-token decodes' bits (tests/test_cpu_gemm.py).

Each C file is compiled (`cc -O3 -march=native`, about a second) once per CPU into
$SPECDEC_CACHE_DIR/kernels/, the first time a model that uses it loads with
`cpu_kernels = "specdec"`. Where it cannot be built (no C compiler, a CPU without the
instructions, not x86) the model uses torch's kernels and the log says why. The kernels are
single-threaded: each service runs its model on its own core (`num_threads = 1`, the default).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from specdec import models
from specdec.serving import int4

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
PANEL = 16  # columns per packed panel (skinny_gemm.c's PANEL)
# ModelServiceConfig.cpu_kernels: specdec's (float32 matrices on a GGUF grid read as their codes), specdec's
# with every float32 matrix in float32 panels (the same results, more bytes: for comparison), or torch's
CPU_KERNELS = ("specdec", "specdec-f32", "torch")
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model name and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return "".join(lines)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _build(name: str, needs: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """csrc/<name>.c built for this machine (on first use, then cached), or None with the reason
    logged once. needs: the /proc/cpuinfo flags the kernel is written for."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        log.info("cpu_kernels: specdec's %s kernel is for x86-64; using torch's", name)
        return None
    flags = set(_cpu_signature().split())
    missing = [f for f in needs if f not in flags]
    if missing:
        log.info("cpu_kernels: this CPU lacks %s for specdec's %s kernel; using torch's",
                 ", ".join(missing), name)
        return None
    cc = _compiler()
    if cc is None:
        log.warning("cpu_kernels: no C compiler (cc) to build specdec's %s kernel; using torch's", name)
        return None
    source = CSRC / f"{name}.c"
    # every file in csrc/: a kernel may #include another
    sources = b"".join(f.read_bytes() for f in sorted(source.parent.glob("*.c")))
    key = hashlib.sha256(sources + " ".join((cc, *CFLAGS)).encode() + _cpu_signature().encode())
    path = models.cache_dir() / "kernels" / f"{name}-{key.hexdigest()[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
        os.close(fd)
        try:
            done = subprocess.run([cc, *CFLAGS, str(source), "-o", tmp], capture_output=True, text=True)
            if done.returncode != 0:
                log.warning("cpu_kernels: specdec's %s kernel does not build for this CPU (%s); using torch's:\n%s",
                            name, cc, done.stderr.strip()[-2000:])
                return None
            os.replace(tmp, path)  # atomic: the target and draft services may build it at once
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    log.info("cpu_kernels: specdec's %s kernel from %s", name, path)
    return ctypes.CDLL(str(path))


@functools.cache
def skinny() -> ctypes.CDLL | None:
    """csrc/skinny_gemm.c (float32 weights; AVX2 with FMA, or AVX-512)."""
    lib = _build("skinny_gemm", ("avx2", "fma"))
    if lib is not None:
        lib.skinny_gemm_f32.restype = None
        lib.skinny_gemm_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                        ctypes.c_long, ctypes.c_void_p]
    return lib


@functools.cache
def dequant() -> ctypes.CDLL | None:
    """csrc/skinny_dequant.c (float32 arithmetic over Q4_1 / Q8_0 codes; AVX-512), which includes
    skinny_gemm.c."""
    lib = _build("skinny_dequant", ("avx512f", "f16c"))
    if lib is not None:
        lib.skinny_gemm_dequant.restype = None
        lib.skinny_gemm_dequant.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long,
                                            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                            ctypes.c_void_p]
        lib.skinny_dequant_scratch_floats.restype = ctypes.c_long
        lib.skinny_dequant_scratch_floats.argtypes = [ctypes.c_long, ctypes.c_long]
    return lib


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    block_size: int, seq: torch.Tensor, pos: torch.Tensor, window: int | None, scale: float,
                    scratch: torch.Tensor) -> torch.Tensor:
    """Causal attention of each query row to its own sequence's keys 0..pos (or the last `window`).

    q [T, Hq, D] (rows may be strided, heads and D contiguous), k_cache / v_cache [S, Hkv, D]
    holding the step's keys, block_tables [B, MB] int64, seq / pos [T] int64 (each row's
    sequence and position), scratch from attention_scratch -> [T, Hq*D] in q's dtype."""
    lib = lowbit()
    t, hq, d = q.shape
    hkv = k_cache.shape[1]
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty(t, hq * d, dtype=q.dtype)  # [T, Hq*D]
    bf16 = int(q.dtype == torch.bfloat16)
    rc = lib.paged_attention(q.data_ptr(), q.stride(0), bf16, k_cache.data_ptr(), v_cache.data_ptr(),
                             int(k_cache.dtype == torch.bfloat16), block_tables.data_ptr(), block_tables.shape[1],
                             block_size, seq.data_ptr(), pos.data_ptr(), t, hq, hkv, d, window or 0, scale,
                             out.data_ptr(), bf16, scratch.data_ptr())
    if rc:
        raise ValueError(f"paged_attention does not take Hq={hq}, Hkv={hkv}, D={d}")
    return out


def attention_scratch(max_keys: int, heads: int) -> torch.Tensor:
    """The float32 scratch paged_attention needs for rows of at most max_keys keys, `heads` query heads."""
    return torch.empty(lowbit().paged_attention_scratch_floats(max_keys, heads), dtype=torch.float32)


def attention_takes(head_dim: int, group: int) -> bool:
    """Whether paged_attention takes these heads: D a multiple of 16 up to 256, G <= 16."""
    return head_dim % 16 == 0 and head_dim <= 256 and group <= 16


class _FusedLayer(ctypes.Structure):  # fused_int4.c's fused_layer
    _fields_ = [("qkv_codes", ctypes.c_void_p), ("qkv_scales", ctypes.c_void_p), ("o_codes", ctypes.c_void_p),
                ("o_scales", ctypes.c_void_p), ("gate_up_codes", ctypes.c_void_p), ("gate_up_scales", ctypes.c_void_p),
                ("down_codes", ctypes.c_void_p), ("down_scales", ctypes.c_void_p), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("window", ctypes.c_long)]


class _FusedModel(ctypes.Structure):  # fused_int4.c's fused_model
    _fields_ = [("num_layers", ctypes.c_long), ("hidden", ctypes.c_long), ("num_heads", ctypes.c_long),
                ("num_kv_heads", ctypes.c_long), ("head_dim", ctypes.c_long), ("intermediate", ctypes.c_long),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("block_size", ctypes.c_long), ("cache_bf16", ctypes.c_int), ("xbits", ctypes.c_int)]


@functools.cache
def lowbit() -> ctypes.CDLL | None:
    """The AVX-512 VNNI kernels, one library: csrc/fused_int4.c (the int4 precision's decoder layers
    in one call), which includes int4_gemm.c (4- and 8-bit weights against 8- or 16-bit activations) and
    paged_attention.c."""
    lib = _build("fused_int4", ("avx512f", "avx512bw", "avx512_vnni"))
    if lib is not None:
        lib.lowbit_gemm.restype = ctypes.c_int
        lib.lowbit_gemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long,
                                    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int,
                                    ctypes.c_void_p]
        lib.lowbit_scratch_bytes.restype = ctypes.c_long
        lib.lowbit_scratch_bytes.argtypes = [ctypes.c_long, ctypes.c_long]
        lib.paged_attention.restype = ctypes.c_int
        lib.paged_attention.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                        ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long,
                                        ctypes.c_long, ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
        lib.paged_attention_scratch_floats.restype = ctypes.c_long
        lib.paged_attention_scratch_floats.argtypes = [ctypes.c_long, ctypes.c_long]
        lib.fused_scratch_bytes.restype = ctypes.c_long
        lib.fused_scratch_bytes.argtypes = [ctypes.POINTER(_FusedModel), ctypes.c_long, ctypes.c_long]
        lib.fused_layers.restype = ctypes.c_int
        lib.fused_layers.argtypes = [ctypes.POINTER(_FusedModel), ctypes.POINTER(_FusedLayer), ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_long, ctypes.c_void_p]
    return lib


@dataclass
class FusedLayerWeights:
    """One decoder layer as fused_int4.c takes it: a Llama layer without biases or q/k norms."""

    qkv: "PackedInt4Weight"
    o: "PackedInt4Weight"
    gate_up: "PackedInt4Weight"
    down: "PackedInt4Weight"
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    k_cache: torch.Tensor  # [S, Hkv, D] bfloat16 or float32
    v_cache: torch.Tensor  # [S, Hkv, D]
    window: int | None


class FusedInt4Layers:
    """Every decoder layer of an int4 model in one C call (csrc/fused_int4.c), for small steps:
    the same weights and pool as the torch path, float32 activations between the matmuls."""

    def __init__(self, layers: list[FusedLayerWeights], cos: torch.Tensor, sin: torch.Tensor, *, hidden: int,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float,
                 block_size: int, max_rows: int):
        self.lib = lowbit()
        self.max_rows = max_rows  # the caller's choice: steps of at most this many tokens come here
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.keep = [f32(cos), f32(sin)]  # [max_context, D] each; the structs point into these tensors
        structs = []
        for lw in layers:
            norms = [f32(lw.input_norm), f32(lw.post_norm)]
            self.keep += norms
            structs.append(_FusedLayer(lw.qkv.codes.data_ptr(), lw.qkv.scales.data_ptr(), lw.o.codes.data_ptr(),
                                       lw.o.scales.data_ptr(), lw.gate_up.codes.data_ptr(),
                                       lw.gate_up.scales.data_ptr(), lw.down.codes.data_ptr(),
                                       lw.down.scales.data_ptr(), norms[0].data_ptr(), norms[1].data_ptr(),
                                       lw.k_cache.data_ptr(), lw.v_cache.data_ptr(), lw.window or 0))
        self.layer_refs = layers
        self.layers = (_FusedLayer * len(structs))(*structs)
        self.model = _FusedModel(len(structs), hidden, num_heads, num_kv_heads, head_dim, intermediate, eps, scale,
                                 self.keep[0].data_ptr(), self.keep[1].data_ptr(), block_size,
                                 int(layers[0].k_cache.dtype == torch.bfloat16), layers[0].qkv.act_bits)

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor,
            block_tables: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] float32 (the embedded tokens) -> [T, hidden] after every layer (in place);
        positions, slots, seq [T] int64 (each token's position, pool slot, sequence), block_tables
        [B, MB] int64. Writes the tokens' K/V into the pool."""
        t = x.shape[0]
        tables = block_tables.contiguous()
        max_keys = int(positions.max()) + 1
        scratch = torch.empty(self.lib.fused_scratch_bytes(self.model, t, max_keys), dtype=torch.uint8)
        rc = self.lib.fused_layers(self.model, self.layers, x.data_ptr(), t, positions.data_ptr(), slots.data_ptr(),
                                   seq.data_ptr(), tables.data_ptr(), tables.shape[1], scratch.data_ptr())
        if rc:
            raise ValueError("fused_int4 does not take this model's shapes")
        return x


def _float32_matmul(x: torch.Tensor, out: int, run: Callable[[torch.Tensor, int, torch.Tensor], None]
                    ) -> torch.Tensor:
    """x [T, in] float32 -> y [T, out] float32 filled by run(x, T, y), a kernel call (none for T = 0)."""
    x = x.contiguous()
    rows = x.shape[0]
    y = torch.empty(rows, out, dtype=torch.float32)  # [T, out]
    if rows:
        run(x, rows, y)
    return y


@dataclass(frozen=True)
class PackedF32Weight:
    """A float32 [in, out] weight packed for skinny_gemm.c: panels of PANEL output columns,
    each [in, PANEL] contiguous. The same bytes as the dense matrix, another order."""

    panels: torch.Tensor  # [out/PANEL, in, PANEL] float32

    @classmethod
    def pack(cls, w: torch.Tensor) -> "PackedF32Weight":
        """w [in, out] float32 on the CPU, out % PANEL == 0."""
        k, n = w.shape
        if w.dtype != torch.float32 or w.device.type != "cpu" or n % PANEL:
            raise ValueError(f"PackedF32Weight takes a float32 CPU matrix with a multiple of {PANEL} columns, "
                             f"got {w.dtype} on {w.device}, [{k}, {n}]")
        return cls(w.detach().view(k, n // PANEL, PANEL).permute(1, 0, 2).contiguous())

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    @property
    def out_features(self) -> int:
        return self.panels.shape[0] * PANEL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        lib = skinny()
        return _float32_matmul(x, self.out_features, lambda x, rows, y: lib.skinny_gemm_f32(
            x.data_ptr(), rows, self.in_features, self.panels.data_ptr(), self.out_features, y.data_ptr()))

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the matrix's columns [T, in] (a tied output head's embedding rows)."""
        return self.panels[ids // PANEL, :, ids % PANEL]  # [T, in]

    def dense(self) -> torch.Tensor:
        """The [in, out] matrix as torch lays it out (tests)."""
        return self.panels.permute(1, 0, 2).reshape(self.in_features, self.out_features)

    def storages(self) -> list[torch.Tensor]:
        return [self.panels]


# inputs per group: the 4-bit weights' scales (as torch's Int4Weight), and the activations'
# scales (int4_gemm.c's G)
GROUP = int4.GROUP
# int4_gemm.c's weight formats
LOWBIT_Q4_1, LOWBIT_I8_ROW, LOWBIT_Q8_0 = 4, 8, 9
# the activations of the 4-bit matmuls and the Q8_0 head: int8 (llama.cpp's Q8_1: fastest) or int16
# (two vpdpbusd a dot product: an int4 copy of a Q4_1 model then agrees with its float32 self,
# BENCHMARKS §6q). ModelServiceConfig.int4_activations
ACTIVATION_BITS = (8, 16)


def _lowbit_matmul(fmt: int, xbits: int, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out: int
                   ) -> torch.Tensor:
    """x [T, in] float32 or bfloat16 -> [T, out] in x's dtype (int4_gemm.c)."""
    lib = lowbit()
    x = x.contiguous()
    rows, k = x.shape
    y = torch.empty(rows, out, dtype=x.dtype)  # [T, out]
    if rows:
        scratch = torch.empty(lib.lowbit_scratch_bytes(rows, k), dtype=torch.uint8)
        bf16 = int(x.dtype == torch.bfloat16)
        if lib.lowbit_gemm(fmt, xbits, x.data_ptr(), bf16, rows, k, codes.data_ptr(), scales.data_ptr(), out,
                           y.data_ptr(), bf16, scratch.data_ptr()):
            raise ValueError(f"int4_gemm.c has no kernel for weight format {fmt} with {xbits}-bit activations")
    return y


def _check_bits(act_bits: int) -> None:
    if act_bits not in ACTIVATION_BITS:
        raise ValueError(f"activation bits must be one of {ACTIVATION_BITS}, got {act_bits!r}")


def _check_lowbit(w: torch.Tensor, kind: str) -> None:
    k, n = w.shape
    if k % GROUP or n % PANEL:
        raise ValueError(f"{kind} needs input features divisible by {GROUP} and output features by {PANEL}, "
                         f"got [{k}, {n}]")


@dataclass(frozen=True)
class PackedInt4Weight:
    """A [in, out] weight on the Q4_1 grid for int4_gemm.c: per group of GROUP input rows and per
    output column, w = d * q + lo with q in 0..15 (d and lo in float16 as in a Q4_1 GGUF, the
    group's min/max range in 15 steps). Against int8 or int16 activations (act_bits: each row's
    groups of GROUP scaled to +-127 or +-32767). A model dequantized from a Q4_1 GGUF gets its own
    codes and scales back (tests/test_cpu_gemm.py)."""

    codes: torch.Tensor  # [out/16, in/8, 64] uint8: two 4-bit codes a byte (int4_gemm.c's layout)
    scales: torch.Tensor  # [out/16, in/GROUP, 2, 16] float16: d, then lo, of each group's 16 outputs
    in_features: int
    out_features: int
    act_bits: int = 8

    @classmethod
    def quantize(cls, w: torch.Tensor, act_bits: int = 8, exact: bool = False) -> "PackedInt4Weight | None":
        """w [in, out] (any float dtype) -> 4-bit codes per group of GROUP input rows. exact: None
        unless the codes give back every value of w (float32) bit for bit, as `columns` computes
        them (d * q is exact in float32, so d * q + lo rounds once, as the kernels' FMA does)."""
        _check_lowbit(w, "PackedInt4Weight")
        _check_bits(act_bits)
        k, n = w.shape
        p, ng = n // PANEL, k // GROUP
        groups = w.detach().float().t().reshape(n, ng, GROUP)  # [out, in/G, G]
        low, high = torch.aminmax(groups, dim=-1)  # [out, in/G] each
        if max(float(low.abs().max()), float(high.abs().max())) > torch.finfo(torch.float16).max:
            raise ValueError("PackedInt4Weight keeps its scales in float16: weights beyond +-65504 do not fit")
        d = ((high - low) / 15).half()  # [out, in/G]
        low = low.half()  # [out, in/G]
        step = d.float().clamp(min=torch.finfo(torch.float32).tiny)  # [out, in/G]
        q = torch.round((groups - low.float().unsqueeze(-1)) / step.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)  # [out, in/G, G]
        if exact and not torch.equal(q.float() * d.float().unsqueeze(-1) + low.float().unsqueeze(-1), groups):
            return None
        halves = q.view(p, PANEL, k // 8, 2, 4)  # [out/16, 16, in/8, 2, 4]: inputs 8b+t (low) and 8b+4+t (high)
        codes = (halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()  # [out/16, in/8, 16, 4]
        scales = torch.stack([d, low], -1).view(p, PANEL, ng, 2).permute(0, 2, 3, 1).contiguous()  # [out/16, in/G, 2, 16]
        return cls(codes.view(p, k // 8, 64), scales, k, n, act_bits)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 or bfloat16 -> [T, out], the same dtype."""
        return _lowbit_matmul(LOWBIT_Q4_1, self.act_bits, x, self.codes, self.scales, self.out_features)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the matrix's columns [T, in] in float32 (a tied output head's embedding rows)."""
        t = ids.shape[0]
        b = self.codes.view(self.out_features // PANEL, -1, PANEL, 4)[ids // PANEL, :, ids % PANEL]  # [T, in/8, 4]
        q = torch.stack([b & 15, b >> 4], 2).reshape(t, -1, GROUP).float()  # [T, in/G, G]
        d, lo = (self.scales[ids // PANEL, :, i, ids % PANEL].float() for i in (0, 1))  # [T, in/G] each
        return (q * d.unsqueeze(-1) + lo.unsqueeze(-1)).view(t, -1)  # [T, in]

    def dense(self) -> torch.Tensor:
        """The [in, out] float32 matrix the codes stand for (tests)."""
        return self.columns(torch.arange(self.out_features)).t()  # [in, out]

    def storages(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


@dataclass(frozen=True)
class PackedInt8Weight:
    """An output head in 8 bits for int4_gemm.c: per output column, w = s * c with c in -127..127
    (stored c + 128), against int8 activations. Half the bytes of bf16."""

    codes: torch.Tensor  # [out/16, in/4, 16, 4] uint8: c + 128
    scales: torch.Tensor  # [out] float32

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 4

    @property
    def out_features(self) -> int:
        return self.scales.shape[0]

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "PackedInt8Weight":
        """w [in, out] (any float dtype) -> 8-bit codes per output column."""
        _check_lowbit(w, "PackedInt8Weight")
        k, n = w.shape
        cols = w.detach().float().t()  # [out, in]
        s = (cols.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [out]
        c = torch.round(cols / s.unsqueeze(1)).clamp_(-127, 127).to(torch.int16) + 128  # [out, in]
        codes = c.to(torch.uint8).view(n // PANEL, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
        return cls(codes, s.contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 or bfloat16 -> [T, out], the same dtype."""
        return _lowbit_matmul(LOWBIT_I8_ROW, 8, x, self.codes, self.scales, self.out_features)

    def dense(self) -> torch.Tensor:
        """The [in, out] float32 matrix the codes stand for (tests)."""
        c = self.codes.permute(0, 2, 1, 3).reshape(self.out_features, self.in_features).float() - 128  # [out, in]
        return (c * self.scales.unsqueeze(1)).t()

    def storages(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


@dataclass(frozen=True)
class PackedQ8Weight:
    """An output head as GGUF's Q8_0 keeps it, for int4_gemm.c: per group of GROUP input rows and
    per output column, w = d * c with c in -127..127 (stored c + 128) and d in float16, against
    int8 or int16 activations. The bytes of PackedInt8Weight; a head dequantized from a Q8_0 GGUF
    (the shipped SmolLM2's) gets its own codes and scales back, where one scale per output rounds
    every weight again."""

    codes: torch.Tensor  # [out/16, in/4, 16, 4] uint8: c + 128 (PackedInt8Weight's layout)
    scales: torch.Tensor  # [out/16, in/GROUP, 16] float16: d of each group's 16 outputs
    act_bits: int = 8

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 4

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * PANEL

    @classmethod
    def quantize(cls, w: torch.Tensor, act_bits: int = 8, exact: bool = False) -> "PackedQ8Weight | None":
        """w [in, out] (any float dtype) -> 8-bit codes per group of GROUP input rows and output.
        exact: None unless the codes give back every value of w (float32) bit for bit, as
        `columns` computes them (d * c is exact in float32)."""
        _check_lowbit(w, "PackedQ8Weight")
        _check_bits(act_bits)
        k, n = w.shape
        p, ng = n // PANEL, k // GROUP
        groups = w.detach().float().t().reshape(n, ng, GROUP)  # [out, in/G, G]
        amax = groups.abs().amax(-1)  # [out, in/G]
        if float(amax.max()) > torch.finfo(torch.float16).max:
            raise ValueError("PackedQ8Weight keeps its scales in float16: weights beyond +-65504 do not fit")
        d = (amax / 127).half()  # [out, in/G]
        step = d.float().clamp(min=torch.finfo(torch.float32).tiny)  # [out, in/G]
        c = torch.round(groups / step.unsqueeze(-1)).clamp_(-127, 127)  # [out, in/G, G] float32
        if exact and not torch.equal(c * d.float().unsqueeze(-1), groups):
            return None
        c = c.to(torch.int16) + 128  # [out, in/G, G]
        codes = c.to(torch.uint8).view(p, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()  # [out/16, in/4, 16, 4]
        scales = d.view(p, PANEL, ng).permute(0, 2, 1).contiguous()  # [out/16, in/G, 16]
        return cls(codes, scales, act_bits)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 or bfloat16 -> [T, out], the same dtype."""
        return _lowbit_matmul(LOWBIT_Q8_0, self.act_bits, x, self.codes, self.scales, self.out_features)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the matrix's columns [T, in] in float32 (a tied output head's embedding rows)."""
        t = ids.shape[0]
        c = self.codes[ids // PANEL, :, ids % PANEL].reshape(t, -1, GROUP).float() - 128  # [T, in/G, G]
        d = self.scales[ids // PANEL, :, ids % PANEL].float()  # [T, in/G]
        return (c * d.unsqueeze(-1)).view(t, -1)  # [T, in]

    def dense(self) -> torch.Tensor:
        """The [in, out] float32 matrix the codes stand for (tests)."""
        return self.columns(torch.arange(self.out_features)).t()  # [in, out]

    def storages(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


@dataclass(frozen=True)
class CodesF32Weight:
    """A float32 [in, out] weight every value of which lies on a GGUF grid, kept as those codes:
    Q4_1 (`PackedInt4Weight`, a decoder layer of a model dequantized from a Q4_1 file) or Q8_0
    (`PackedQ8Weight`, its output head). skinny_dequant.c dequantizes them in registers to the
    same float32 values (exactly) and runs skinny_gemm.c's chains: `PackedF32Weight`'s results
    bit for bit, reading 5 bits a weight instead of 32 (Q8_0: 8.5)."""

    codes: PackedInt4Weight | PackedQ8Weight

    @classmethod
    def of(cls, w: torch.Tensor) -> "CodesF32Weight | None":
        """w [in, out] float32 -> its Q4_1 codes, else its Q8_0 codes, if they give back every
        value bit for bit; else None (the matrix stays a PackedF32Weight)."""
        k, n = w.shape
        if w.dtype != torch.float32 or k % GROUP or n % PANEL:
            return None
        for kind in (PackedInt4Weight, PackedQ8Weight):
            try:
                if kind.quantize(w[:, :PANEL], exact=True) is None:  # one panel first: off-grid is refused cheaply
                    continue
                codes = kind.quantize(w, exact=True)
            except ValueError:  # beyond float16's range
                return None
            if codes is not None:
                return cls(codes)
        return None

    @property
    def in_features(self) -> int:
        return self.codes.in_features

    @property
    def out_features(self) -> int:
        return self.codes.out_features

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        lib = dequant()
        q8, k, n = int(isinstance(self.codes, PackedQ8Weight)), self.in_features, self.out_features

        def run(x: torch.Tensor, rows: int, y: torch.Tensor) -> None:
            scratch = torch.empty(lib.skinny_dequant_scratch_floats(rows, k), dtype=torch.float32)
            lib.skinny_gemm_dequant(q8, x.data_ptr(), rows, k, self.codes.codes.data_ptr(),
                                    self.codes.scales.data_ptr(), n, y.data_ptr(), scratch.data_ptr())
        return _float32_matmul(x, n, run)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> the matrix's columns [T, in] float32 (a tied output head's embedding rows)."""
        return self.codes.columns(ids)

    def dense(self) -> torch.Tensor:
        """The [in, out] float32 matrix (tests)."""
        return self.codes.dense()

    def storages(self) -> list[torch.Tensor]:
        return self.codes.storages()
