"""The load manifest (specdec/serving/stored_model.py): a warm load is the cold load bit for bit,
without transformers; a stale, unchecked or too short manifest loads cold again."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from specdec import models
from specdec.serving import stored_model
from specdec.serving.batch import SeqChunk
from specdec.serving.paged_llama import PagedLlamaRunner
from tests.test_paged_llama import KINDS, VOCAB, tiny_model

POOL = 256  # tokens: max_context 256 (the tiny models' max_position_embeddings)


def save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_dtype(dtype: str) -> str:
    return "float32" if dtype == "int4" else dtype


def logits(runner: PagedLlamaRunner) -> torch.Tensor:
    """Two sequences: prompts of 11 and 5 tokens, then a 4-token verify and a decode, batched."""
    rng = random.Random(0)
    a, b = runner.blocks.reserve(64), runner.blocks.reserve(64)
    pa, pb = [rng.randrange(VOCAB) for _ in range(11)], [rng.randrange(VOCAB) for _ in range(5)]
    out = runner.forward([SeqChunk(a, pa, 0, 1), SeqChunk(b, pb, 0, 5)])
    out += runner.forward([SeqChunk(a, [3, 1, 4, 1], 11, 4), SeqChunk(b, [9], 5, 1)])
    return torch.cat(out)  # [15, V]


def count_cold_loads(monkeypatch) -> list:
    """Loads through transformers from here on, one entry each."""
    calls: list = []
    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def no_cold_load(monkeypatch):
    """Make any load through transformers fail: what follows must be a warm load."""
    def cold(*_a, **_k):
        raise AssertionError("loaded through transformers")

    monkeypatch.setattr(models, "load_model", cold)
    monkeypatch.setattr(models, "load_tokenizer", cold)


@pytest.mark.parametrize("kind,dtype", [*((k, "float32") for k in KINDS), ("llama", "int4"), ("qwen2", "int4"),
                                        ("llama", "bfloat16")])
def test_a_warm_load_is_the_cold_load(kind, dtype, tmp_path, smol_tokenizer, monkeypatch):
    path = save(tiny_model(kind), smol_tokenizer, tmp_path / kind)
    src = models.resolve(str(path))
    assert stored_model.open_stored(src, load_dtype(dtype)) is None  # nothing recorded yet
    cold = PagedLlamaRunner.load(str(path), dtype, pool_tokens=POOL, max_seqs=4)
    assert stored_model.open_stored(src, load_dtype(dtype)) is not None
    assert stored_model.config(src).model_type == kind
    assert stored_model.tokenizer_facts(src) == (models.tokenizer_fingerprint(smol_tokenizer),
                                                 models.eos_token_ids(smol_tokenizer))
    with monkeypatch.context() as m:
        no_cold_load(m)
        warm = PagedLlamaRunner.load(str(path), dtype, pool_tokens=POOL, max_seqs=4)
    assert warm.facts == cold.facts
    assert torch.equal(warm.weights.cos, cold.weights.cos) and torch.equal(warm.weights.sin, cold.weights.sin)
    assert torch.equal(logits(warm), logits(cold))


def test_a_warm_load_imports_no_transformers(tmp_path, smol_tokenizer):
    path = save(tiny_model("llama"), smol_tokenizer, tmp_path / "m")
    code = ("import sys; from specdec.serving.paged_llama import PagedLlamaRunner; "
            f"PagedLlamaRunner.load({str(path)!r}, 'int4', pool_tokens={POOL}, max_seqs=2); "
            "print('transformers' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1]
            for _ in range(2)]
    assert runs == ["True", "False"]  # cold through transformers, then warm without it


def test_a_changed_file_loads_cold(tmp_path, smol_tokenizer):
    path = save(tiny_model("qwen2", seed=0), smol_tokenizer, tmp_path / "m")
    first = logits(PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4))
    save(tiny_model("qwen2", seed=1), smol_tokenizer, path)  # other weights, same names
    assert stored_model.open_stored(models.resolve(str(path)), "float32") is None
    again = logits(PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4))
    fresh = logits(PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4, manifest=False))
    assert torch.equal(again, fresh) and not torch.equal(again, first)


def test_a_model_unlike_its_files_is_never_loaded_warm(tmp_path, smol_tokenizer, monkeypatch):
    """A tensor that loading changed (as a conversion would): the manifest says cold loads only."""
    path = save(tiny_model("mistral"), smol_tokenizer, tmp_path / "m")
    src = models.resolve(str(path))
    model = models.load_model(src)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0
    stored_model.record(src, model, smol_tokenizer, "float32", POOL)
    manifest = json.loads((models.load_cache_dir(src.directory) / stored_model.MANIFEST_FILE).read_text())
    assert manifest["direct"] is False
    assert stored_model.open_stored(src, "float32") is None
    calls = count_cold_loads(monkeypatch)
    PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4)
    assert len(calls) == 1


def test_tables_too_short_load_cold_and_are_extended(tmp_path, smol_tokenizer, monkeypatch):
    path = save(tiny_model("llama"), smol_tokenizer, tmp_path / "m")
    src = models.resolve(str(path))
    monkeypatch.setattr(stored_model, "MAX_STORED_POSITIONS", 32)
    PagedLlamaRunner.load(str(path), pool_tokens=32, max_seqs=2)  # max_context 32: 32 rows stored
    assert stored_model.open_stored(src, "float32").rope_positions == 32
    calls = count_cold_loads(monkeypatch)
    longer = PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4)  # needs 256 rows: cold
    assert len(calls) == 1 and stored_model.open_stored(src, "float32").rope_positions == POOL
    fresh = PagedLlamaRunner.load(str(path), pool_tokens=POOL, max_seqs=4, manifest=False)
    assert torch.equal(logits(longer), logits(fresh))


def test_load_caches_of_removed_directories_are_pruned(tmp_path, smol_tokenizer):
    gone = save(tiny_model("llama"), smol_tokenizer, tmp_path / "gone")
    PagedLlamaRunner.load(str(gone), pool_tokens=POOL, max_seqs=2)
    entry = models.load_cache_dir(gone, create=False)
    assert (entry / stored_model.MANIFEST_FILE).exists() and (entry / "tokenizer.pkl").exists()
    for f in gone.iterdir():
        f.unlink()
    gone.rmdir()
    kept = save(tiny_model("llama", seed=1), smol_tokenizer, tmp_path / "kept")
    PagedLlamaRunner.load(str(kept), pool_tokens=POOL, max_seqs=2)  # a new cache folder prunes the others
    assert not entry.exists() and models.load_cache_dir(kept, create=False).exists()


def test_a_cached_tokenizer_is_the_loaded_one(tmp_path, smol_tokenizer, monkeypatch):
    import transformers

    path = save(tiny_model("llama"), smol_tokenizer, tmp_path / "m")
    src = models.resolve(str(path))
    first = models.load_tokenizer(src)  # through transformers, then pickled
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained",
                  lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded through transformers")))
        cached = models.load_tokenizer(src)
    assert cached is not first and cached.get_vocab() == first.get_vocab()
    assert models.tokenizer_fingerprint(cached) == models.tokenizer_fingerprint(smol_tokenizer)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Déjà vu?\n  x = [1, 2]"}]
    from specdec import hf_compat

    assert hf_compat.chat_token_ids(cached, chat) == hf_compat.chat_token_ids(first, chat)
    ids = first("def f(x):\n    return x ** 2  # ünïcode", add_special_tokens=False)["input_ids"]
    assert cached("def f(x):\n    return x ** 2  # ünïcode", add_special_tokens=False)["input_ids"] == ids
    assert cached.decode(ids, skip_special_tokens=True) == first.decode(ids, skip_special_tokens=True)


def test_a_changed_tokenizer_is_loaded_again(tmp_path, smol_tokenizer):
    import copy

    path = save(tiny_model("llama"), smol_tokenizer, tmp_path / "m")
    src = models.resolve(str(path))
    models.load_tokenizer(src)
    other = copy.deepcopy(smol_tokenizer)
    other.add_tokens(["<specdec_new_token>"])
    other.save_pretrained(path)
    assert "<specdec_new_token>" in models.load_tokenizer(src).get_vocab()


# -- built weights (stored_model.keep_built / open_built, tensor_tree) --------------------------------

def built_files(path) -> list:
    return sorted(models.load_cache_dir(path, create=False).glob("built-*.safetensors"))


def no_manifest_load(monkeypatch):
    """Make the manifest's warm load fail too: what follows must come from the built weights."""
    no_cold_load(monkeypatch)
    monkeypatch.setattr(stored_model, "open_stored",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("built the weights again")))


@pytest.mark.parametrize("kind,dtype", [("llama", "float32"), ("qwen3", "float32"), ("llama", "int4"),
                                        ("qwen2", "int4"), ("llama", "bfloat16")])
def test_built_weights_are_kept_and_give_the_built_runner_bit_for_bit(kind, dtype, tmp_path, smol_tokenizer,
                                                                      monkeypatch):
    path = save(tiny_model(kind), smol_tokenizer, tmp_path / kind)
    cold = PagedLlamaRunner.load(str(path), dtype, pool_tokens=POOL, max_seqs=4)
    assert len(built_files(path)) == 1  # kept right after the first build
    with monkeypatch.context() as m:
        no_manifest_load(m)
        kept = PagedLlamaRunner.load(str(path), dtype, pool_tokens=POOL, max_seqs=4)
    for f in built_files(path):
        f.unlink()
    with monkeypatch.context() as m:
        no_cold_load(m)
        rebuilt = PagedLlamaRunner.load(str(path), dtype, pool_tokens=POOL, max_seqs=4)  # manifest, built again
    assert len(built_files(path)) == 1
    reference = logits(cold)
    for runner in (kept, rebuilt):
        assert runner.facts == cold.facts and runner.arch == cold.arch
        assert runner.pool.k.dtype == cold.pool.k.dtype and runner.pool.k.shape == cold.pool.k.shape
        assert runner.weights.nbytes() == cold.weights.nbytes()
        assert [type(m) for m in runner.weights.matrices()] == [type(m) for m in cold.weights.matrices()]
        assert runner.weights.embed_is_head() == cold.weights.embed_is_head()  # a tied head stays one copy
        assert torch.equal(runner.weights.cos, cold.weights.cos) and torch.equal(runner.weights.sin, cold.weights.sin)
        assert torch.equal(logits(runner), reference)


def test_built_weights_serve_a_shorter_context_and_other_options_get_their_own(tmp_path, smol_tokenizer,
                                                                                monkeypatch):
    path = save(tiny_model("llama"), smol_tokenizer, tmp_path / "m")
    PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=4)
    with monkeypatch.context() as m:
        no_manifest_load(m)
        short = PagedLlamaRunner.load(str(path), "int4", pool_tokens=128, max_seqs=2)  # RoPE rows 0..127 of 256
    for f in built_files(path):
        f.unlink()
    reference = PagedLlamaRunner.load(str(path), "int4", pool_tokens=128, max_seqs=2)  # built for 128
    assert short.arch == reference.arch and short.arch.max_context == 128
    assert torch.equal(short.weights.cos, reference.weights.cos) and short.weights.cos.shape[0] == 128
    assert torch.equal(logits(short), logits(reference))
    # the built file has the whole table (the model's 256 positions), whatever pool built it
    with monkeypatch.context() as m:
        no_manifest_load(m)
        assert PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=2).arch.max_context == POOL
    # other options: another file, next to the first (and never more than MAX_BUILT)
    PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=2, int4_head="q8_0")
    PagedLlamaRunner.load(str(path), "float32", pool_tokens=POOL, max_seqs=2)
    assert len(built_files(path)) == 3
    PagedLlamaRunner.load(str(path), "bfloat16", pool_tokens=POOL, max_seqs=2)
    assert len(built_files(path)) == stored_model.MAX_BUILT == 3


def test_a_damaged_built_file_is_built_again(tmp_path, smol_tokenizer, monkeypatch, caplog):
    path = save(tiny_model("qwen2"), smol_tokenizer, tmp_path / "m")
    reference = logits(PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=4))
    (built,) = built_files(path)
    data = bytearray(built.read_bytes())
    built.write_bytes(bytes(data[: len(data) // 2]))  # cut short
    with monkeypatch.context() as m:
        no_cold_load(m)
        again = PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=4)
    assert "could not read the built weights" in caplog.text
    assert torch.equal(logits(again), reference) and len(built_files(path)) == 1
    with monkeypatch.context() as m:
        no_manifest_load(m)  # and the file written again is whole
        assert torch.equal(logits(PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=4)), reference)


def test_a_new_manifest_drops_the_weights_built_under_the_old_one(tmp_path, smol_tokenizer):
    path = save(tiny_model("llama", seed=0), smol_tokenizer, tmp_path / "m")
    PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=2)
    (old,) = built_files(path)
    save(tiny_model("llama", seed=1), smol_tokenizer, path)  # new files: a new key
    PagedLlamaRunner.load(str(path), "int4", pool_tokens=POOL, max_seqs=2)
    assert [f.name for f in built_files(path)] != [old.name] and len(built_files(path)) == 1
