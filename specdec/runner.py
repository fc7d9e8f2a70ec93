"""The model runner shared by the target service and the torch draft engine.

It wraps a transformers causal LM and hands out per-session KV caches. A cache is
indexed by position: rolling back is dropping the tail (`SessionCache.truncate`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec import hf_compat, models


@dataclass
class SessionCache:
    """One session's KV cache; `length` tokens are in it."""

    cache: object
    length: int = 0

    def truncate(self, length: int) -> None:
        """Roll back to the first `length` tokens (free: the tail is dropped)."""
        if length < self.length:
            hf_compat.crop_cache(self.cache, self.length - length)
            self.length = length


@dataclass
class ModelRunner:
    model: torch.nn.Module
    tokenizer: object | None
    source: models.ModelSource | None
    dtype: str = "float32"
    device: str = "cpu"
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        # a tokenizer-less model (tiny test configs) is fingerprinted by its vocabulary size
        self.fingerprint = (models.tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None
                            else f"vocab-{self.vocab_size}")

    @classmethod
    def load(cls, spec: str, dtype: str = "float32", device: str = "cpu") -> "ModelRunner":
        src = models.resolve(spec)
        return cls(models.load_model(src, dtype, device), models.load_tokenizer(src), src, dtype, device)

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> list[int]:
        if self.tokenizer is None:
            return []
        return models.eos_token_ids(self.tokenizer, self.model.config)

    @property
    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        elem = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        return 2 * c.num_hidden_layers * heads * head_dim * elem

    def new_cache(self) -> SessionCache:
        return SessionCache(hf_compat.new_dynamic_cache(self.model))

    @torch.inference_mode()
    def forward(self, cache: SessionCache, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` to the cache; returns logits [n, V] float32 on CPU."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        logits = hf_compat.forward_logits(self.model, ids, cache.cache)  # [n, V]
        cache.length += len(token_ids)
        return logits.cpu()
