"""PagedLlamaRunner: batched paged forward == transformers, block accounting, bad calls."""
from __future__ import annotations

import random

import pytest
import torch

from specdec import hf_compat
from specdec.serving.batch import SeqChunk, StepAborted
from specdec.serving.graphs import GraphConfig, eager_capture
from specdec.serving import cpu_gemm
from specdec.serving.cpu_gemm import PackedInt4Weight, PackedInt8Weight
from specdec.serving.int4 import GROUP, Int4Weight, Int8Weight
from specdec.serving.paged_llama import SMALL_HEAD_ROWS, PagedLlamaRunner, supports

VOCAB = 128
ATOL = 1e-4


def tiny_model(kind: str, seed: int = 0, windowed: bool = True):
    """2 layers, hidden 64, 4 q heads, 2 kv heads (D = 16), vocab 128, random weights.

    windowed=False: the same weights without the sliding window (qwen3, mistral)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if kind == "llama":  # tied embeddings, llama3 rope scaling
        cfg = LlamaConfig(**common, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32})
        cls = LlamaForCausalLM
    elif kind == "qwen2":  # q/k/v bias
        cfg, cls = Qwen2Config(**common, tie_word_embeddings=False), Qwen2ForCausalLM
    elif kind == "qwen3":  # per-head q_norm / k_norm; layer 1 sliding (window 6), layer 0 full
        cfg = Qwen3Config(**common, tie_word_embeddings=False, use_sliding_window=windowed, sliding_window=6,
                          max_window_layers=1)
        cls = Qwen3ForCausalLM
    elif kind == "mistral":  # every layer sliding, window 7
        cfg = MistralConfig(**common, tie_word_embeddings=False, sliding_window=7 if windowed else None)
        cls = MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if kind == "qwen2":  # random init leaves biases at 0: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    if kind == "qwen3":  # norms initialise to 1: make the per-head weights matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


KINDS = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=KINDS)
def model(request):
    return tiny_model(request.param)


@torch.inference_mode()
def reference(model, tokens: list[int]) -> torch.Tensor:
    """Unbatched, uncached transformers forward of a whole sequence: [n, V] float32."""
    return model(input_ids=torch.tensor([tokens])).logits[0].float()


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ------------------------------------------------------------------------------------
def test_supports():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig

    assert all(supports(tiny_model(k).config) for k in KINDS)
    assert hf_compat.rope_type(tiny_model("llama").config) == "llama3"  # the tables come from HF's rotary
    assert not supports(GPT2Config())
    dynamic = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    assert not supports(dynamic)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="does not support"):
        PagedLlamaRunner.from_hf_model(gpt2)


def test_facts_and_pool(model):
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=10, block_size=4, max_seqs=3)
    f = r.facts
    assert f.engine == "torch" and f.fingerprint == f"vocab-{VOCAB}" and f.vocab_size == VOCAB
    assert f.max_context == 40  # min(max_position_embeddings 256, pool 10 * 4)
    assert f.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, D, fp32
    assert r.pool.k.shape == (2, 44, 2, 16) and r.pool.k.dtype == torch.float32  # + the scratch block
    assert r.scratch_slot == 40
    assert not r.pool.k.any() and not r.pool.v.any()
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    # the extracted weights: the model's, plus Qwen3's q/k norms repeated per head (a few hundred bytes)
    assert sum(params.values()) <= f.weight_bytes <= sum(params.values()) + 1024
    assert r.blocks.stats().num_blocks == 10 and r.blocks.max_seqs == 3


def test_prefill_matches_transformers(model):
    rng = random.Random(1)
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=16, block_size=8)
    tokens = rand_tokens(rng, 37)
    seq = r.blocks.reserve(40)
    (logits,) = r.forward([SeqChunk(seq, tokens, 0, len(tokens))])
    assert logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape == (37, VOCAB)
    torch.testing.assert_close(logits, reference(model, tokens), atol=ATOL, rtol=0)
    assert r.blocks.length(seq) == 37 and len(r.blocks.table(seq)) == 5


def test_sliding_window_matters():
    """The windowed models differ from the same weights with full attention at these lengths,
    so the prefill and mixed-batch tests do test the window mask."""
    tokens = rand_tokens(random.Random(2), 20)
    for kind in ("qwen3", "mistral"):
        windowed, full = tiny_model(kind), tiny_model(kind, windowed=False)
        assert not torch.allclose(reference(windowed, tokens), reference(full, tokens), atol=1e-3)
        r = PagedLlamaRunner.from_hf_model(full, num_blocks=8, block_size=4)
        assert r.arch.windows == (None, None)
        seq = r.blocks.reserve(20)
        (got,) = r.forward([SeqChunk(seq, tokens, 0, 20)])
        torch.testing.assert_close(got, reference(full, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_mixed_batches_with_rollback(model, graphs):
    """Chunked prefills, k+1 verifies, single-token decodes and rollbacks, all in shared steps.
    With graphs (replayed eagerly here: graphs.eager_capture), steps of up to 4 sequences x 8
    tokens are padded to buckets; steps of 5 sequences run eagerly; both match transformers."""
    rng = random.Random(7)
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=80, block_size=4, max_seqs=8)
    if graphs:
        r.enable_graphs(GraphConfig(batches=(1, 2, 4), tokens=(1, 2, 4, 8), min_blocks=2), eager_capture)
    steps = 0
    truth: dict[int, list[int]] = {}  # what each sequence's cache holds
    pending: dict[int, list[int]] = {}  # prompt tokens not fed yet
    checked = 0
    for step in range(10):
        if len(truth) < 5:  # admit a new sequence
            seq = r.blocks.reserve(60)
            truth[seq], pending[seq] = [], rand_tokens(rng, rng.randrange(3, 25))
        chunks, expect = [], []
        for seq in list(truth):
            if rng.random() < 0.2:
                continue  # sits this step out
            start = len(truth[seq])
            if pending[seq]:  # prefilling, in chunks of up to 8; logits only at the end
                n = min(len(pending[seq]), rng.randrange(1, 9))
                new, pending[seq] = pending[seq][:n], pending[seq][n:]
                num_logits = 0 if pending[seq] else 1
            elif rng.random() < 0.5:  # verify k+1 tokens, all logits
                new = rand_tokens(rng, rng.randrange(2, 7))
                num_logits = len(new)
            else:  # a single-token decode
                new, num_logits = rand_tokens(rng, 1), 1
            if start + len(new) > 60:
                r.free(seq)
                del truth[seq], pending[seq]
                continue
            chunks.append(SeqChunk(seq, new, start, num_logits))
            truth[seq] = truth[seq] + new
            expect.append((seq, num_logits))
        if not chunks:
            continue
        outs = r.forward(chunks)
        steps += 1
        for (seq, num_logits), got in zip(expect, outs):
            assert got.shape == (num_logits, VOCAB)
            if num_logits:
                ref = reference(model, truth[seq])[len(truth[seq]) - num_logits:]
                torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
                checked += num_logits
        for c in chunks:  # roll back some of what verifies appended; different tokens come next
            if c.num_logits > 1 and not pending[c.seq]:
                keep = len(truth[c.seq]) - rng.randrange(0, c.num_logits)
                r.truncate(c.seq, keep)
                truth[c.seq] = truth[c.seq][:keep]
                assert r.blocks.length(c.seq) == keep
                assert len(r.blocks.table(c.seq)) == r.blocks.blocks_for(keep)
    assert checked > 30
    if graphs:  # both paths ran: buckets of several shapes, and steps that fit none
        assert r.graphs.captured >= 3 and r.graphs.replays > r.graphs.captured
        assert r.graphs.replays < steps
    for seq in list(truth):
        r.free(seq)
    stats = r.blocks.stats()
    assert stats.used_blocks == 0 and stats.reserved_blocks == 0 and stats.sequences == 0


def test_block_accounting():
    model = tiny_model("llama")
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=40, block_size=4, max_seqs=6)
    rng = random.Random(3)
    seq = r.blocks.reserve(20)
    (none,) = r.forward([SeqChunk(seq, rand_tokens(rng, 10), 0, 0)])
    assert none.shape == (0, VOCAB)
    assert r.blocks.stats().used_blocks == 3 and r.blocks.stats().reserved_blocks == 5
    r.truncate(seq, 8)  # exactly two blocks: the third goes back
    assert r.blocks.stats().used_blocks == 2 and r.blocks.length(seq) == 8
    r.truncate(seq, 7)  # inside block 2: kept
    assert r.blocks.stats().used_blocks == 2
    r.truncate(seq, 4)
    assert r.blocks.stats().used_blocks == 1
    r.truncate(seq, 0)
    assert r.blocks.stats().used_blocks == 0
    r.free(seq)
    r.free(seq)  # a second free does nothing
    for _ in range(30):  # churn
        live = [r.blocks.reserve(rng.randrange(1, 25)) for _ in range(rng.randrange(1, 6))]
        chunks = [SeqChunk(s, rand_tokens(rng, rng.randrange(1, 5)), 0, 1) for s in live]
        r.forward(chunks)
        for s in live:
            if rng.random() < 0.5:
                r.truncate(s, rng.randrange(0, 3))
            r.free(s)
    stats = r.blocks.stats()
    assert (stats.used_blocks, stats.reserved_blocks, stats.sequences) == (0, 0, 0)


def test_bad_calls_raise_and_change_nothing():
    model = tiny_model("llama")
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=20, block_size=4, max_seqs=4)
    rng = random.Random(5)
    a, b = r.blocks.reserve(8), r.blocks.reserve(40)
    toks_a = rand_tokens(rng, 5)
    r.forward([SeqChunk(a, toks_a, 0, 1)])
    before = (r.blocks.stats(), r.blocks.length(a), r.blocks.table(a), r.blocks.length(b))
    bad = [
        ([SeqChunk(a, [1], 4, 1)], "cached"),  # start mismatch
        ([SeqChunk(b, [1, 2], 0, 1), SeqChunk(b, [3], 2, 1)], "twice"),
        ([SeqChunk(b, [1, 2], 0, 3)], "num_logits"),
        ([SeqChunk(b, [], 0, 0)], "empty"),
        ([SeqChunk(b, [VOCAB], 0, 1)], "token ids"),
        ([SeqChunk(99, [1], 0, 1)], "unknown"),
        ([SeqChunk(b, [1] * 41, 0, 1)], "reserved"),  # b reserved 40 tokens
        ([SeqChunk(b, [1] * 3, 0, 1), SeqChunk(a, [1] * 4, 5, 1)], "reserved"),  # a: 9 > 8; b rolled back
        ([SeqChunk(b, [1] * 81, 0, 1)], "context limit"),  # max_context = pool = 80 tokens
        ([], "empty batch"),
    ]
    for chunks, match in bad:
        with pytest.raises(ValueError, match=match):
            r.forward(chunks)
        assert (r.blocks.stats(), r.blocks.length(a), r.blocks.table(a), r.blocks.length(b)) == before
    # still correct afterwards
    more = rand_tokens(rng, 3)
    (got,) = r.forward([SeqChunk(a, more, 5, 3)])
    torch.testing.assert_close(got, reference(model, toks_a + more)[5:], atol=ATOL, rtol=0)


def test_a_stopped_step_keeps_nothing_and_the_runner_goes_on():
    """stop() is asked before every layer; when it says True the step is rolled back."""
    model = tiny_model("llama")
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=20, block_size=4, max_seqs=4)
    rng = random.Random(9)
    seq = r.blocks.reserve(40)
    toks = rand_tokens(rng, 6)
    r.forward([SeqChunk(seq, toks, 0, 1)])
    before = (r.blocks.stats(), r.blocks.length(seq), r.blocks.table(seq))
    asked = []

    def stop():
        asked.append(1)
        return len(asked) == 2  # stop before the second layer

    with pytest.raises(StepAborted, match="layer 1"):
        r.forward([SeqChunk(seq, rand_tokens(rng, 9), 6, 1)], stop=stop)
    assert len(asked) == 2
    assert (r.blocks.stats(), r.blocks.length(seq), r.blocks.table(seq)) == before
    more = rand_tokens(rng, 3)
    (got,) = r.forward([SeqChunk(seq, more, 6, 3)], stop=lambda: False)
    torch.testing.assert_close(got, reference(model, toks + more)[6:], atol=ATOL, rtol=0)


def test_bfloat16_runs():
    model = tiny_model("qwen3").to(torch.bfloat16)
    r = PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4)
    assert r.pool.k.dtype == torch.bfloat16 and r.facts.dtype == "bfloat16"
    tokens = rand_tokens(random.Random(4), 12)
    seq = r.blocks.reserve(12)
    (got,) = r.forward([SeqChunk(seq, tokens, 0, 12)])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, reference(model, tokens), atol=0.1, rtol=0.05)


def test_int4_weight_finds_a_4bit_grid_again():
    """A matrix already on 16 levels per group of 32 inputs (a Q4_1 GGUF, dequantized) comes back
    on the same levels: every error is under half a level (only bf16 rounds scale and zero)."""
    torch.manual_seed(0)
    k, n = 3 * GROUP, 48
    step = torch.rand(n, k // GROUP) * 0.03 + 0.02  # [out, in/G] the level spacing
    low = torch.randn(n, k // GROUP) * 0.1  # [out, in/G]
    codes = torch.randint(0, 16, (n, k // GROUP, GROUP)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans its whole range, as Q4_1 quantizes
    w = (codes * step[..., None] + low[..., None]).reshape(n, k).t().contiguous()  # [in, out]
    iw = Int4Weight.quantize(w)
    assert (iw.in_features, iw.out_features) == (k, n)
    err = (iw.dequantize() - w).abs()  # [in, out]
    half_level = step.repeat_interleave(GROUP, dim=1).t() / 2  # [in, out]
    assert bool((err < half_level).all()), float((err / half_level).max())
    assert float(err.max()) < 5e-3
    x = torch.randn(5, k, dtype=torch.bfloat16)
    torch.testing.assert_close(iw.matmul(x).float(), x.float() @ iw.dequantize(), atol=0.05, rtol=0.02)
    for bad in (torch.randn(GROUP + 1, 16), torch.randn(GROUP, 8)):
        with pytest.raises(ValueError, match="divisible"):
            Int4Weight.quantize(bad)


@pytest.mark.parametrize("cpu_kernels", ["specdec", "torch"])
def test_int4_runner_is_close_to_fp32_and_batches(cpu_kernels):
    """int4: 4-bit layers (specdec's kernel or torch's), bf16 elsewhere; near the fp32 model, and
    the same sequence gives (nearly) the same logits alone or next to others in one step."""
    model = tiny_model("llama")
    r32 = PagedLlamaRunner.from_hf_model(model, num_blocks=32, block_size=4)
    r4 = PagedLlamaRunner.from_hf_model(model, num_blocks=32, block_size=4, int4=True, cpu_kernels=cpu_kernels)
    assert r4.facts.dtype == "int4" and r4.pool.k.dtype == torch.bfloat16
    kind = PackedInt4Weight if cpu_kernels == "specdec" and cpu_gemm.lowbit() is not None else Int4Weight
    assert all(isinstance(getattr(lw, m), kind) for lw in r4.weights.layers for m in ("qkv", "o", "gate_up", "down"))
    assert r4.weights.embed.data_ptr() == r4.weights.lm_head.data_ptr()  # tied: one bf16 copy
    assert r4.facts.weight_bytes < r32.facts.weight_bytes / 2
    rng = random.Random(5)
    a, b = rand_tokens(rng, 21), rand_tokens(rng, 13)
    ref = reference(model, a)  # [21, V] fp32
    sa = r4.blocks.reserve(30)
    (alone,) = r4.forward([SeqChunk(sa, a, 0, len(a))])
    assert float((alone - ref).norm() / ref.norm()) < 0.15
    r4.free(sa)
    sa, sb = r4.blocks.reserve(30), r4.blocks.reserve(30)
    r4.forward([SeqChunk(sb, b[:5], 0, 0)])
    got_a, got_b = r4.forward([SeqChunk(sa, a, 0, len(a)), SeqChunk(sb, b[5:], 5, 8)])
    torch.testing.assert_close(got_a, alone, atol=0.05, rtol=0)
    assert got_b.shape == (8, VOCAB)


@pytest.mark.parametrize("cpu_kernels", ["specdec", "torch"])
def test_int8_head_is_within_half_a_level_and_serves_the_small_steps(cpu_kernels):
    """Int8Weight: every weight within half its row's level of the original (and the bf16
    rounding of the scale), the matmul is the dequantized matrix's. int4_head = int8 adds an
    int8 copy of the head of half the bf16 head's bytes: steps of at most SMALL_HEAD_ROWS logit
    rows use it (logits near the bf16 head's, not equal), larger ones the bf16 head (equal); in
    specdec's kernel (PackedInt8Weight) it serves every step; an unknown head precision is refused."""
    torch.manual_seed(0)
    w = torch.randn(48, 80)  # [in, out]
    iw = Int8Weight.quantize(w)
    assert iw.codes.dtype == torch.int8 and (iw.in_features, iw.out_features) == (48, 80)
    level = w.abs().amax(0) / 127  # [out]: one level per output row
    # half a level, plus what bf16's rounding of the scale (at most 2^-8 of it) moves a code
    assert bool(((iw.dequantize() - w).abs() <= level / 2 + w.abs() * 2**-8 + 1e-6).all())
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    torch.testing.assert_close(iw.matmul(x).float(), x.float() @ iw.dequantize(), atol=0.05, rtol=0.02)

    model = tiny_model("llama")
    bf16_head = PagedLlamaRunner.from_hf_model(model, num_blocks=32, block_size=4, int4=True, cpu_kernels=cpu_kernels)
    int8_head = PagedLlamaRunner.from_hf_model(model, num_blocks=32, block_size=4, int4=True, int4_head="int8",
                                               cpu_kernels=cpu_kernels)
    assert bf16_head.weights.small_head is None
    small = int8_head.weights.small_head
    ours = cpu_kernels == "specdec" and cpu_gemm.lowbit() is not None
    assert isinstance(small, PackedInt8Weight if ours else Int8Weight)
    assert small.codes.nbytes == bf16_head.weights.lm_head.nbytes // 2
    assert int8_head.facts.weight_bytes == bf16_head.facts.weight_bytes + small.codes.nbytes + small.scales.nbytes
    tokens = rand_tokens(random.Random(3), 17)
    for rows in (1, SMALL_HEAD_ROWS, SMALL_HEAD_ROWS + 1, len(tokens)):
        got = []
        for r in (bf16_head, int8_head):
            seq = r.blocks.reserve(20)
            (logits,) = r.forward([SeqChunk(seq, tokens, 0, rows)])
            r.free(seq)
            got.append(logits.float())
        if rows <= SMALL_HEAD_ROWS or ours:
            assert not torch.equal(got[0], got[1])
            assert float((got[1] - got[0]).norm() / got[0].norm()) < 0.02
        else:
            torch.testing.assert_close(got[1], got[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="int4_head"):
        PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4, int4=True, int4_head="int2")
    with pytest.raises(ValueError, match="int4_activations"):
        PagedLlamaRunner.from_hf_model(model, num_blocks=8, block_size=4, int4=True, int4_activations=12)


# ------------------------------------------------------------------------------------
def test_real_model_matches_transformers():
    """SmolLM2-135M (fp32): a ~40-token prompt, then a 9-token verify, vs transformers."""
    from specdec import models

    runner = PagedLlamaRunner.load(models.DEFAULT_TARGET_MODEL, pool_tokens=256, max_seqs=2)
    assert runner.facts.fingerprint and runner.facts.eos_token_ids and runner.facts.max_context == 256
    src = models.resolve(models.DEFAULT_TARGET_MODEL)
    tok, hf = models.load_tokenizer(src), models.load_model(src)
    prompt = tok("Speculative decoding lets a small draft model propose several tokens, and the large "
                 "target model then checks all of them in a single forward pass. When the draft is usually "
                 "right, the target produces several tokens per pass, so that")["input_ids"]
    assert 35 <= len(prompt) <= 45
    verify = random.Random(0).sample(range(runner.facts.vocab_size), 9)
    seq = runner.blocks.reserve(64)
    (first,) = runner.forward([SeqChunk(seq, prompt, 0, 1)])
    (second,) = runner.forward([SeqChunk(seq, verify, len(prompt), 9)])
    ref = reference(hf, prompt + verify)
    got = torch.cat([first, second])  # [10, V]
    want = ref[len(prompt) - 1:]
    diff = (got - want).abs().max().item()
    print(f"smollm2 paged vs transformers: max |diff| = {diff:.2e}")
    assert diff < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
