"""Shared fixtures: real service processes on free loopback ports.

- `default_stack`: the embedded default pair (SmolLM2-135M-Instruct fp32 target in torch,
  its shipped Q4_1 GGUF as a llama.cpp draft), with /metrics on. Slow to use, quick to start.
- `tiny_model_dir(...)`: tiny random Llama models carrying the real SmolLM2 tokenizer, for
  fast service tests of error paths (the services load them like any HF directory).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: real-model or statistical tests (minutes); part of CI")


@pytest.fixture(scope="session")
def smol_tokenizer():
    from specdec import models

    return models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))


def make_tiny_model_dir(path: Path, tokenizer, seed: int, extra_token: str | None = None) -> Path:
    """A 2-layer random Llama with the given tokenizer, saved as a Hugging Face directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    tok = tokenizer
    if extra_token:
        import copy

        tok = copy.deepcopy(tokenizer)
        tok.add_tokens([extra_token])
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smol_tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "target": make_tiny_model_dir(root / "target", smol_tokenizer, seed=1),
        "draft": make_tiny_model_dir(root / "draft", smol_tokenizer, seed=2),
        "other-tokenizer": make_tiny_model_dir(root / "other", smol_tokenizer, seed=3, extra_token="<specdec_extra>"),
    }


def tiny_config(tiny_models: dict[str, Path]):
    """The tiny target and a tiny torch draft on free ports, unpinned (tests share two cores)."""
    from specdec.launcher import local_config

    cfg = local_config()
    cfg.target.model = str(tiny_models["target"])
    cfg.draft.engine = "torch"
    cfg.draft.model = str(tiny_models["draft"])
    cfg.target.cpu_cores = cfg.draft.cpu_cores = ""
    return cfg


def with_metrics(cfg):
    from specdec.launcher import free_port

    for s in (cfg.target, cfg.draft, cfg.orchestrator):
        s.metrics_port = free_port()
    return cfg


def wait_until_zero(read, within_s: float) -> dict[str, float]:
    """Poll `read()` (gauges by name) until every one reads 0, or `within_s` has passed; returns
    the last reading (the caller asserts)."""
    import time

    deadline = time.monotonic() + within_s
    while True:
        g = read()
        if not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.05)


@contextmanager
def running(cfg, log_dir, ready_s: float = 300):
    """All services of `cfg` started and healthy; stopped on exit."""
    from specdec.launcher import Stack

    with Stack(cfg, log_dir).start() as stack:
        stack.wait_ready(ready_s)
        yield stack


# -- the greedy references of the end-to-end tests: 20 ShareGPT + HumanEval prompts x 64 tokens ----------
N_PROMPTS = 20
NEW_TOKENS = 64


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """The reference: transformers generate, greedy, never stopping at EOS."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def target_model():
    import torch

    from specdec import models

    torch.set_num_threads(2)
    return models.load_model(models.resolve(models.DEFAULT_TARGET_MODEL))


@pytest.fixture(scope="session")
def prompts(smol_tokenizer) -> list[tuple[str, list[int]]]:
    from specdec import hf_compat
    from specdec.lab.workloads import mixed_workload

    return [(p.id, hf_compat.chat_token_ids(smol_tokenizer, p.messages)) for p in mixed_workload(N_PROMPTS)]


@pytest.fixture(scope="session")
def references(target_model, prompts) -> dict[str, list[int]]:
    return {pid: hf_greedy(target_model, ids, NEW_TOKENS) for pid, ids in prompts}


@pytest.fixture(scope="session")
def default_stack(tmp_path_factory):
    """The default pair as three real processes (what `specdec up` starts)."""
    from specdec.launcher import local_config

    cfg = with_metrics(local_config())
    cfg.orchestrator.probe_interval_s = 0.5
    # 8 clients at once still draft at the full k (the default budget would run their rounds
    # without drafts): the concurrent tests check batched verifies of real drafts
    cfg.orchestrator.draft_token_budget = 0
    with running(cfg, tmp_path_factory.mktemp("default-stack"), 600) as stack:
        yield stack
