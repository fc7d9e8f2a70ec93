"""Which runner serves a configured model (shared by the target and draft services).

- engine "torch": the paged Llama-family runner (`PagedLlamaRunner`) when the architecture is
  supported, else the transformers runner (`HFRunner`, one sequence per forward); dtype int4
  (the draft's default) is CPU-only and runs as bfloat16 on a GPU;
- engine "llamacpp": `LlamaCppRunner` over the GGUF file, or over a copy requantized to
  `gguf_type` (f32 | f16 | q8_0), made once with llama.cpp's own quantizer and cached.
  Each session gets its own slice of the pool (`kv_unified=False`): with one shared
  buffer every token's attention spans the cells of all sessions, which made an 8 x 9
  verify 2x dearer (measured); a session's context is then pool / max_sessions.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging

import torch

from specdec import models
from specdec.config import ModelServiceConfig
from specdec.devices import gpu_share_bytes
from specdec.errors import InvalidArgument
from specdec.serving.batch import BatchRunner

log = logging.getLogger(__name__)


def load_runner(cfg: ModelServiceConfig, device: str) -> BatchRunner:
    if cfg.engine == "torch":
        runner = _torch_runner(cfg, device)
    elif cfg.engine == "llamacpp":
        runner = _llamacpp_runner(cfg)
    else:
        raise InvalidArgument(f"unknown engine {cfg.engine!r}: use torch or llamacpp")
    _return_freed_heap()
    return runner


def _return_freed_heap() -> None:
    """Give the heap that loading freed back to the OS (glibc keeps it otherwise): loading
    dequantizes the GGUF to fp32 and drops it, and without this the int4 draft service sat
    at 1,361 MB RSS instead of 894 (weights 117 MB + KV pool 360 MB + torch)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _torch_runner(cfg: ModelServiceConfig, device: str) -> BatchRunner:
    from specdec.serving import stored_model
    from specdec.serving.graphs import GraphConfig, cuda_capture, parse_sizes
    from specdec.serving.hf_runner import HFRunner
    from specdec.serving.paged_llama import INT4, PagedLlamaRunner, supports

    src = models.resolve(cfg.model)
    dtype = cfg.dtype
    if dtype == INT4 and torch.device(device).type != "cpu":
        log.warning("dtype int4 is the CPU precision (torch's CPU int4 kernel): running %s in bfloat16 on %s",
                    cfg.model, device)
        dtype = "bfloat16"
    config = stored_model.config(src) if cfg.load_manifest and torch.device(device).type == "cpu" else None
    if config is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(models.hf_directory(src))
    if supports(config):
        runner = PagedLlamaRunner.load(cfg.model, dtype, device, cfg.kv_pool_tokens, cfg.block_size,
                                       cfg.max_sessions, gpu_share_bytes(device, cfg.gpu_memory_fraction),
                                       cfg.gpu_activation_reserve, cfg.int4_head, cfg.cpu_kernels,
                                       cfg.int4_activations, cfg.load_manifest, cfg.keep_built_weights)
        if torch.device(device).type == "cuda" and cfg.cuda_graphs:
            runner.enable_graphs(GraphConfig(parse_sizes(cfg.cuda_graph_batches, "cuda_graph_batches"),
                                             parse_sizes(cfg.cuda_graph_tokens, "cuda_graph_tokens")),
                                 cuda_capture())
        return runner
    if dtype == INT4:
        raise InvalidArgument(f"dtype int4 needs a Llama-family model (the paged runner); {cfg.model} is not one")
    log.info("%s is not a Llama-family model: serving it with the transformers runner (one session per forward)",
             cfg.model)
    return HFRunner.load(cfg.model, dtype, device, cfg.kv_pool_tokens, cfg.block_size, cfg.max_sessions)


def _llamacpp_runner(cfg: ModelServiceConfig) -> BatchRunner:
    from specdec.serving import stored_model
    from specdec.serving.llamacpp import LlamaCppRunner, gguf_variant

    src = models.resolve(cfg.model)
    if src.gguf_path is None:
        raise InvalidArgument(f"the llama.cpp engine needs a GGUF model, got {cfg.model!r}")
    facts = stored_model.tokenizer_facts(src) if cfg.load_manifest else None  # without transformers
    if facts is None:
        tok = models.load_tokenizer(src)
        facts = models.tokenizer_fingerprint(tok), models.eos_token_ids(tok)
    fingerprint, tokenizer_eos = facts
    path = str(gguf_variant(cfg.model, cfg.gguf_type)) if cfg.gguf_type else cfg.model
    runner = LlamaCppRunner.load(path, cfg.kv_pool_tokens, cfg.max_sessions, max(1, cfg.num_threads),
                                 cfg.max_step_tokens, cfg.block_size, kv_unified=False, fingerprint=fingerprint)
    f = runner.facts
    runner.facts = dataclasses.replace(
        f, model=cfg.model, eos_token_ids=sorted(set(f.eos_token_ids) | set(tokenizer_eos)),
        dtype=f"{f.dtype} ({cfg.gguf_type} copy)" if cfg.gguf_type else f.dtype)
    return runner
