"""specdec's CPU matmul kernels (specdec.serving.cpu_gemm): the float32 kernel equals torch's
matmul to rounding and gives a row the same bits whatever rows share the call; the 4- and 8-bit
kernels compute exactly the quantized arithmetic they document; where a kernel cannot be built
the runner uses torch's matmul."""
from __future__ import annotations

import logging
import platform
import shutil

import pytest
import torch

from specdec.serving import cpu_gemm
from specdec.serving.cpu_gemm import (GROUP, PANEL, CodesF32Weight, PackedF32Weight, PackedInt4Weight, PackedInt8Weight,
                                     PackedQ8Weight)

BUILDABLE = platform.machine().lower() in ("x86_64", "amd64") and cpu_gemm._compiler() is not None


FLAGS = set(cpu_gemm._cpu_signature().split())  # what the kernels are built for
needs_skinny = pytest.mark.skipif(not (BUILDABLE and {"avx2", "fma"} <= FLAGS),
                                  reason="skinny_gemm.c needs x86-64 with AVX2 and FMA, and a C compiler")
needs_avx512 = pytest.mark.skipif(not (BUILDABLE and {"avx512f", "f16c"} <= FLAGS),
                                  reason="skinny_dequant.c needs AVX-512 and a C compiler")
needs_vnni = pytest.mark.skipif(not (BUILDABLE and {"avx512f", "avx512bw", "avx512_vnni"} <= FLAGS),
                                reason="int4_gemm.c needs AVX-512 VNNI and a C compiler")


@needs_skinny
def test_the_kernels_build_on_a_cpu_that_has_what_they_need():
    assert cpu_gemm.skinny() is not None


@needs_vnni
def test_the_lowbit_kernel_builds_on_a_vnni_cpu():
    assert cpu_gemm.lowbit() is not None


@needs_skinny
@pytest.mark.parametrize("k, n", [(64, 16), (96, 80), (576, 192)])
def test_packed_f32_is_torch_matmul_and_row_independent(k, n):
    """Every row count from 1 to past two tiles: close to x @ w, and each row's bits equal the
    same row computed alone (so a verify's logits equal one-token decodes' in the linear layers)."""
    torch.manual_seed(k + n)
    w = torch.randn(k, n)  # [in, out]
    pw = PackedF32Weight.pack(w)
    assert (pw.in_features, pw.out_features) == (k, n)
    assert torch.equal(pw.dense(), w)
    x = torch.randn(30, k)  # [T, in]
    alone = torch.cat([pw.matmul(x[i:i + 1]) for i in range(30)])  # [30, out]
    torch.testing.assert_close(alone, x.double().matmul(w.double()).float(), rtol=1e-5, atol=1e-4)
    for rows in (*range(1, 16), 24, 25, 30):
        got = pw.matmul(x[:rows])
        assert got.shape == (rows, n) and torch.equal(got, alone[:rows]), rows
    assert pw.matmul(x[:0]).shape == (0, n)
    shuffled = torch.randperm(30)
    assert torch.equal(pw.matmul(x[shuffled]), alone[shuffled])


@needs_skinny
def test_packed_f32_columns_are_a_tied_embedding():
    w = torch.randn(32, 48)  # [hidden, V]
    ids = torch.tensor([0, 47, 5, 16, 5])
    assert torch.equal(PackedF32Weight.pack(w).columns(ids), w[:, ids].t())


def test_packing_refuses_what_the_kernels_cannot_take():
    with pytest.raises(ValueError, match="multiple of 16"):
        PackedF32Weight.pack(torch.randn(32, 40))
    with pytest.raises(ValueError, match="float32"):
        PackedF32Weight.pack(torch.randn(32, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="divisible"):
        PackedInt4Weight.quantize(torch.randn(40, 48))
    with pytest.raises(ValueError, match="divisible"):
        PackedInt8Weight.quantize(torch.randn(64, 40))
    with pytest.raises(ValueError, match="divisible"):
        PackedQ8Weight.quantize(torch.randn(40, 48))
    with pytest.raises(ValueError, match="activation bits"):
        PackedInt4Weight.quantize(torch.randn(64, 48), act_bits=4)


def _activations(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """x [T, in] -> what the kernel multiplies: each row's groups of GROUP rounded to 255 levels
    (8 bits) or 65,535 (16 bits)."""
    top = 127.0 if bits == 8 else 32767.0
    g = x.float().view(x.shape[0], -1, GROUP)  # [T, in/G, G]
    amax = g.abs().amax(-1, keepdim=True)  # [T, in/G, 1]
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return (torch.round(g * inv) * (amax / top)).view_as(x)  # [T, in]


LOWBIT_KINDS = [(PackedInt4Weight, 8), (PackedInt4Weight, 16), (PackedInt8Weight, 8), (PackedQ8Weight, 8),
                (PackedQ8Weight, 16)]


def _quantize(kind, w: torch.Tensor, bits: int):
    return kind.quantize(w) if kind is PackedInt8Weight else kind.quantize(w, bits)


@needs_vnni
@pytest.mark.parametrize("kind,bits", LOWBIT_KINDS)
def test_lowbit_weights_compute_the_quantized_arithmetic(kind, bits):
    """The codes stand for a matrix near w (half a level; float16 scales add their rounding); the
    matmul is that matrix against activations rounded to `bits` bits per group, to float
    rounding; a row's bits do not depend on the rows beside it; bfloat16 in gives that result
    rounded to bfloat16."""
    torch.manual_seed(3)
    k, n = 128, 96
    w = torch.randn(k, n)  # [in, out]
    qw = _quantize(kind, w, bits)
    assert (qw.in_features, qw.out_features) == (k, n)
    dense = qw.dense()  # [in, out]
    groups = w.t().reshape(n, -1, GROUP)  # [out, in/G, G]
    if kind is PackedInt4Weight:  # half a level, and float16's rounding of d and lo (|lo| + 15 d <= 2 max |w|)
        level = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(GROUP, 1).t()  # [in, out]
        slack = (2 * 2 ** -11 * 2 * groups.abs().amax(-1)).repeat_interleave(GROUP, 1).t()  # [in, out]
    elif kind is PackedQ8Weight:  # half a level of the group, and float16's rounding of d
        level = (groups.abs().amax(-1) / 127).repeat_interleave(GROUP, 1).t()  # [in, out]
        slack = (2 ** -11 * groups.abs().amax(-1)).repeat_interleave(GROUP, 1).t()
    else:
        level, slack = (w.abs().amax(0) / 127).expand(k, n), 0
    assert bool(((dense - w).abs() <= level / 2 + slack + 1e-5).all())
    x = torch.randn(20, k)  # [T, in]
    want = _activations(x, bits).double().matmul(dense.double())  # [T, out]
    got = qw.matmul(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-3)
    if bits == 16:  # 16-bit activations: the float32 matmul, to well under int8's rounding
        torch.testing.assert_close(got.double(), x.double().matmul(dense.double()), rtol=1e-4, atol=2e-3)
    alone = torch.cat([qw.matmul(x[i:i + 1]) for i in range(20)])
    for rows in (1, 2, 3, 5, 6, 7, 13, 20):
        assert torch.equal(qw.matmul(x[:rows]), alone[:rows]), rows
    xb = x.bfloat16()
    gb = qw.matmul(xb)
    assert gb.dtype == torch.bfloat16
    assert torch.equal(gb, qw.matmul(xb.float()).bfloat16())  # the float32 result, rounded to nearest even


def _gguf_grids(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[in, out] float32 matrices as a GGUF's Q4_1 and Q8_0 blocks dequantize (float16 d and m)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // GROUP, generator=g) * 0.02 + 1e-3).half().float()  # [out, in/G]
    m = (torch.randn(n, k // GROUP, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans its whole range, as the quantizer leaves it
    w4 = (q * d.unsqueeze(-1) + m.unsqueeze(-1)).view(n, k).t()  # [in, out]
    c = torch.randint(-127, 128, (n, k // GROUP, GROUP), generator=g).float()
    c[..., 0] = 127 * torch.where(torch.rand(n, k // GROUP, generator=g) < 0.5, 1.0, -1.0)  # |c| max is 127
    w8 = (c * d.unsqueeze(-1)).view(n, k).t()  # [in, out]
    return w4.contiguous(), w8.contiguous()


def test_gguf_grids_come_back_exactly():
    """A matrix dequantized from a GGUF's Q4_1 (w = d q + m) or Q8_0 (w = d c) blocks, float16 d
    and m, is packed with its own codes and scales: dense() gives back every value bit for bit
    (so the int4 draft of the shipped SmolLM2 holds the fp32 target's weights exactly)."""
    w4, w8 = _gguf_grids(64, 32, 5)
    assert torch.equal(PackedInt4Weight.quantize(w4).dense(), w4)
    q8 = PackedQ8Weight.quantize(w8)
    assert torch.equal(q8.dense(), w8)
    ids = torch.tensor([0, 31, 7, 16, 7])
    assert torch.equal(q8.columns(ids), w8[:, ids].t())  # a tied embedding's rows, float32
    assert torch.equal(PackedInt4Weight.quantize(w4).columns(ids), w4[:, ids].t())


@needs_avx512
@pytest.mark.parametrize("k, n", [(64, 16), (96, 80), (576, 192)])
def test_codes_f32_gives_the_float32_kernels_bits(k, n):
    """A matrix on a Q4_1 or Q8_0 grid is kept as its codes; its matmul equals the float32
    kernel's on the same matrix bit for bit for every row count (the in-register tiles up to 12
    rows, the dequantized-panel path beyond), so a target read from codes computes the same logits
    and a verify's rows still equal one-token decodes."""
    w4, w8 = _gguf_grids(k, n, k + n)
    x = torch.randn(30, k)  # [T, in]
    for w, kind in ((w4, PackedInt4Weight), (w8, PackedQ8Weight)):
        cw = CodesF32Weight.of(w)
        assert cw is not None and isinstance(cw.codes, kind)
        assert (cw.in_features, cw.out_features) == (k, n) and torch.equal(cw.dense(), w)
        ref = PackedF32Weight.pack(w)
        for rows in (*range(1, 16), 24, 25, 30):
            assert torch.equal(cw.matmul(x[:rows]), ref.matmul(x[:rows])), (kind.__name__, rows)
        assert cw.matmul(x[:0]).shape == (0, n)
        ids = torch.tensor([0, n - 1, 5, 16 % n, 5])
        assert torch.equal(cw.columns(ids), w[:, ids].t())  # a tied embedding's rows
        assert sum(t.nbytes for t in cw.storages()) * 3 < w.nbytes  # 5 or 8.5 bits a weight, not 32


def test_codes_f32_keeps_only_matrices_its_codes_give_back():
    """A matrix off the grids (one weight nudged by an ulp, random values, the wrong shape or
    dtype) is not kept as codes: None, and the runner packs it in float32."""
    w4, w8 = _gguf_grids(64, 32, 3)
    for at in ((7, 9), (50, 27)):  # in the first panel (refused by its quick check), and past it
        nudged = w4.clone()
        nudged[at] = torch.nextafter(nudged[at], torch.tensor(1.0))
        assert CodesF32Weight.of(nudged) is None
    # quantize(exact=True) keeps exactly the matrices whose codes' dense() gives them back
    for w, kind in ((w4, PackedInt4Weight), (w8, PackedQ8Weight)):
        for m in (w, w.clone().index_put_((torch.tensor([50]), torch.tensor([27])), w[50, 27] * (1 + 2 ** -20)),
                  torch.randn(64, 32)):
            assert (kind.quantize(m, exact=True) is not None) == torch.equal(kind.quantize(m).dense(), m)
    assert CodesF32Weight.of(torch.randn(64, 32)) is None
    assert CodesF32Weight.of(w4[:, :24]) is None and CodesF32Weight.of(w4[:40]) is None
    assert CodesF32Weight.of(w4.bfloat16()) is None


def test_a_kernel_that_cannot_be_built_is_none_with_the_reason(monkeypatch, tmp_path, caplog):
    """Not x86, a CPU without the instructions, no compiler, or a build that fails: None and a log line (the runner then uses
    torch's matmul); nothing half-written is left in the cache."""
    build = cpu_gemm._build.__wrapped__
    caplog.set_level(logging.INFO, logger=cpu_gemm.__name__)
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert build("skinny_gemm") is None and "x86-64" in caplog.text
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert build("skinny_gemm", ("avx2", "no_such_flag")) is None and "lacks no_such_flag" in caplog.text
    monkeypatch.setattr(cpu_gemm, "_compiler", lambda: None)
    assert build("skinny_gemm") is None and "no C compiler" in caplog.text
    if shutil.which("cc") is None:
        return
    monkeypatch.setattr(cpu_gemm, "_compiler", lambda: shutil.which("cc"))
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(cpu_gemm, "CSRC", tmp_path)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    assert build("broken") is None and "does not build" in caplog.text
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_the_runner_falls_back_to_torch_matmul_without_the_kernel(monkeypatch):
    """cpu_kernels = specdec where the kernels are missing: plain tensors and SDPA, the same
    logits as cpu_kernels = torch. An unknown cpu_kernels is refused."""
    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import PagedLlamaRunner
    from tests.test_paged_llama import tiny_model

    model = tiny_model("llama")
    monkeypatch.setattr(cpu_gemm, "skinny", lambda: None)
    monkeypatch.setattr(cpu_gemm, "lowbit", lambda: None)  # the 4-bit, attention and fused kernels
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4)
    assert isinstance(r.weights.lm_head, torch.Tensor) and isinstance(r.weights.layers[0].qkv, torch.Tensor)
    r4 = PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4, int4=True)
    assert r4.fused is None
    assert not isinstance(r4.weights.layers[0].qkv, PackedInt4Weight)
    rt = PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4, cpu_kernels="torch")
    toks = [3, 9, 27, 81, 15]
    (a,) = r.forward([SeqChunk(r.blocks.reserve(8), toks, 0, len(toks))])
    (b,) = rt.forward([SeqChunk(rt.blocks.reserve(8), toks, 0, len(toks))])
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cpu_kernels"):
        PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4, cpu_kernels="mkl")


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_is_softmax_attention_row_by_row(dtype, window):
    """Each row attends to its own sequence's keys 0..pos (the last `window` of them) through
    its block table, GQA; the float64 reference to rounding; a row's bits alone == in a batch."""
    torch.manual_seed(7)
    bs, hkv, g, d = 4, 3, 3, 64
    k, v = torch.randn(160, hkv, d).to(dtype), torch.randn(160, hkv, d).to(dtype)  # [S, Hkv, D]
    tables = torch.tensor([[5, 2, 9, 11, 30, 0], [7, 3, 1, 0, 0, 0]])  # [B, MB]
    seq, pos = torch.tensor([0] * 9 + [1]), torch.tensor([*range(10, 19), 6])  # [T]
    q = torch.randn(10, hkv * g, d).to(dtype)  # [T, Hq, D]
    scratch = cpu_gemm.attention_scratch(24, hkv * g)
    got = cpu_gemm.paged_attention(q, k, v, tables, bs, seq, pos, window, d ** -0.5, scratch)  # [T, Hq*D]
    assert got.dtype == dtype and got.shape == (10, hkv * g * d)
    for t in range(10):
        b, p = int(seq[t]), int(pos[t])
        keys = range(0 if window is None else max(0, p - window + 1), p + 1)
        slots = torch.tensor([int(tables[b][j // bs]) * bs + j % bs for j in keys])
        kk, vv = k[slots].double(), v[slots].double()  # [n, Hkv, D]
        want = torch.cat([torch.softmax(kk[:, h // g] @ q[t, h].double() * d ** -0.5, 0) @ vv[:, h // g]
                          for h in range(hkv * g)])  # [Hq*D]
        tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # bf16: the output's rounding
        torch.testing.assert_close(got[t].double(), want, rtol=tol, atol=tol)
        alone = cpu_gemm.paged_attention(q[t:t + 1], k, v, tables, bs, seq[t:t + 1], pos[t:t + 1], window,
                                         d ** -0.5, scratch)
        assert torch.equal(alone[0], got[t])


@needs_skinny
def test_the_float32_runner_packs_by_default():
    """The default fp32 runner packs every matmul weight (a tied embedding reads the packed head)
    and, with the VNNI library, attends in specdec's kernel; its logits are torch's to rounding;
    a verify's rows equal one-token decodes bit for bit (with SDPA, within attention's rounding:
    the matmuls add none)."""
    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import PagedLlamaRunner
    from tests.test_paged_llama import tiny_model

    model = tiny_model("llama")
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=4)
    assert isinstance(r.weights.lm_head, PackedF32Weight) and r.weights.embed is r.weights.lm_head
    assert all(isinstance(getattr(lw, m), PackedF32Weight) for lw in r.weights.layers
               for m in ("qkv", "o", "gate_up", "down"))
    assert r.fused is None and r.c_attention == (cpu_gemm.lowbit() is not None)
    rt = PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=4, cpu_kernels="torch")
    assert not rt.c_attention
    assert r.facts.weight_bytes == rt.facts.weight_bytes
    toks = [5, 17, 33, 2, 99, 64, 8, 120, 1]
    sv, sd = r.blocks.reserve(12), r.blocks.reserve(12)
    (verify,) = r.forward([SeqChunk(sv, toks, 0, len(toks))])  # [9, V]
    decodes = [r.forward([SeqChunk(sd, [t], i, 1)])[0] for i, t in enumerate(toks)]
    torch.testing.assert_close(verify, torch.cat(decodes), rtol=0, atol=0 if r.c_attention else 1e-5)
    (ref,) = rt.forward([SeqChunk(rt.blocks.reserve(12), toks, 0, len(toks))])
    torch.testing.assert_close(verify, ref, rtol=1e-5, atol=1e-4)


@needs_avx512
def test_the_float32_runner_reads_a_gguf_models_codes():
    """A float32 model dequantized from a GGUF (its layers on the Q4_1 grid, its tied head on
    Q8_0, as the default target) is read from its codes by default: the logits of
    cpu_kernels = specdec-f32 (every matrix in float32 panels) bit for bit, a verify's rows equal
    one-token decodes, and under a third of the weight bytes."""
    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import PagedLlamaRunner
    from tests.test_paged_llama import tiny_model

    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (m for m in layer.modules() if isinstance(m, torch.nn.Linear)):
                lin.weight.copy_(PackedInt4Weight.quantize(lin.weight.t()).dense().t())
        head = model.get_output_embeddings().weight  # [V, hidden], tied to the embedding
        head.copy_(PackedQ8Weight.quantize(head.t()).dense().t())
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=4)
    rf = PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=4, cpu_kernels="specdec-f32")
    assert isinstance(r.weights.lm_head, CodesF32Weight) and isinstance(r.weights.lm_head.codes, PackedQ8Weight)
    assert r.weights.embed is r.weights.lm_head
    assert all(isinstance(getattr(lw, m), CodesF32Weight) and isinstance(getattr(lw, m).codes, PackedInt4Weight)
               for lw in r.weights.layers for m in ("qkv", "o", "gate_up", "down"))
    assert isinstance(rf.weights.lm_head, PackedF32Weight)
    assert r.facts.weight_bytes * 3 < rf.facts.weight_bytes
    toks = [5, 17, 33, 2, 99, 64, 8, 120, 1, 7, 7, 42, 3, 90, 11]  # past the 12-row in-register tiles
    sv, sd, sf = r.blocks.reserve(16), r.blocks.reserve(16), rf.blocks.reserve(16)
    (verify,) = r.forward([SeqChunk(sv, toks, 0, len(toks))])  # [15, V]
    (ref,) = rf.forward([SeqChunk(sf, toks, 0, len(toks))])
    assert torch.equal(verify, ref)
    decodes = [r.forward([SeqChunk(sd, [t], i, 1)])[0] for i, t in enumerate(toks)]
    torch.testing.assert_close(verify, torch.cat(decodes), rtol=0, atol=0 if r.c_attention else 1e-5)


@needs_vnni
@pytest.mark.parametrize("head,bits", [("int8", 8), ("q8_0", 16)])
def test_the_int4_runner_runs_small_steps_in_the_fused_kernel(head, bits):
    """An int4 runner's steps of at most FUSED_ROWS tokens run every layer in one C call
    (fused_int4.c), larger ones in torch ops: the same logits to bf16 rounding, the same argmax;
    in the fused kernel a row's logits do not depend on the rows beside it; a model it does not
    take (biases: qwen2) keeps the torch path. With the q8_0 head the (tied) embedding is the
    head's own float32 rows."""
    import random

    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import FUSED_ROWS, PagedLlamaRunner
    from tests.test_paged_llama import rand_tokens, tiny_model

    model = tiny_model("llama")
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=32, block_size=4, int4=True, int4_head=head,
                                       int4_activations=bits)
    assert r.fused is not None and r.fused.max_rows == FUSED_ROWS
    assert r.fused.model.xbits == bits and r.weights.layers[0].qkv.act_bits == bits
    if head == "q8_0":
        assert isinstance(r.weights.lm_head, PackedQ8Weight) and r.weights.small_head is None
        assert r.weights.embed is r.weights.lm_head or not model.config.tie_word_embeddings
    rng = random.Random(11)
    a, b = rand_tokens(rng, 12), rand_tokens(rng, 9)
    sa, sb = r.blocks.reserve(16), r.blocks.reserve(16)
    r.forward([SeqChunk(sa, a[:9], 0, 0), SeqChunk(sb, b[:6], 0, 0)])  # 15 tokens: torch ops
    fused = r.fused
    (alone,) = r.forward([SeqChunk(sa, a[9:], 9, 3)])  # 3 tokens: fused
    r.truncate(sa, 9)
    r.fused = None
    (torch_ops,) = r.forward([SeqChunk(sa, a[9:], 9, 3)])  # the same step in torch ops
    r.truncate(sa, 9)
    r.fused = fused
    assert not torch.equal(alone, torch_ops)  # two computations (float32 against bf16 activations) ...
    torch.testing.assert_close(alone.float(), torch_ops.float(), rtol=0.03, atol=0.03)  # ... of one thing
    assert torch.equal(alone.argmax(-1), torch_ops.argmax(-1))
    beside, _ = r.forward([SeqChunk(sa, a[9:], 9, 3), SeqChunk(sb, b[6:7], 6, 1)])  # 4 tokens: fused
    assert torch.equal(beside, alone)

    rq = PagedLlamaRunner.from_hf_model(tiny_model("qwen2"), num_blocks=8, block_size=4, int4=True)
    assert rq.fused is None


@needs_vnni
@pytest.mark.slow
def test_the_default_draft_agrees_with_the_fp32_target_on_the_shipped_model():
    """The draft service's int4 runner (DraftConfig's defaults: the shipped Q4_1 codes and Q8_0
    head as stored, 16-bit activations) picks the fp32 target's next token at (nearly) every
    position of a real prompt, where int8 activations and a per-row int8 head miss several in a
    hundred (BENCHMARKS §6q: 862 of 862 against 96.5%)."""
    from specdec import hf_compat, models
    from specdec.config import DraftConfig, TargetConfig
    from specdec.lab.steps import argmax_per_position
    from specdec.lab.workloads import mixed_workload
    from specdec.serving.runners import load_runner

    def runner(cfg):
        cfg.kv_pool_tokens, cfg.max_sessions = 512, 2
        return load_runner(cfg, "cpu")

    target = runner(TargetConfig())
    draft = runner(DraftConfig(engine="torch"))
    old = runner(DraftConfig(engine="torch", int4_head="int8", int4_activations=8))
    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    ids = hf_compat.chat_token_ids(tok, mixed_workload(1, 0)[0].messages)[:200]
    ref = argmax_per_position(target, ids)
    agree = float((argmax_per_position(draft, ids) == ref).float().mean())
    agree_old = float((argmax_per_position(old, ids) == ref).float().mean())
    print(f"\ndraft top-1 agreement with the fp32 target over {len(ids)} positions: {agree:.4f} "
          f"(int8 activations, int8 head: {agree_old:.4f})")
    assert agree >= 0.99 and agree >= agree_old


@needs_avx512
@pytest.mark.slow
def test_the_default_target_reads_its_codes_and_gives_the_float32_logits():
    """The target service's runner on the shipped model (TargetConfig's defaults) holds every
    decoder matrix as Q4_1 codes and its head as Q8_0 codes, and its logits over a real prompt,
    in 9-token verifies, equal those of the same model in float32 panels bit for bit."""
    from specdec import hf_compat, models
    from specdec.config import TargetConfig
    from specdec.lab.workloads import mixed_workload
    from specdec.serving.batch import SeqChunk
    from specdec.serving.runners import load_runner

    def runner(cfg):
        cfg.kv_pool_tokens, cfg.max_sessions = 512, 2
        return load_runner(cfg, "cpu")

    codes, panels = runner(TargetConfig()), runner(TargetConfig(cpu_kernels="specdec-f32"))
    assert all(isinstance(m, CodesF32Weight) for m in codes.weights.matrices())
    assert isinstance(codes.weights.lm_head.codes, PackedQ8Weight)
    assert codes.facts.weight_bytes * 5 < panels.facts.weight_bytes
    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    ids = hf_compat.chat_token_ids(tok, mixed_workload(1, 0)[0].messages)[:120]
    sc, sp = codes.blocks.reserve(128), panels.blocks.reserve(128)
    for i in range(0, len(ids), 9):
        chunk = ids[i:i + 9]
        (a,) = codes.forward([SeqChunk(sc, chunk, i, len(chunk))])
        (b,) = panels.forward([SeqChunk(sp, chunk, i, len(chunk))])
        assert torch.equal(a, b), i
