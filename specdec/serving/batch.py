"""The contract between a service's step loop and its model runner: one flat batch per step.

A step feeds several sequences at once. Each sequence contributes one `SeqChunk`: the new
tokens to append to its cache, where they start, and how many logits it needs back
(the last prompt position at prefill, the k+1 positions of a verify, the last position
of a draft step). Runners:
- `specdec.serving.paged_llama.PagedLlamaRunner`: the Llama family in plain torch over a
  paged KV pool (CPU and GPU);
- `specdec.serving.llamacpp.LlamaCppRunner`: a GGUF model in one llama.cpp context with
  one sequence id per session;
- `specdec.serving.hf_runner.HFRunner`: any transformers causal LM, one sequence per
  forward (the fallback, and the numerical reference).
Every runner owns a `BlockManager` (its KV pool's accounting) and keeps it in step with
its cache: `forward` grows a sequence's blocks, `truncate` frees tail blocks, `free`
releases them all.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from specdec.serving.blocks import BlockManager


class StepAborted(Exception):
    """A runner gave up a step part way because `stop()` said so (every sequence in it was
    closed): nothing of the step is kept, and the sequences' caches are as before it."""


StopCheck = Callable[[], bool]  # asked between layers: True = abandon the step


@dataclass(frozen=True)
class SeqChunk:
    seq: int  # sequence id, from BlockManager.reserve
    tokens: Sequence[int]  # [n] new tokens, at positions start .. start+n-1
    start: int  # tokens already cached for this sequence (must equal its cached length)
    num_logits: int  # logits wanted for the last num_logits tokens (0 = none, at most n)


@dataclass(frozen=True)
class ModelFacts:
    """What a runner tells its service about the model (answered by Info)."""

    model: str  # the spec as configured
    engine: str  # torch | llamacpp | ngram
    fingerprint: str  # tokenizer fingerprint ("" = any tokenizer)
    vocab_size: int
    max_context: int
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str = ""
    device: str = "cpu"
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0


class BatchRunner(Protocol):
    facts: ModelFacts
    blocks: BlockManager

    def forward(self, chunks: Sequence[SeqChunk], stop: StopCheck | None = None) -> list[torch.Tensor]:
        """Append every chunk to its sequence (distinct sequences) in one forward.

        Returns, per chunk, logits [num_logits, V] float32 on CPU for its last num_logits tokens.
        `stop`, when given, is asked at points inside the forward (between layers, or between
        the runner's calls); when it says True the runner rolls the step back and raises
        StepAborted, so that a closed session's long prefill chunk does not hold its memory
        until the chunk would have ended.
        """

    def truncate(self, seq: int, length: int) -> None:
        """Drop cache entries at positions >= length (rollback)."""

    def free(self, seq: int) -> None:
        """Release the sequence's cache and blocks; a second call does nothing."""
