"""The Llama family in plain torch over a paged KV pool: many sequences, one forward per step.

`PagedLlamaRunner` implements `specdec.serving.batch.BatchRunner` for Llama, Qwen2 (q/k/v
bias), Qwen3 (per-head q/k RMSNorm) and Mistral. Anything else is refused by `supports`
and served by the transformers runner instead.

Layout:
- weights are pulled out of the Hugging Face model once, fused (QKV as one matrix, gate/up
  as one matrix), and the HF model is dropped: memory is weights + KV pool + RoPE tables;
- the KV pool is allocated once, zero-filled, as K and V [layers, num_blocks*block_size,
  Hkv, D] (slot-major); `self.blocks` (a `BlockManager`) says which slots a sequence owns;
- RoPE cos/sin are tabulated for every position 0..max_context-1 at load by the model's own
  rotary module (`hf_compat.rope_tables`), so scaled variants (llama3, linear, yarn) match.

A step is `prepare(chunks) -> StepInputs` (Python: validation, block growth, index tensors)
followed by `run_step(weights, pool, inputs)`, a pure tensor function (no Python branching
on data). With CUDA graphs (`enable_graphs`, specdec.serving.graphs), small steps are padded
to (batch, tokens, blocks) buckets and replayed from captured graphs; the pool's last block
is the scratch space padded rows write to (no sequence ever owns it).

Attention: all chunks' tokens go through the matmuls as one flat [T, hidden] batch. For
attention, queries are scattered into [B, maxq] (padded), each sequence's K/V are gathered
block-wise from its block table into [B, maxblocks*block_size], and a mask (key
position <= query position, and inside the sliding window on windowed layers) lets one
scaled_dot_product_attention per layer do every sequence. GQA without copying K/V: the
G = Hq/Hkv query heads of each KV head are folded into the query-length axis.

Sliding window (Mistral; Qwen2/Qwen3 with use_sliding_window): implemented in the mask,
exactly as transformers does (a query at p sees keys at positions > p - window); the full
history stays in the pool, so max_context is not capped to the window.

max_context = min(config.max_position_embeddings, pool capacity): a sequence can never
hold more tokens than the pool has slots.

Precision `int4` (CPU): the decoder layers' matmul weights (QKV, O, gate/up, down) are
4-bit `Int4Weight`s (specdec.serving.int4); the output head bf16, and with `int4_head = "int8"`
also an 8-bit copy (`Int8Weight`) for steps of at most SMALL_HEAD_ROWS logit rows, where
reading half the bytes wins; everything else (embedding, norms, RoPE tables, activations, the
KV pool) bf16. It is for drafts: a token costs a third of fp32. With `cpu_kernels = "specdec"`
(the default) on AVX-512 VNNI the 4-bit matrices and the 8-bit head are specdec's
(`PackedInt4Weight`, `PackedInt8Weight`, or with `int4_head = "q8_0"`, the draft's default,
`PackedQ8Weight`: GGUF's Q8_0 blocks, also the tied embedding in float32; activations rounded
to `int4_activations` bits, 16 for the draft; the 8-bit head serves every step), and steps of
at most FUSED_ROWS tokens run every decoder layer in one C call (`fuse_int4`: float32
activations between the matmuls, attention straight from the pool) for a Llama layer without
biases or q/k norms.

Precision float32 on the CPU with `cpu_kernels = "specdec"` (the default): every matmul weight
(QKV, O, gate/up, down, the output head) is a `PackedF32Weight` run by specdec's own kernel
(specdec.serving.cpu_gemm): the same values, a verify of k + 1 rows at 1.7x a one-row step
instead of 2.7x, and each row's result independent of the rows beside it. A matrix whose every
value is a GGUF's Q4_1 or Q8_0 value (a model dequantized from a Q4_1 file, as the default
target: its layers and its head) is kept as those codes instead (`CodesF32Weight`, AVX-512):
the same results bit for bit, a sixth of the layers' bytes (`cpu_kernels = "specdec-f32"`
keeps float32 panels). A tied embedding is read from the packed head's columns (no second copy).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from specdec import hf_compat, models
from specdec.devices import kv_pool_tokens_for_memory
from specdec.serving.batch import ModelFacts, SeqChunk, StepAborted, StopCheck
from specdec.serving import cpu_gemm
from specdec.serving.blocks import BlockManager
from specdec.serving.cpu_gemm import (CPU_KERNELS, PANEL, CodesF32Weight, FusedInt4Layers, PackedF32Weight,
                                     PackedInt4Weight, PackedInt8Weight, PackedQ8Weight)
from specdec.serving.graphs import Capture, GraphConfig, StepGraphs, pad_rows, pick_bucket
from specdec.serving import stored_model
from specdec.serving.int4 import Int4Weight, Int8Weight

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE variants whose frequencies depend on the current sequence length: not a position table
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INT4 = "int4"  # 4-bit weights, bf16 activations (CPU)
# the int4 precision's output head: bfloat16; int8, one scale per vocabulary row; q8_0, a float16
# scale per 32 inputs (GGUF's Q8_0: the shipped SMolLM2 head's own values; specdec's kernels only)
INT4_HEADS = ("bfloat16", "int8", "q8_0")
# the int8 head serves steps of at most this many logit rows: one core, 49,152 x 576, ms per head
# matmul int8 / bf16 at 1, 2, 4, 6, 8, 16 rows: 1.8/4.3, 1.6/3.8, 1.9/3.8, 3.6/4.2, 3.8/4.3, 7.5/5.4
# (scripts/int8_head_probe.py). specdec's int8 kernel (PackedInt8Weight) serves every step: against
# bf16, 0.83/3.48 ms at 1 row, 2.18/4.27 at 9, 4.26/7.33 at 36, 7.01/11.55 at 72
# (scripts/cpu_kernels_probe.py, BENCHMARKS.md §6o)
SMALL_HEAD_ROWS = 4
# the int4 precision (drafts) runs steps of at most this many tokens through the fused layers
# (fuse_int4). The default draft's step at 300 tokens of context, fused against torch ops with
# SDPA, ms: 1 token 5.66/8.27, 4 tokens 9.57/12.07, 9 tokens 16.00/17.17, 12 tokens 18.15/18.99,
# 16 tokens 22.16/21.93, 24 tokens 30.39/29.15: the fused attention does each row alone, so
# longer steps (prefill chunks) keep torch ops (scripts/cpu_kernels_probe.py, BENCHMARKS.md §6o)
FUSED_ROWS = 12
PRECISIONS = (*_DTYPES, INT4)
# a weight used as x @ w: [in, out]
Matrix = (torch.Tensor | Int4Weight | Int8Weight | PackedF32Weight | CodesF32Weight | PackedInt4Weight
          | PackedInt8Weight | PackedQ8Weight)
# the Matrix kinds with their own matmul and storages
OWN_MATMUL = (Int4Weight, Int8Weight, PackedF32Weight, CodesF32Weight, PackedInt4Weight, PackedInt8Weight,
              PackedQ8Weight)
# packed heads whose columns are a tied embedding's rows
PACKED_EMBEDS = (PackedF32Weight, CodesF32Weight, PackedQ8Weight)
# a small head of specdec's kernels serves every step (it is faster than bf16 at every row count)
PACKED_HEADS = (PackedInt8Weight, PackedQ8Weight)


# ----------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """Shapes and constants of the model."""

    num_layers: int
    hidden: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    intermediate: int  # I
    vocab: int  # V
    eps: float  # RMSNorm epsilon
    max_context: int  # positions 0..max_context-1 are valid
    windows: tuple[int | None, ...]  # per layer: sliding window, or None for full attention

    @property
    def group(self) -> int:  # G: query heads per KV head
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [hidden, (Hq+2Hkv)*D]: q, k, v columns (x @ qkv)
    qkv_bias: torch.Tensor | None  # [(Hq+2Hkv)*D] (Qwen2)
    qk_norm: torch.Tensor | None  # [Hq+Hkv, D]: q_norm per q head, k_norm per k head (Qwen3)
    o: Matrix  # [Hq*D, hidden]
    o_bias: torch.Tensor | None  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [hidden, 2I]: gate columns then up columns
    gate_up_bias: torch.Tensor | None  # [2I]
    down: Matrix  # [I, hidden]
    down_bias: torch.Tensor | None  # [hidden]
    window: int | None  # sliding window of this layer


@dataclass
class Weights:
    embed: torch.Tensor | PackedF32Weight | CodesF32Weight | PackedQ8Weight  # [V, hidden] (tied: a transposed view of lm_head, or lm_head itself when packed)
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: Matrix  # [hidden, V]
    cos: torch.Tensor  # [max_context, D]
    sin: torch.Tensor  # [max_context, D]
    small_head: Int8Weight | PackedInt8Weight | PackedQ8Weight | None = None  # [hidden, V] in 8 bits, for steps of few logit rows

    def embed_is_head(self) -> bool:
        """Whether the embedding is the output head's storage (tied: one copy)."""
        if self.embed is self.lm_head:  # packed: the head itself
            return True
        head = self.lm_head if isinstance(self.lm_head, torch.Tensor) else None
        return head is not None and self.embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()

    def matrices(self) -> list[Matrix]:
        """The output head and every layer's fused matrices."""
        return [self.lm_head] + [getattr(lw, m) for lw in self.layers for m in FUSED]

    def nbytes(self) -> int:
        """Bytes of the model weights (each storage once; RoPE tables not counted)."""
        parts = [self.embed, self.final_norm, self.lm_head, self.small_head]
        for lw in self.layers:
            parts += [lw.input_norm, lw.qkv, lw.qkv_bias, lw.qk_norm, lw.o, lw.o_bias, lw.post_norm, lw.gate_up,
                      lw.gate_up_bias, lw.down, lw.down_bias]
        tensors = [t for p in parts if p is not None
                   for t in (p.storages() if isinstance(p, OWN_MATMUL) else [p])]
        seen: dict[int, int] = {}
        for t in tensors:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())


def _layer_windows(config, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window as transformers applies it for these model types."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return (None,) * num_layers
    if config.model_type == "mistral":  # every layer (MistralAttention reads config.sliding_window)
        return (int(window),) * num_layers
    layer_types = getattr(config, "layer_types", None)  # qwen2/qwen3: only "sliding_attention" layers
    if not layer_types:
        return (None,) * num_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types[:num_layers])


def _bias(linear: torch.nn.Module) -> torch.Tensor | None:
    return None if getattr(linear, "bias", None) is None else linear.bias.detach()


def _cat_bias(linears: Sequence[torch.nn.Module]) -> torch.Tensor | None:
    biases = [_bias(m) for m in linears]
    if all(b is None for b in biases):
        return None
    parts = [b if b is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype, device=m.weight.device)
             for b, m in zip(biases, linears)]
    return torch.cat(parts)  # [sum of out features]


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """[out, in] (nn.Linear) -> contiguous [in, out], used as x @ w.

    MKL's fp32 sgemm is 1.3-1.6x faster for 4..72 rows with the weight in this layout
    than with nn.Linear's (transposed B) on the CPUs measured; cuBLAS takes either.
    """
    return w.t().contiguous()  # [in, out]


def linear(x: torch.Tensor, w: Matrix, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], w [in, out], bias [out] -> [T, out]."""
    if isinstance(w, OWN_MATMUL):
        y = w.matmul(x)  # [T, out]
        return y if bias is None else y + bias
    return torch.matmul(x, w) if bias is None else torch.addmm(bias, x, w)  # [T, out]


def _extract_layer(layer: torch.nn.Module, num_heads: int, num_kv_heads: int, head_dim: int,
                   window: int | None) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv_mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    qk_norm = None
    if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm over D, per head
        q_w = attn.q_norm.weight.detach().expand(num_heads, head_dim)  # [Hq, D]
        k_w = attn.k_norm.weight.detach().expand(num_kv_heads, head_dim)  # [Hkv, D]
        qk_norm = torch.cat([q_w, k_w]).contiguous()  # [Hq+Hkv, D]
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_transposed(torch.cat([m.weight.detach() for m in qkv_mods])),
        qkv_bias=_cat_bias(qkv_mods),
        qk_norm=qk_norm,
        o=_transposed(attn.o_proj.weight.detach()),
        o_bias=_bias(attn.o_proj),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_transposed(torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()])),
        gate_up_bias=_cat_bias((mlp.gate_proj, mlp.up_proj)),
        down=_transposed(mlp.down_proj.weight.detach()),
        down_bias=_bias(mlp.down_proj),
        window=window,
    )


def _max_context(config, capacity_tokens: int) -> int:
    """Positions a sequence may reach: the model's limit, or the pool's when that is smaller."""
    return min(int(getattr(config, "max_position_embeddings", 2048)), capacity_tokens)


def _arch_of(model: torch.nn.Module, max_context: int) -> Arch:
    c = model.config
    num_heads = int(c.num_attention_heads)
    num_kv_heads = int(getattr(c, "num_key_value_heads", None) or num_heads)
    layer0 = model.get_decoder().layers[0]
    head_dim = int(layer0.self_attn.q_proj.weight.shape[0]) // num_heads
    num_layers = int(c.num_hidden_layers)
    return Arch(num_layers=num_layers, hidden=int(c.hidden_size), num_heads=num_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim,
                intermediate=int(layer0.mlp.gate_proj.weight.shape[0]),
                vocab=int(model.get_output_embeddings().weight.shape[0]), eps=float(c.rms_norm_eps),
                max_context=max_context, windows=_layer_windows(c, num_layers))


def extract_weights(model: torch.nn.Module, arch: Arch, consume: bool = False) -> Weights:
    """Fused plain tensors from a HF Llama-family model, in the model's dtype and device.

    consume=True replaces each decoder layer of `model` by an empty module once it is copied,
    so peak memory stays near one copy of the weights (the model is unusable afterwards).
    """
    decoder = model.get_decoder()
    dtype = decoder.embed_tokens.weight.dtype
    device = decoder.embed_tokens.weight.device
    layers = []
    for i in range(arch.num_layers):
        layers.append(_extract_layer(decoder.layers[i], arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                     arch.windows[i]))
        if consume:
            decoder.layers[i] = torch.nn.Identity()
    embed = model.get_input_embeddings().weight.detach()  # [V, hidden]
    head = model.get_output_embeddings().weight.detach()  # [V, hidden]
    lm_head = _transposed(head)  # [hidden, V]
    if head.data_ptr() == embed.data_ptr():  # tied: one copy; rows of the embedding are strided reads
        embed = lm_head.t()  # [V, hidden] (a view)
    cos, sin = hf_compat.rope_tables(model, arch.max_context, dtype, device)  # [max_context, D] each
    return Weights(embed=embed, layers=layers, final_norm=decoder.norm.weight.detach(),
                   lm_head=lm_head, cos=cos, sin=sin)


def pack_f32(w: Weights, codes: bool = False) -> Weights:
    """float32 CPU weights with every matmul weight packed for specdec's kernel (cpu_gemm); a
    tied embedding becomes the packed head itself (read through its columns). codes: a matrix
    whose every value lies on a GGUF grid (a model dequantized from a Q4_1 file: its layers on
    Q4_1, its head on Q8_0) is kept as those codes (CodesF32Weight: the same float32 results bit
    for bit, a sixth of the layers' bytes read)."""
    def packed(m: torch.Tensor) -> PackedF32Weight | CodesF32Weight:
        return (CodesF32Weight.of(m) if codes else None) or PackedF32Weight.pack(m)

    tied = w.embed_is_head()
    layers = [dataclasses.replace(lw, qkv=packed(lw.qkv), o=packed(lw.o), gate_up=packed(lw.gate_up),
                                  down=packed(lw.down)) for lw in w.layers]
    head = packed(w.lm_head)
    return dataclasses.replace(w, layers=layers, lm_head=head, embed=head if tied else w.embed)


def packable_f32(w: Weights) -> bool:
    """Whether pack_f32 takes these weights: float32 on the CPU, every matrix a multiple of PANEL wide."""
    return all(isinstance(m, torch.Tensor) and m.dtype == torch.float32 and m.device.type == "cpu"
               and m.shape[1] % PANEL == 0 for m in w.matrices())


def packable_int4(w: Weights) -> bool:
    """Whether quantize_int4(packed=True) takes these weights: every matrix GROUP deep and PANEL wide."""
    return all(m.shape[0] % cpu_gemm.GROUP == 0 and m.shape[1] % PANEL == 0 for m in w.matrices())


def embed_tokens(embed: torch.Tensor | PackedF32Weight | CodesF32Weight | PackedQ8Weight, token_ids: torch.Tensor
                 ) -> torch.Tensor:
    """token_ids [T] -> [T, hidden] (float32 from a packed head)."""
    if isinstance(embed, PACKED_EMBEDS):  # the tied, packed output head [hidden, V]: its columns
        return embed.columns(token_ids)
    return embed.index_select(0, token_ids)


# the fused matrices of a layer, and the Linear layers each one concatenates (along its outputs)
FUSED = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
         "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
MakeInt4 = Callable[[int, str, torch.Tensor], Int4Weight | PackedInt4Weight]  # (layer, fused name, [in, out] matrix)


def quantize_int4(w: Weights, make: MakeInt4 | None = None, head_dtype: str = "bfloat16", packed: bool = False,
                  act_bits: int = 8) -> Weights:
    """The `int4` precision: 4-bit matmul weights (`make`: by default each float32 matrix quantized
    on the Q4_1 grid), the output head in `head_dtype` (INT4_HEADS), bf16 for the rest.
    packed: the 4-bit matrices and the 8-bit heads in specdec's kernel (cpu_gemm.PackedInt4Weight,
    PackedInt8Weight, PackedQ8Weight: `act_bits`-bit activations on VNNI) instead of torch's
    (Int4Weight, Int8Weight; q8_0 falls back to int8 there)."""
    if make is None:
        make = ((lambda _layer, _name, m: PackedInt4Weight.quantize(m, act_bits)) if packed else  # noqa: E731
                (lambda _layer, _name, m: Int4Weight.quantize(m)))
    if head_dtype not in INT4_HEADS:
        raise ValueError(f"int4_head must be one of {', '.join(INT4_HEADS)}, got {head_dtype!r}")
    def bf16(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(torch.bfloat16)

    layers = [LayerWeights(input_norm=bf16(lw.input_norm), qkv=make(i, "qkv", lw.qkv), qkv_bias=bf16(lw.qkv_bias),
                           qk_norm=bf16(lw.qk_norm), o=make(i, "o", lw.o), o_bias=bf16(lw.o_bias),
                           post_norm=bf16(lw.post_norm), gate_up=make(i, "gate_up", lw.gate_up),
                           gate_up_bias=bf16(lw.gate_up_bias), down=make(i, "down", lw.down),
                           down_bias=bf16(lw.down_bias), window=lw.window)
              for i, lw in enumerate(w.layers)]
    # the output head is not 4-bit: it is not on a 4-bit grid in the shipped GGUF, and in 4 bits the
    # default draft agreed with its fp32 self on 95.8% of next tokens of a 200-token text (bf16
    # head: 99.4%; a one-off check). In bf16 it is kept [V, hidden] and used through a transposed
    # view: one row cost 3.6 ms against 5.1 as [hidden, V] (oneDNN, one core, one-off); when the
    # model ties them, it is also the embedding. An int8 copy (per vocabulary row) reads half the
    # bytes (1.8 ms against 4.3 for a row), the draft's top-1 agreement with the fp32 target
    # 98.0% -> 97.2% (BENCHMARKS.md §6f); bf16 stays faster from about 8 rows.
    tied = w.embed_is_head()
    if packed and head_dtype == "q8_0":
        # the Q8_0 head is the only head (faster than bf16 at every row count), and a tied embedding
        # reads its rows from it in float32: the shipped model's values, no bf16 rounding. So is the
        # final norm, which feeds the head
        q8 = PackedQ8Weight.quantize(w.lm_head, act_bits)
        return Weights(embed=q8 if tied else bf16(w.embed).contiguous(), layers=layers,
                       # a copy: the loaded model's tensor may share one storage with all its weights
                       final_norm=w.final_norm.detach().float().clone(), lm_head=q8, cos=bf16(w.cos),
                       sin=bf16(w.sin))
    head = bf16(w.lm_head.t()).contiguous()  # [V, hidden]
    embed = head if tied else bf16(w.embed).contiguous()  # [V, hidden]
    small_head = (None if head_dtype == "bfloat16" else Int8Weight.quantize(w.lm_head) if not packed else
                  PackedInt8Weight.quantize(w.lm_head))
    return Weights(embed=embed, layers=layers, final_norm=bf16(w.final_norm), lm_head=head.t(),
                   cos=bf16(w.cos), sin=bf16(w.sin), small_head=small_head)


def stored_int4(directory, group: int, symmetric: bool) -> MakeInt4:
    """`make` for quantize_int4 that takes a compressed-tensors INT4 checkpoint's codes as stored
    (specdec/awq.py, llm-compressor): the fused matrix from its Linears' codes, scales and zero
    points concatenated along the outputs, no requantization."""
    def make(layer: int, name: str, _dense: torch.Tensor) -> Int4Weight:
        parts = [hf_compat.ct_read_w4a16(directory, f"model.layers.{layer}.{m}", group, symmetric) for m in FUSED[name]]
        codes, scale, zero = (torch.cat([p[j] for p in parts]) for j in range(3))  # [out, in], [out, in/G] x 2
        return Int4Weight.from_codes(codes, scale, zero, group)
    return make


# ----------------------------------------------------------------------------------------
# the KV pool and one step's inputs
# ----------------------------------------------------------------------------------------
@dataclass
class KVPool:
    k: torch.Tensor  # [layers, num_blocks*block_size, Hkv, D]
    v: torch.Tensor  # [layers, num_blocks*block_size, Hkv, D]
    block_size: int

    @classmethod
    def allocate(cls, arch: Arch, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: str | torch.device) -> "KVPool":
        shape = (arch.num_layers, num_blocks * block_size, arch.num_kv_heads, arch.head_dim)
        # zeros (not empty): the pages are touched now, so RSS shows the pool at startup,
        # and never-written slots hold finite values (they are masked, but 0 * NaN is NaN)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   block_size)

    def bytes_per_token(self) -> int:
        layers, _, heads, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()


@dataclass
class StepInputs:
    """Index tensors for one step (all on the model's device, int64 unless noted).

    B sequences, T tokens in all, maxq = the longest chunk, MB = the most blocks any
    sequence's table has after this step, R = logit rows wanted.
    """

    token_ids: torch.Tensor  # [T] token of each flat row
    positions: torch.Tensor  # [T] position of each token in its sequence
    slots: torch.Tensor  # [T] pool slot each token's K/V is written to
    query_index: torch.Tensor  # [B, maxq] flat row of each padded query (padding -> 0)
    query_positions: torch.Tensor  # [B, maxq] position of each padded query (padding -> 0)
    unpad_index: torch.Tensor  # [T] row in the flattened [B*maxq] padded layout of each token
    block_tables: torch.Tensor  # [B, MB] block ids of each sequence (padding -> 0)
    logit_rows: torch.Tensor  # [R] flat rows that need logits, in chunk order
    logit_counts: tuple[int, ...]  # per chunk: how many of the R rows are its (Python)


def attention_masks(query_positions: torch.Tensor, num_keys: int, group: int, windows: Sequence[int | None],
                    dtype: torch.dtype) -> dict[int | None, torch.Tensor]:
    """Additive masks (0 = attend, -inf = not) per distinct window, folded for GQA.

    A query at position p sees key positions k <= p (and k > p - window on windowed layers).
    Keys past a sequence's length always have k > p, so causality also masks the padding of
    its gathered blocks and any stale slots after a rollback. Padded queries sit at p = 0:
    they see key 0, which keeps their softmax finite; their rows are dropped.
    Additive rather than boolean: SDPA would convert a boolean mask on every call (every layer).
    Returns {window: [B, 1, maxq*G, num_keys]}.
    """
    b, maxq = query_positions.shape
    key_pos = torch.arange(num_keys, device=query_positions.device)  # [C]
    q_pos = query_positions.unsqueeze(-1)  # [B, maxq, 1]
    causal = key_pos <= q_pos  # [B, maxq, C]
    masks = {}
    for window in set(windows):
        allowed = causal if window is None else causal & (key_pos > q_pos - window)  # [B, maxq, C]
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf"))  # [B, maxq, C]
        additive = additive.unsqueeze(2).expand(b, maxq, group, num_keys)  # [B, maxq, G, C]
        masks[window] = additive.reshape(b, 1, maxq * group, num_keys)  # [B, 1, maxq*G, C]
    return masks


# ----------------------------------------------------------------------------------------
# the tensor function
# ----------------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N], weight [N] (or broadcastable) -> [..., N]; in float32 like transformers."""
    xf = x.float()  # [..., N]
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., N]
    return weight * xf.to(x.dtype)  # [..., N]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # same shape as x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, D] -> [T, H, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]
    return x * cos + rotate_half(x) * sin  # [T, H, D]


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache [S, Hkv, D] (one layer), block_tables [B, MB] -> [B, Hkv, MB*block_size, D].

    One index_select of whole blocks (block_size*Hkv*D contiguous elements each); the result
    is a transposed view of that copy (SDPA takes the strides as they are).
    """
    s, heads, dim = cache.shape
    b, mb = block_tables.shape
    blocks = cache.view(s // block_size, block_size, heads, dim)  # [NB, bs, Hkv, D]
    picked = blocks.index_select(0, block_tables.reshape(-1))  # [B*MB, bs, Hkv, D]
    return picked.view(b, mb * block_size, heads, dim).transpose(1, 2)  # [B, Hkv, C, D]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, inputs: StepInputs,
              mask: torch.Tensor, arch: Arch, block_size: int) -> torch.Tensor:
    """q [T, Hq, D] (roped), caches [S, Hkv, D] holding this step's K/V -> [T, Hq*D]."""
    b, maxq = inputs.query_index.shape
    hkv, g, d = arch.num_kv_heads, arch.group, arch.head_dim
    qp = q.index_select(0, inputs.query_index.reshape(-1))  # [B*maxq, Hq, D]
    qp = qp.view(b, maxq, hkv, g, d).permute(0, 2, 1, 3, 4).reshape(b, hkv, maxq * g, d)  # [B, Hkv, maxq*G, D]
    keys = gather_kv(k_cache, inputs.block_tables, block_size)  # [B, Hkv, C, D]
    values = gather_kv(v_cache, inputs.block_tables, block_size)  # [B, Hkv, C, D]
    out = F.scaled_dot_product_attention(qp, keys, values, attn_mask=mask, scale=arch.scale)  # [B, Hkv, maxq*G, D]
    out = out.view(b, hkv, maxq, g, d).permute(0, 2, 1, 3, 4).reshape(b * maxq, hkv * g * d)  # [B*maxq, Hq*D]
    return out.index_select(0, inputs.unpad_index)  # [T, Hq*D]


# (q [T, Hq, D], k_cache, v_cache [S, Hkv, D], the layer's window) -> [T, Hq*D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int | None], torch.Tensor]


def sdpa_attend(inputs: StepInputs, arch: Arch, block_size: int, num_keys: int, dtype: torch.dtype) -> Attend:
    """Attention for a step by gather + SDPA, with one mask per distinct window."""
    masks = attention_masks(inputs.query_positions, num_keys, arch.group, arch.windows,
                            dtype)  # {window: [B, 1, maxq*G, C]}
    return lambda q, k_cache, v_cache, window: attention(q, k_cache, v_cache, inputs, masks[window], arch,
                                                         block_size)


def paged_attend(inputs: StepInputs, arch: Arch, block_size: int, num_keys: int) -> Attend:
    """Attention for a step in specdec's kernel (cpu_gemm.paged_attention: each row alone, read
    straight from the pool; `attends_in_c` says where it runs)."""
    seq = row_sequences(inputs)  # [T]
    scratch = cpu_gemm.attention_scratch(num_keys, arch.num_heads)
    return lambda q, k_cache, v_cache, window: cpu_gemm.paged_attention(
        q, k_cache, v_cache, inputs.block_tables, block_size, seq, inputs.positions, window, arch.scale, scratch)


def attends_in_c(arch: Arch, device: torch.device, cpu_kernels: str) -> bool:
    """Whether a step's attention runs in specdec's kernel rather than gather + SDPA: on a CPU
    with the AVX-512 VNNI library, cpu_kernels = specdec, heads it takes. A row's result then
    does not depend on the rows beside it, so with the fp32 target's skinny_gemm a verify's
    logits equal one-token decodes bit for bit; and it is faster than SDPA on this CPU at every
    shape measured (the fp32 target at 300 keys: 1 row 18.85 against 19.41 ms, 9 rows 28.75
    against 31.05; scripts/step_context_probe.py, BENCHMARKS.md §6p)."""
    return (device.type == "cpu" and cpu_kernels != "torch" and cpu_gemm.lowbit() is not None
            and cpu_gemm.attention_takes(arch.head_dim, arch.group))


def row_sequences(inputs: StepInputs) -> torch.Tensor:
    """[T] the sequence (0..B-1) of each flat row."""
    return torch.div(inputs.unpad_index, inputs.query_index.shape[1], rounding_mode="floor")


def decoder_layer(x: torch.Tensor, lw: LayerWeights, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, attend: Attend, arch: Arch
                  ) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden]; writes this step's K/V into k_cache/v_cache [S, Hkv, D] at slots [T]."""
    t = x.shape[0]
    hq, hkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    h = rms_norm(x, lw.input_norm, arch.eps)  # [T, hidden]
    qkv = linear(h, lw.qkv, lw.qkv_bias)  # [T, (Hq+2Hkv)*D]
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)  # [T, Hq+Hkv, D]
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)  # [T, Hkv, D]
    if lw.qk_norm is not None:
        qk = rms_norm(qk, lw.qk_norm, arch.eps)  # [T, Hq+Hkv, D]
    qk = apply_rope(qk, cos, sin)  # [T, Hq+Hkv, D]
    k_cache.index_copy_(0, slots, qk[:, hq:])  # [S, Hkv, D] <- [T, Hkv, D]
    v_cache.index_copy_(0, slots, v)  # [S, Hkv, D] <- [T, Hkv, D]
    attn = attend(qk[:, :hq], k_cache, v_cache, lw.window)  # [T, Hq*D]
    x = x + linear(attn, lw.o, lw.o_bias)  # [T, hidden]
    h = rms_norm(x, lw.post_norm, arch.eps)  # [T, hidden]
    gate, up = linear(h, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)  # [T, I] each
    return x + linear(F.silu(gate) * up, lw.down, lw.down_bias)  # [T, hidden]


def run_step(weights: Weights, pool: KVPool, inputs: StepInputs, arch: Arch, stop: StopCheck | None = None,
             fused: FusedInt4Layers | None = None, c_attention: bool = False) -> torch.Tensor:
    """One step over StepInputs -> logits [R, V] in the model dtype, on the model's device.
    `stop()` is asked before each layer: True raises StepAborted (the caller rolls back).
    fused: the int4 layers in one C call (fuse_int4), used for steps of at most
    fused.max_rows tokens (FUSED_ROWS; `stop()` is then asked once, before it).
    c_attention: the other steps attend in specdec's kernel (attends_in_c), else gather + SDPA."""
    x = embed_tokens(weights.embed, inputs.token_ids)  # [T, hidden]
    if fused is not None and x.shape[0] <= fused.max_rows:
        if stop is not None and stop():
            raise StepAborted("stopped before layer 0")
        x = fused.run(x.float(), inputs.positions, inputs.slots, row_sequences(inputs),
                      inputs.block_tables)  # [T, hidden] float32
    else:
        x = decoder_layers(x.to(pool.k.dtype), weights, pool, inputs, arch, stop, c_attention)  # [T, hidden]
    h = x.index_select(0, inputs.logit_rows).to(weights.final_norm.dtype)  # [R, hidden]
    h = rms_norm(h, weights.final_norm, arch.eps)  # [R, hidden]
    small = weights.small_head is not None and (isinstance(weights.small_head, PACKED_HEADS)
                                                or h.shape[0] <= SMALL_HEAD_ROWS)
    return linear(h, weights.small_head if small else weights.lm_head)  # [R, V]


def decoder_layers(x: torch.Tensor, weights: Weights, pool: KVPool, inputs: StepInputs, arch: Arch,
                   stop: StopCheck | None, c_attention: bool = False) -> torch.Tensor:
    """x [T, hidden] -> [T, hidden] through every decoder layer (torch ops; attention in
    specdec's kernel with c_attention)."""
    cos = weights.cos.index_select(0, inputs.positions)  # [T, D]
    sin = weights.sin.index_select(0, inputs.positions)  # [T, D]
    num_keys = inputs.block_tables.shape[1] * pool.block_size  # C
    attend = (paged_attend(inputs, arch, pool.block_size, num_keys) if c_attention else
              sdpa_attend(inputs, arch, pool.block_size, num_keys, x.dtype))
    for layer, lw in enumerate(weights.layers):
        if stop is not None and stop():
            raise StepAborted(f"stopped before layer {layer}")
        x = decoder_layer(x, lw, pool.k[layer], pool.v[layer], cos, sin, inputs.slots, attend, arch)  # [T, hidden]
    return x


def fuse_int4(weights: Weights, pool: KVPool, arch: Arch) -> FusedInt4Layers | None:
    """The int4 layers as one C call (cpu_gemm.FusedInt4Layers), where the kernel builds and the
    layers are what it takes: 4-bit matrices in specdec's layout, no biases, no q/k norms."""
    plain = all(isinstance(getattr(lw, m), PackedInt4Weight) for lw in weights.layers for m in FUSED) and all(
        b is None for lw in weights.layers for b in (lw.qkv_bias, lw.o_bias, lw.gate_up_bias, lw.down_bias,
                                                      lw.qk_norm))
    if not (plain and cpu_gemm.attention_takes(arch.head_dim, arch.group) and cpu_gemm.lowbit() is not None):
        return None
    layers = [cpu_gemm.FusedLayerWeights(lw.qkv, lw.o, lw.gate_up, lw.down, lw.input_norm, lw.post_norm,
                                         pool.k[i], pool.v[i], lw.window) for i, lw in enumerate(weights.layers)]
    return FusedInt4Layers(layers, weights.cos, weights.sin, hidden=arch.hidden, num_heads=arch.num_heads,
                           num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim, intermediate=arch.intermediate,
                           eps=arch.eps, scale=arch.scale, block_size=pool.block_size, max_rows=FUSED_ROWS)


# ----------------------------------------------------------------------------------------
# the runner
# ----------------------------------------------------------------------------------------
def supports(config) -> bool:
    """True for the model types this runner reproduces exactly."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(config, "hidden_act", "silu") != "silu":
        return False
    if hf_compat.rope_type(config) in _LENGTH_DEPENDENT_ROPE:
        return False
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return heads % kv_heads == 0


# what a runner's built weights may hold (stored_model.keep_built / open_built)
_KEPT_CLASSES = {c.__name__: c for c in (Weights, LayerWeights, Arch, PackedF32Weight, CodesF32Weight,
                                         PackedInt4Weight, PackedInt8Weight, PackedQ8Weight, Int4Weight, Int8Weight)}


def _kernels_built() -> list[bool]:
    """Which of specdec's CPU kernels this machine has (they decide how weights are packed)."""
    return [cpu_gemm.skinny() is not None, cpu_gemm.dequant() is not None, cpu_gemm.lowbit() is not None]


class PagedLlamaRunner:
    """A BatchRunner for the Llama family over a paged KV pool (see the module docstring)."""

    def __init__(self, weights: Weights, arch: Arch, pool: KVPool, blocks: BlockManager, facts: ModelFacts,
                 device: torch.device):
        self.weights = weights
        self.arch = arch
        self.pool = pool
        self.blocks = blocks
        self.facts = facts
        self.device = device
        self.graphs: StepGraphs | None = None
        self.fused: FusedInt4Layers | None = None  # the int4 layers in one C call, for small steps (fuse_int4)
        self.c_attention = False  # the other steps attend in specdec's kernel (attends_in_c)
        # the pool's last block, which the block manager never hands out: padded graph rows write here
        self.scratch_slot = blocks.num_blocks * pool.block_size
        self.max_blocks = -(-arch.max_context // pool.block_size)  # the widest block table

    def enable_graphs(self, cfg: GraphConfig, capture: Capture) -> None:
        """Run steps that fit a bucket of `cfg` as captured graphs (`capture`: graphs.cuda_capture
        on a GPU; graphs.eager_capture replays eagerly, for tests)."""
        self.graphs = StepGraphs(cfg, capture, self.device)

    supports = staticmethod(supports)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str, dtype: str = "float32", device: str = "cpu", pool_tokens: int = 16384,
             block_size: int = 16, max_seqs: int = 64, memory_share_bytes: int = 0,
             activation_reserve: float = 0.1, int4_head: str = "bfloat16", cpu_kernels: str = "specdec",
             int4_activations: int = 8, manifest: bool = True, keep_built: bool = True) -> "PagedLlamaRunner":
        """Load a model spec (see specdec.models); the pool holds `pool_tokens` tokens (rounded up),
        or with pool_tokens = 0 what fits in `memory_share_bytes` after the weights and the
        `activation_reserve` fraction of the share (devices.kv_pool_tokens_for_memory).
        dtype: float32 | bfloat16 | float16, or int4 (CPU; see the module docstring), whose output
        head is `int4_head` (INT4_HEADS), and whose matmuls in specdec's kernels take
        `int4_activations`-bit activations (8 | 16). cpu_kernels: on the CPU, float32 and int4 run in
        specdec's kernels ("specdec", where they build; module docstring) or torch's ("torch").
        manifest: on the CPU, load from the model's load manifest when it has one, without
        transformers, and write one after a load through transformers (specdec.serving.stored_model);
        keep_built: with the manifest, start from the weights an earlier load built and kept, and keep
        those built here (stored_model.keep_built)."""
        if dtype not in PRECISIONS:
            raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {dtype!r}")
        if dtype == INT4 and torch.device(device).type != "cpu":
            raise ValueError("dtype int4 runs on the CPU only (torch's CPU int4 kernel); use bfloat16 on a GPU")
        src = models.resolve(spec)
        stored = models.int4_checkpoint(src) if dtype == INT4 else None  # (group, symmetric) of its codes
        load_dtype = "float32" if dtype == INT4 and stored is None else "bfloat16" if dtype == INT4 else dtype
        warm = manifest and stored is None and torch.device(device).type == "cpu"
        options = {"dtype": dtype, "int4_head": int4_head if dtype == INT4 else None, "cpu_kernels": cpu_kernels,
                   "int4_activations": int4_activations,
                   "kernels": _kernels_built() if cpu_kernels != "torch" else None}
        keep_built = warm and keep_built
        kept_tried = keep_built and pool_tokens > 0  # (a pool sized from memory needs the model's own bytes)
        if kept_tried:  # the weights as an earlier start built them
            runner = cls._from_kept(stored_model.built_file(src, options), spec, -(-pool_tokens // block_size),
                                    block_size, max_seqs, dtype == INT4, cpu_kernels)
            if runner is not None:
                return runner
        model = stored_model.open_stored(src, load_dtype) if warm else None  # None: load cold
        tok = None
        if model is None:
            model, tok = models.load_model(src, load_dtype, device), models.load_tokenizer(src)
        if pool_tokens <= 0:
            arch = _arch_of(model, 1)
            kv_bytes_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * model.dtype.itemsize
            weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            pool_tokens = kv_pool_tokens_for_memory(memory_share_bytes, weight_bytes, kv_bytes_per_token,
                                                    activation_reserve, block_size)
        num_blocks = max(1, -(-pool_tokens // block_size))
        max_context = _max_context(model.config, num_blocks * block_size)
        if tok is None and model.rope_positions < max_context:
            model, tok = models.load_model(src, load_dtype, device), models.load_tokenizer(src)  # tables too short
        if tok is None:
            fingerprint, eos = model.fingerprint, model.eos_token_ids
        else:
            fingerprint, eos = models.tokenizer_fingerprint(tok), models.eos_token_ids(tok, model.config)
            if warm:  # before _build consumes the model
                stored_model.record(src, model, tok, load_dtype, max_context)
        runner = cls._build(model, spec, fingerprint, eos, num_blocks, block_size, max_seqs, consume=True,
                            int4=dtype == INT4, int4_make=stored_int4(src.directory, *stored) if stored else None,
                            int4_head=int4_head, cpu_kernels=cpu_kernels, int4_activations=int4_activations)
        path = stored_model.built_file(src, options) if keep_built else None
        if path is not None and (kept_tried or not path.exists()):  # missing, unreadable or too short
            runner._keep(path, model)
        return runner

    def _keep(self, path: Path, model) -> None:
        """Keep the built weights at `path` (stored_model.keep_built), with RoPE tables for every
        position the model may reach (up to the manifest's MAX_STORED_POSITIONS), so that a load
        for any pool finds them long enough."""
        limit = _max_context(model.config, 1 << 62)
        n = max(self.arch.max_context, min(limit, stored_model.MAX_STORED_POSITIONS))
        weights, arch = self.weights, self.arch
        if n > arch.max_context:
            try:
                cos, sin = hf_compat.rope_tables(model, n, model.get_input_embeddings().weight.dtype, "cpu")
            except ValueError:  # the stored tables are shorter: keep those built
                pass
            else:
                weights = dataclasses.replace(weights, cos=cos.to(weights.cos.dtype), sin=sin.to(weights.sin.dtype))
                arch = dataclasses.replace(arch, max_context=n)
        kv_dtype = {dt: name for name, dt in _DTYPES.items()}[self.pool.k.dtype]
        stored_model.keep_built(path, (weights, arch, limit, self.facts.fingerprint, list(self.facts.eos_token_ids),
                                       kv_dtype), _KEPT_CLASSES)

    @classmethod
    def _from_kept(cls, path, spec: str, num_blocks: int, block_size: int, max_seqs: int, int4: bool,
                   cpu_kernels: str) -> "PagedLlamaRunner | None":
        """A runner over the weights kept at `path` (see _keep), or None when there are none for this
        context: build them."""
        kept = stored_model.open_built(path, _KEPT_CLASSES)
        if kept is None:
            return None
        weights, arch, limit, fingerprint, eos, kv_dtype = kept
        if not (isinstance(weights, Weights) and isinstance(arch, Arch) and kv_dtype in _DTYPES):
            return None
        blocks = BlockManager(num_blocks, block_size, max_seqs)
        max_context = min(limit, blocks.capacity_tokens)
        if max_context > arch.max_context:
            return None
        weights = dataclasses.replace(weights, cos=weights.cos[:max_context], sin=weights.sin[:max_context])
        arch = dataclasses.replace(arch, max_context=max_context)
        return cls._assemble(weights, arch, blocks, _DTYPES[kv_dtype], spec, fingerprint, eos, int4, cpu_kernels,
                             torch.device("cpu"))

    @classmethod
    def from_hf_model(cls, model: torch.nn.Module, tokenizer=None, spec: str = "", num_blocks: int = 256,
                      block_size: int = 16, max_seqs: int = 64, int4: bool = False,
                      int4_head: str = "bfloat16", cpu_kernels: str = "specdec", int4_activations: int = 8
                      ) -> "PagedLlamaRunner":
        """Build from a loaded HF model (left intact); without a tokenizer the fingerprint is vocab-V.
        int4: quantize a float32 model's matmul weights to 4 bits (module docstring); cpu_kernels as
        in `load`."""
        vocab = int(model.get_output_embeddings().weight.shape[0])
        fingerprint = models.tokenizer_fingerprint(tokenizer) if tokenizer is not None else f"vocab-{vocab}"
        eos = models.eos_token_ids(tokenizer, model.config) if tokenizer is not None else []
        return cls._build(model, spec, fingerprint, eos, num_blocks, block_size, max_seqs, consume=False, int4=int4,
                          int4_head=int4_head, cpu_kernels=cpu_kernels, int4_activations=int4_activations)

    @classmethod
    def _build(cls, model, spec: str, fingerprint: str, eos: list[int], num_blocks: int, block_size: int,
               max_seqs: int, consume: bool, int4: bool = False, int4_make: MakeInt4 | None = None,
               int4_head: str = "bfloat16", cpu_kernels: str = "specdec", int4_activations: int = 8
               ) -> "PagedLlamaRunner":
        if cpu_kernels not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNELS)}, got {cpu_kernels!r}")
        if int4_activations not in cpu_gemm.ACTIVATION_BITS:
            raise ValueError(f"int4_activations must be one of {cpu_gemm.ACTIVATION_BITS}, got {int4_activations!r}")
        if not supports(model.config):
            raise ValueError(f"PagedLlamaRunner does not support model_type={model.config.model_type!r} "
                             f"(rope {hf_compat.rope_type(model.config)!r}); use the transformers runner")
        blocks = BlockManager(num_blocks, block_size, max_seqs)
        max_context = _max_context(model.config, blocks.capacity_tokens)
        arch = _arch_of(model, max_context)
        param = model.get_input_embeddings().weight
        dtype, device = param.dtype, param.device
        with torch.inference_mode():
            weights = extract_weights(model, arch, consume=consume)
            ours = cpu_kernels != "torch" and device.type == "cpu"
            if int4 and int4_make is not None:  # a stored INT4 checkpoint: its own codes
                weights, dtype = quantize_int4(weights, int4_make, int4_head), torch.bfloat16
            elif int4:
                if dtype != torch.float32:
                    raise ValueError(f"int4 quantizes a float32 model, got {dtype}")
                packed = ours and packable_int4(weights) and cpu_gemm.lowbit() is not None
                weights, dtype = (quantize_int4(weights, head_dtype=int4_head, packed=packed, act_bits=int4_activations),
                                  torch.bfloat16)
            elif ours and packable_f32(weights) and cpu_gemm.skinny() is not None:
                weights = pack_f32(weights, codes=cpu_kernels == "specdec" and cpu_gemm.dequant() is not None)
        return cls._assemble(weights, arch, blocks, dtype, spec, fingerprint, eos, int4, cpu_kernels, device)

    @classmethod
    def _assemble(cls, weights: Weights, arch: Arch, blocks: BlockManager, dtype: torch.dtype, spec: str,
                  fingerprint: str, eos: list[int], int4: bool, cpu_kernels: str, device: torch.device
                  ) -> "PagedLlamaRunner":
        """The runner over built weights: its KV pool (in `dtype`), facts and fused int4 layers."""
        with torch.inference_mode():
            pool = KVPool.allocate(arch, blocks.num_blocks + 1, blocks.block_size, dtype, device)  # + the scratch block
        dtype_name = INT4 if int4 else {dt: name for name, dt in _DTYPES.items()}.get(dtype, str(dtype))
        facts = ModelFacts(model=spec, engine="torch", fingerprint=fingerprint, vocab_size=arch.vocab,
                           max_context=arch.max_context, eos_token_ids=list(eos), dtype=dtype_name, device=str(device),
                           weight_bytes=weights.nbytes(), kv_bytes_per_token=pool.bytes_per_token())
        runner = cls(weights, arch, pool, blocks, facts, device)
        runner.fused = fuse_int4(weights, pool, arch) if int4 else None
        runner.c_attention = attends_in_c(arch, device, cpu_kernels)
        return runner

    # -- a step -------------------------------------------------------------------------
    def _validate(self, chunks: Sequence[SeqChunk]) -> None:
        seen: set[int] = set()
        for c in chunks:
            if c.seq in seen:
                raise ValueError(f"sequence {c.seq} appears twice in one batch")
            seen.add(c.seq)
            try:
                cached = self.blocks.length(c.seq)
            except KeyError:
                raise ValueError(f"unknown sequence {c.seq}") from None
            n = len(c.tokens)
            if n == 0:
                raise ValueError(f"sequence {c.seq}: empty chunk")
            if c.start != cached:
                raise ValueError(f"sequence {c.seq}: chunk starts at {c.start} but {cached} tokens are cached")
            if not 0 <= c.num_logits <= n:
                raise ValueError(f"sequence {c.seq}: num_logits {c.num_logits} outside [0, {n}]")
            if c.start + n > self.arch.max_context:
                raise ValueError(f"sequence {c.seq}: positions up to {c.start + n - 1} pass the context "
                                 f"limit {self.arch.max_context}")
            if min(c.tokens) < 0 or max(c.tokens) >= self.arch.vocab:
                raise ValueError(f"sequence {c.seq}: token ids outside [0, {self.arch.vocab})")

    def _grow(self, chunks: Sequence[SeqChunk]) -> None:
        """Make every table cover its chunk; all or nothing."""
        done: list[SeqChunk] = []
        try:
            for c in chunks:
                self.blocks.ensure(c.seq, c.start + len(c.tokens))
                done.append(c)
        except BaseException:
            self.rollback(done)
            raise

    def rollback(self, chunks: Sequence[SeqChunk]) -> None:
        """Undo `prepare`'s growth (for a caller whose step failed after prepare)."""
        for c in chunks:
            self.blocks.truncate(c.seq, c.start)

    def prepare(self, chunks: Sequence[SeqChunk]) -> StepInputs:
        """Validate, grow the block tables, and build the step's index tensors.

        Raises ValueError (changing nothing) for a bad batch. A caller that runs the step
        itself and fails afterwards calls `rollback(chunks)`.
        """
        if not chunks:
            raise ValueError("empty batch")
        self._validate(chunks)
        self._grow(chunks)
        try:
            return self._index_tensors(chunks)
        except BaseException:
            self.rollback(chunks)
            raise

    def _index_tensors(self, chunks: Sequence[SeqChunk]) -> StepInputs:
        maxq = max(len(c.tokens) for c in chunks)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_index: list[int] = []
        query_positions: list[int] = []
        unpad_index: list[int] = []
        tables: list[list[int]] = []
        logit_rows: list[int] = []
        for b, c in enumerate(chunks):
            n, row0 = len(c.tokens), len(token_ids)
            token_ids.extend(c.tokens)
            positions.extend(range(c.start, c.start + n))
            slots.extend(self.blocks.slots(c.seq, c.start, n))
            query_index.extend(list(range(row0, row0 + n)) + [0] * (maxq - n))
            query_positions.extend(list(range(c.start, c.start + n)) + [0] * (maxq - n))
            unpad_index.extend(range(b * maxq, b * maxq + n))
            tables.append(self.blocks.table(c.seq))
            logit_rows.extend(range(row0 + n - c.num_logits, row0 + n))
        mb = max(len(t) for t in tables)
        padded_tables = [t + [0] * (mb - len(t)) for t in tables]

        def longs(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        b = len(chunks)
        return StepInputs(
            token_ids=longs(token_ids),  # [T]
            positions=longs(positions),  # [T]
            slots=longs(slots),  # [T]
            query_index=longs(query_index).view(b, maxq),  # [B, maxq]
            query_positions=longs(query_positions).view(b, maxq),  # [B, maxq]
            unpad_index=longs(unpad_index),  # [T]
            block_tables=longs(padded_tables).view(b, mb),  # [B, MB]
            logit_rows=longs(logit_rows),  # [R]
            logit_counts=tuple(c.num_logits for c in chunks),
        )

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], stop: StopCheck | None = None) -> list[torch.Tensor]:
        """Append every chunk in one forward; per chunk, float32 CPU logits [num_logits, V].
        An eager step asks `stop()` between layers; a graph replay (short by design) does not."""
        bucket = self._bucket(chunks)
        if bucket is not None:
            return self._forward_graph(chunks, bucket)
        inputs = self.prepare(chunks)
        try:
            logits = run_step(self.weights, self.pool, inputs, self.arch, stop, self.fused, self.c_attention)  # [R, V]
        except BaseException:
            self.rollback(chunks)
            raise
        logits = logits.float().cpu()  # [R, V]
        return list(logits.split(list(inputs.logit_counts)))  # per chunk [num_logits, V]

    # -- a step as a graph --------------------------------------------------------------
    def _bucket(self, chunks: Sequence[SeqChunk]):
        """The graph bucket this step runs in; None = eagerly (no graphs, or no bucket fits)."""
        if self.graphs is None or not chunks:
            return None
        tokens = max(len(c.tokens) for c in chunks)
        blocks = max(-(-(c.start + len(c.tokens)) // self.pool.block_size) for c in chunks)
        bucket = pick_bucket(self.graphs.cfg, self.max_blocks, len(chunks), tokens, blocks)
        return bucket if bucket is not None and self.graphs.has_room(bucket) else None

    def _forward_graph(self, chunks: Sequence[SeqChunk], bucket) -> list[torch.Tensor]:
        self._validate(chunks)
        self._grow(chunks)
        try:
            rows = pad_rows(bucket, [(c.tokens, c.start, self.blocks.slots(c.seq, c.start, len(c.tokens)),
                                      self.blocks.table(c.seq), c.num_logits) for c in chunks], self.scratch_slot)
            logits = self.graphs.run(bucket, rows, self._graph_step)  # [R, V]
        except BaseException:
            self.rollback(chunks)
            raise
        logits = logits.float().cpu()  # [R, V]
        return list(logits.split([c.num_logits for c in chunks]))  # per chunk [num_logits, V]

    def _graph_step(self, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        """The step over a bucket's static buffers (captured as is): logits for every row."""
        batch, blocks = buffers["block_tables"].shape
        rows = buffers["token_ids"].shape[0]
        every_row = torch.arange(rows, device=self.device)  # [batch*tokens]
        inputs = StepInputs(
            token_ids=buffers["token_ids"], positions=buffers["positions"], slots=buffers["slots"],
            query_index=every_row.view(batch, rows // batch),  # [batch, tokens]
            query_positions=buffers["positions"].view(batch, rows // batch),  # [batch, tokens]
            unpad_index=every_row, block_tables=buffers["block_tables"], logit_rows=every_row,
            logit_counts=(rows,))
        return run_step(self.weights, self.pool, inputs, self.arch)  # [batch*tokens, V]

    def truncate(self, seq: int, length: int) -> None:
        """Drop positions >= length; whole tail blocks go back to the pool (stale slots get overwritten)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        self.blocks.truncate(seq, length)

    def free(self, seq: int) -> None:
        self.blocks.free(seq)
