"""Every transformers API that moves between versions is wrapped here, and only here.

Pinned: transformers 5.24 on this machine (the GPU image has 5.17). Decisions:
- the forward keyword for the KV cache is `cache=` in 5.24 and `past_key_values=` before;
  we look at the model's forward signature once and use whichever it takes;
- `DynamicCache.crop` takes only a negative count in 5.24 (absolute lengths before);
  `crop_cache(cache, n)` removes the last n entries with `crop(-n)`, guarded by n > 0,
  which means the same thing in both versions;
- GGUF-loaded models carry a quantizer that refuses `save_pretrained`; `plain_copy`
  rebuilds the dequantized model without it so that it can be cached on disk.

torch's private int4 weight-only matmul for CPU (`torch._weight_int4pack_mm_for_cpu`, the
kernel gpt-fast and torchao use on CPU) is also wrapped here: pinned torch 2.13; it takes
bf16 activations only (fp32 runs a reference path ~30x slower), and the CUDA op packs
differently, so `int4_pack`/`int4_matmul` are CPU-only.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def _cache_kwarg(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_dynamic_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """input_ids: [1, n] -> logits [n, V] (float32), appending n entries to `cache`."""
    kw = {_cache_kwarg(type(model)): cache}
    out = model(input_ids=input_ids, use_cache=True, **kw)
    return out.logits[0].float()


def crop_cache(cache, n_remove: int) -> None:
    if n_remove > 0:
        cache.crop(-n_remove)


def plain_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh


def rope_type(config) -> str:
    """The model's RoPE variant ("default", "llama3", "linear", "yarn", "dynamic", ...).

    5.x keeps it in `config.rope_parameters["rope_type"]`; 4.x in `config.rope_scaling`
    (`rope_type`, or `type` in older files), where None means the default rotation.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


def rope_tables(model: torch.nn.Module, positions: int, dtype: torch.dtype,
                device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] for positions 0..positions-1, in `dtype`.

    Computed by the model's own rotary module (one per decoder since 4.45, called as
    `rotary_emb(x, position_ids)` with x only giving dtype and device), so rope scaling
    variants (llama3, linear, yarn) come out exactly as the model applies them. Variants
    whose frequencies depend on the current sequence length (dynamic, longrope) are not
    position tables; callers must not use this for them.
    """
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no decoder-level rotary_emb")
    pos = torch.arange(positions, device=device).unsqueeze(0)  # [1, P]
    x = torch.zeros(1, dtype=dtype, device=device)  # dtype/device carrier only
    with torch.no_grad():
        cos, sin = rotary(x, pos)  # each [1, P, D]
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()  # each [P, D]


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a chat rendered with the tokenizer's template and a generation prompt.

    `apply_chat_template(tokenize=True)` returns a BatchEncoding in 5.x and a list before.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The same chat rendered as text (what a text-prompt peer such as llama.cpp is given)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# -- torch's private int4 ops (CPU) -----------------------------------------------------------------
def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int32 in 0..15 -> torch's packed CPU int4 layout (opaque)."""
    return torch._convert_weight_to_int4pack_for_cpu(codes, 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 @ the packed weight, w = (q - 8) * scale + zero per group of `group` rows
    of `in`; scales_zeros [in/group, out, 2] bf16 -> [T, out] bf16."""
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)
