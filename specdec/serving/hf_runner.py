"""The transformers runner: any causal LM, one sequence per forward, a DynamicCache per sequence.

The fallback for architectures the paged runner does not cover (Gemma 3, for example), and
the numerical reference. It speaks the same `BatchRunner` contract: a step's chunks run one
after another, and a `BlockManager` over `pool_tokens` does the admission and accounting
(the caches themselves grow per sequence, within that budget).
"""
from __future__ import annotations

from typing import Sequence

import torch

from specdec import hf_compat, models
from specdec.serving.batch import ModelFacts, SeqChunk, StepAborted, StopCheck
from specdec.serving.blocks import BlockManager


class HFRunner:
    def __init__(self, model: torch.nn.Module, tokenizer=None, spec: str = "", pool_tokens: int = 16384,
                 block_size: int = 16, max_seqs: int = 64):
        self.model = model.eval()
        self.blocks = BlockManager(max(1, -(-pool_tokens // block_size)), block_size, max_seqs)
        self._caches: dict[int, object] = {}
        config = model.config
        vocab = int(model.get_output_embeddings().weight.shape[0])
        param = next(model.parameters())
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.facts = ModelFacts(
            model=spec, engine="torch",
            fingerprint=models.tokenizer_fingerprint(tokenizer) if tokenizer is not None else f"vocab-{vocab}",
            vocab_size=vocab,
            max_context=min(int(getattr(config, "max_position_embeddings", 2048)), self.blocks.capacity_tokens),
            eos_token_ids=models.eos_token_ids(tokenizer, config) if tokenizer is not None else [],
            dtype=str(param.dtype).removeprefix("torch."), device=str(param.device),
            weight_bytes=sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values()),
            kv_bytes_per_token=2 * config.num_hidden_layers * heads * head_dim * param.element_size())

    @classmethod
    def load(cls, spec: str, dtype: str = "float32", device: str = "cpu", pool_tokens: int = 16384,
             block_size: int = 16, max_seqs: int = 64) -> "HFRunner":
        src = models.resolve(spec)
        return cls(models.load_model(src, dtype, device), models.load_tokenizer(src), spec, pool_tokens, block_size,
                   max_seqs)

    @torch.inference_mode()
    def forward(self, chunks: Sequence[SeqChunk], stop: StopCheck | None = None) -> list[torch.Tensor]:
        """One transformers forward per chunk; `stop()` is asked before each (it says True only
        when every sequence of the step is closed, so what earlier chunks appended goes with them)."""
        if len({c.seq for c in chunks}) != len(chunks):
            raise ValueError("a sequence appears twice in one batch")
        out = []
        for c in chunks:
            if stop is not None and stop():
                raise StepAborted("stopped between sequences")
            cached = self.blocks.length(c.seq)
            if c.start != cached:
                raise ValueError(f"sequence {c.seq}: chunk starts at {c.start} but {cached} tokens are cached")
            self.blocks.ensure(c.seq, c.start + len(c.tokens))
            cache = self._caches.get(c.seq)
            if cache is None:
                cache = self._caches[c.seq] = hf_compat.new_dynamic_cache(self.model)
            ids = torch.tensor([list(c.tokens)], dtype=torch.long, device=self.model.device)  # [1, n]
            logits = hf_compat.forward_logits(self.model, ids, cache)  # [n, V] float32
            out.append(logits[len(c.tokens) - c.num_logits:].cpu() if c.num_logits else logits[:0].cpu())
        return out

    def truncate(self, seq: int, length: int) -> None:
        cached = self.blocks.length(seq)
        if length < cached and seq in self._caches:
            hf_compat.crop_cache(self._caches[seq], cached - length)
        self.blocks.truncate(seq, length)

    def free(self, seq: int) -> None:
        self._caches.pop(seq, None)
        self.blocks.free(seq)
