"""Draft engines. Each proposes k tokens after a sequence and says what it sampled them from.

- `ModelDrafter` holds the loop shared by every model-backed engine (feed what changed,
  then sample k tokens one at a time); a `LogitsBackend` supplies next-token logits:
  - `TorchBackend`: any transformers causal LM, through the shared `ModelRunner`;
  - `LlamaCppBackend`: a GGUF file run natively by llama.cpp (llama-cpp-python).
- `NgramDrafter`: no model; prompt lookup (copies what followed the last matching n-gram).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdec import models
from specdec.errors import InvalidArgument, ResourceExhausted
from specdec.runner import ModelRunner
from specdec.sampling import SamplingParams, draft_token

log = logging.getLogger(__name__)

SparseDist = tuple[list[int], list[float]]


@dataclass
class DraftSequence:
    """Per-session draft state: the tokens the draft holds and how many are in its cache."""

    backend_state: Any
    tokens: list[int]
    fed: int = 0
    last_logits: torch.Tensor | None = None  # prediction after tokens[:fed]


class Drafter(Protocol):
    engine: str
    model: str
    fingerprint: str  # "" = works on any tokenizer
    vocab_size: int
    max_context: int
    weight_bytes: int
    kv_bytes_per_token: int

    def new_sequence(self, prompt_ids: list[int]) -> DraftSequence: ...

    def propose(self, seq: DraftSequence, k: int, params: SamplingParams, max_support: int,
                generator: torch.Generator) -> tuple[list[int], list[SparseDist]]: ...

    def rewind(self, seq: DraftSequence, keep: int) -> None:
        """Keep only the first `keep` tokens (and their cache entries)."""

    def release(self, seq: DraftSequence) -> None: ...


class LogitsBackend(Protocol):
    def new_state(self) -> Any: ...

    def feed(self, state: Any, token_ids: list[int]) -> torch.Tensor:  # -> logits [V] of the last position
        ...

    def truncate(self, state: Any, length: int) -> None: ...

    def release(self, state: Any) -> None: ...


@dataclass
class ModelDrafter:
    backend: LogitsBackend
    engine: str
    model: str
    fingerprint: str
    vocab_size: int
    max_context: int
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0

    def new_sequence(self, prompt_ids: list[int]) -> DraftSequence:
        seq = DraftSequence(self.backend.new_state(), list(prompt_ids))
        seq.last_logits = self.backend.feed(seq.backend_state, seq.tokens)
        seq.fed = len(seq.tokens)
        return seq

    def rewind(self, seq: DraftSequence, keep: int) -> None:
        del seq.tokens[keep:]
        if seq.fed > keep:  # cache entries past `keep` belong to tokens that are gone
            seq.fed, seq.last_logits = keep, None
            self.backend.truncate(seq.backend_state, keep)

    def _sync(self, seq: DraftSequence) -> torch.Tensor:
        """Make the cache hold all of seq.tokens; returns the logits [V] after them."""
        assert seq.fed <= len(seq.tokens), "rewind() before appending"
        if seq.fed == len(seq.tokens) and seq.last_logits is None:
            seq.fed -= 1  # refeed the last token to get its logits
            self.backend.truncate(seq.backend_state, seq.fed)
        if seq.fed < len(seq.tokens):
            seq.last_logits = self.backend.feed(seq.backend_state, seq.tokens[seq.fed:])
            seq.fed = len(seq.tokens)
        assert seq.last_logits is not None
        return seq.last_logits

    def propose(self, seq, k, params, max_support, generator):
        logits = self._sync(seq)
        tokens: list[int] = []
        dists: list[SparseDist] = []
        for i in range(k):
            tok, ids, q = draft_token(logits, params, max_support, generator)
            tokens.append(tok)
            dists.append((ids.tolist(), q.tolist()))
            seq.tokens.append(tok)
            if i < k - 1:
                logits = self.backend.feed(seq.backend_state, [tok])
                seq.fed += 1
                seq.last_logits = logits
        return tokens, dists

    def release(self, seq: DraftSequence) -> None:
        self.backend.release(seq.backend_state)


class TorchBackend:
    """Next-token logits from the shared torch ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def new_state(self):
        return self.runner.new_cache()

    def feed(self, state, token_ids):
        return self.runner.forward(state, token_ids)[-1]

    def truncate(self, state, length):
        state.truncate(length)

    def release(self, state):
        pass


def torch_drafter(spec: str, dtype: str = "float32", device: str = "cpu") -> ModelDrafter:
    r = ModelRunner.load(spec, dtype, device)
    return ModelDrafter(TorchBackend(r), "torch", spec, r.fingerprint, r.vocab_size, r.max_context,
                        r.weight_bytes, r.kv_bytes_per_token)


class LlamaCppBackend:
    """A GGUF model run by llama.cpp. One llama.cpp context per session, reused from a pool
    (the weights are memory-mapped once and shared)."""

    def __init__(self, gguf_path: str, n_ctx: int, n_threads: int, max_contexts: int):
        from llama_cpp import Llama

        self._make = lambda: Llama(gguf_path, n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                   n_batch=min(512, n_ctx), logits_all=False, verbose=False)
        self._free: list[Any] = [self._make()]
        self._made = 1
        self._max = max_contexts
        self._lock = threading.Lock()
        self.n_vocab = self._free[0].n_vocab()
        self.n_ctx = n_ctx

    def new_state(self):
        with self._lock:
            if self._free:
                llm = self._free.pop()
            elif self._made < self._max:
                self._made += 1
                llm = None
            else:
                raise ResourceExhausted(f"draft is at its limit of {self._max} llama.cpp contexts")
        if llm is None:
            llm = self._make()
        llm.n_tokens = 0
        return llm

    def feed(self, llm, token_ids):
        import numpy as np

        if llm.n_tokens + len(token_ids) > self.n_ctx:
            raise InvalidArgument(f"draft context of {self.n_ctx} tokens is full")
        llm.eval(token_ids)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(self.n_vocab,))
        return torch.from_numpy(logits.copy())

    def truncate(self, llm, length):
        llm.n_tokens = min(llm.n_tokens, length)  # the next eval drops the KV entries past it

    def release(self, llm):
        llm.n_tokens = 0
        with self._lock:
            self._free.append(llm)


def llamacpp_drafter(spec: str, n_ctx: int, n_threads: int, max_sessions: int) -> ModelDrafter:
    src = models.resolve(spec)
    if src.gguf_path is None:
        raise InvalidArgument(f"the llama.cpp draft engine needs a GGUF model, got {spec!r}")
    tok = models.load_tokenizer(src)
    backend = LlamaCppBackend(str(src.gguf_path), n_ctx, n_threads, max_sessions)
    size = src.gguf_path.stat().st_size
    return ModelDrafter(backend, "llamacpp", spec, models.tokenizer_fingerprint(tok), backend.n_vocab, n_ctx, size, 0)


@dataclass
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from
    max_ngram down to min_ngram) and propose what followed it. Proposals are
    deterministic, so q~ is one-hot and the acceptance rule accepts with probability p(x)."""

    max_ngram: int = 4
    min_ngram: int = 1
    engine: str = "ngram"
    model: str = "ngram"
    fingerprint: str = ""
    vocab_size: int = 0
    max_context: int = 1 << 30
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0

    def new_sequence(self, prompt_ids):
        return DraftSequence(None, list(prompt_ids))

    def propose(self, seq, k, params, max_support, generator):
        toks = seq.tokens
        out: list[int] = []
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            pattern = toks[-n:]
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start:start + n] == pattern:
                    out = toks[start + n:start + n + k]
                    break
            if out:
                break
        seq.tokens.extend(out)
        return list(out), [([t], [1.0]) for t in out]

    def rewind(self, seq, keep):
        del seq.tokens[keep:]

    def release(self, seq):
        pass
