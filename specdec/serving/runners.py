"""Which runner serves a configured model (shared by the target and draft services).

- engine "torch": the paged Llama-family runner (`PagedLlamaRunner`) when the architecture is
  supported, else the transformers runner (`HFRunner`, one sequence per forward);
- engine "llamacpp": `LlamaCppRunner` over the GGUF file, or over a copy requantized to
  `gguf_type` (f32 | f16 | q8_0), made once with llama.cpp's own quantizer and cached.
  Each session gets its own slice of the pool (`kv_unified=False`): with one shared
  buffer every token's attention spans the cells of all sessions, which made an 8 x 9
  verify 2x dearer (measured); a session's context is then pool / max_sessions.
"""
from __future__ import annotations

import dataclasses
import logging

from specdec import models
from specdec.config import ModelServiceConfig
from specdec.errors import InvalidArgument
from specdec.serving.batch import BatchRunner

log = logging.getLogger(__name__)


def load_runner(cfg: ModelServiceConfig, device: str) -> BatchRunner:
    if cfg.engine == "torch":
        return _torch_runner(cfg, device)
    if cfg.engine == "llamacpp":
        return _llamacpp_runner(cfg)
    raise InvalidArgument(f"unknown engine {cfg.engine!r}: use torch or llamacpp")


def _torch_runner(cfg: ModelServiceConfig, device: str) -> BatchRunner:
    from transformers import AutoConfig

    from specdec.serving.hf_runner import HFRunner
    from specdec.serving.paged_llama import PagedLlamaRunner, supports

    src = models.resolve(cfg.model)
    if supports(AutoConfig.from_pretrained(models.hf_directory(src))):
        return PagedLlamaRunner.load(cfg.model, cfg.dtype, device, cfg.kv_pool_tokens, cfg.block_size,
                                     cfg.max_sessions)
    log.info("%s is not a Llama-family model: serving it with the transformers runner (one session per forward)",
             cfg.model)
    return HFRunner.load(cfg.model, cfg.dtype, device, cfg.kv_pool_tokens, cfg.block_size, cfg.max_sessions)


def _llamacpp_runner(cfg: ModelServiceConfig) -> BatchRunner:
    from specdec.serving.llamacpp import LlamaCppRunner, gguf_variant

    src = models.resolve(cfg.model)
    if src.gguf_path is None:
        raise InvalidArgument(f"the llama.cpp engine needs a GGUF model, got {cfg.model!r}")
    tok = models.load_tokenizer(src)
    path = str(gguf_variant(cfg.model, cfg.gguf_type)) if cfg.gguf_type else cfg.model
    runner = LlamaCppRunner.load(path, cfg.kv_pool_tokens, cfg.max_sessions, max(1, cfg.num_threads),
                                 cfg.max_step_tokens, cfg.block_size, kv_unified=False,
                                 fingerprint=models.tokenizer_fingerprint(tok))
    f = runner.facts
    runner.facts = dataclasses.replace(
        f, model=cfg.model, eos_token_ids=sorted(set(f.eos_token_ids) | set(models.eos_token_ids(tok))),
        dtype=f"{f.dtype} ({cfg.gguf_type} copy)" if cfg.gguf_type else f.dtype)
    return runner
