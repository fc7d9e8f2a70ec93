"""The draft engines. No network.

- `DraftEngine`: draft sessions in a fixed KV pool over a batched runner (llama.cpp with one
  sequence per session, or the torch runners); one model thread runs the draft steps of all
  sessions that are drafting as one forward per step.
- `NgramDraftEngine`: no model; prompt lookup (copies what followed the last matching n-gram).

Both answer the same calls: `open` (admission), `prefill`, `propose`, `cut`, `close`. A
session holds the tokens the orchestrator says it holds; `propose(keep, append, k)` keeps the
first `keep`, appends `append`, then drafts k tokens, each sampled from exactly the sparse q~
returned with it (with `guess_first`, the first is the most likely token instead: a
speculation's guess of the target's bonus token). With k = 0 it is a catch-up: the cache is
brought up to date and nothing is drafted, so that the next propose has little to feed.
`cut` makes the propose in flight finish
after its current draft step, with the tokens drafted so far (the session holds just those):
the orchestrator cuts a speculation that a rejection has made useless.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from specdec.config import DraftConfig
from specdec.errors import FailedPrecondition, InvalidArgument, NotFound
from specdec.sampling import draft_token, make_generator
from specdec.sampling_params import SamplingParams
from specdec.serving.batch import BatchRunner, ModelFacts
from specdec.serving.engine import PooledEngine
from specdec.serving.jobs import Job

MAX_K = 64
GREEDY = SamplingParams()
LONG_FEED = 64  # a propose that must first feed more tokens than this (after a fallback) is chunked like a prompt
SparseDist = tuple[list[int], list[float]]


@dataclass
class Proposal:
    token_ids: list[int]
    dists: list[SparseDist]
    draft_ms: float


@dataclass
class _Session:
    seq: int
    tokens: list[int]  # what the draft holds (the orchestrator's view of it)
    sampling: SamplingParams
    max_support: int
    reserved: int  # tokens reserved in the pool: the most it may hold
    cached: int = 0  # tokens[:cached] are in the cache
    last_logits: torch.Tensor | None = None  # [V] the prediction after tokens[:cached], when known
    proposing: "_Propose | None" = None  # the session's latest propose (done or not)


def check_open(facts: ModelFacts, prompt_ids: list[int], sampling: SamplingParams, target_fingerprint: str,
               target_vocab_size: int, max_support: int) -> None:
    """What every draft engine checks before admitting a session."""
    sampling.validate("draft_")
    if max_support < 0:
        raise InvalidArgument(f"max_support must be >= 0, got {max_support}")
    if facts.fingerprint and target_fingerprint and facts.fingerprint != target_fingerprint:
        raise FailedPrecondition(
            f"draft model {facts.model!r} uses a different tokenizer than the target (fingerprints "
            f"{facts.fingerprint[:12]} vs {target_fingerprint[:12]}); speculative decoding needs the same one")
    if facts.vocab_size and target_vocab_size and facts.vocab_size > target_vocab_size:
        raise FailedPrecondition(f"draft vocabulary ({facts.vocab_size}) is larger than the target's "
                                 f"({target_vocab_size})")
    if not prompt_ids:
        raise InvalidArgument("prompt is empty")
    if facts.vocab_size and (min(prompt_ids) < 0 or max(prompt_ids) >= facts.vocab_size):
        raise InvalidArgument(f"prompt token ids must be in [0, {facts.vocab_size})")


def check_propose(holds: int, keep: int, append: list[int], k: int, vocab_size: int) -> None:
    if not 0 <= k <= MAX_K:
        raise InvalidArgument(f"k must be in [0, {MAX_K}], got {k}")
    if not 0 <= keep <= holds:
        raise InvalidArgument(f"keep={keep} but the draft holds {holds} tokens")
    if vocab_size and append and (min(append) < 0 or max(append) >= vocab_size):
        raise InvalidArgument("appended token ids are outside the draft vocabulary")


class _Prefill(Job):
    def __init__(self, s: _Session):
        super().__init__(s.seq, 0, s.tokens, 1)
        self.s = s

    def on_logits(self, logits: torch.Tensor) -> None:  # logits [1, V]
        self.s.cached, self.s.last_logits = len(self.s.tokens), logits[-1]
        self.finish(self.elapsed_ms())


class _Propose(Job):
    """Feed what the cache lacks, then sample k tokens, feeding each but the last (the first is the
    most likely token when guess_first). With k = 0, only the feed: a catch-up."""

    def __init__(self, s: _Session, k: int, generator: torch.Generator, guess_first: bool = False):
        feed = s.tokens[s.cached:]
        super().__init__(s.seq, s.cached, feed, 1 if feed else 0)
        self.s, self.k, self.generator, self.guess_first = s, k, generator, guess_first
        self.drafted: list[int] = []
        self.dists: list[SparseDist] = []
        self.cut = False  # set by DraftEngine.cut (event loop), read after each draft step (model thread)
        if not feed:  # the cache is up to date: the first token comes from the logits the session has
            self.sample(s.last_logits)

    @property
    def splittable(self) -> bool:  # a long catch-up feed goes in chunks; draft steps never split
        return len(self.pending) > LONG_FEED

    def on_logits(self, logits: torch.Tensor) -> None:  # logits [1, V]
        s = self.s
        s.cached, s.last_logits = self.start, logits[-1]
        if self.k == 0:
            self.finish(Proposal([], [], self.elapsed_ms()))
        else:
            self.sample(logits[-1])

    def sample(self, logits: torch.Tensor) -> None:  # logits [V]
        sampling = GREEDY if self.guess_first and not self.drafted else self.s.sampling
        tok, ids, q = draft_token(logits, sampling, self.s.max_support, self.generator)
        self.s.tokens.append(tok)
        self.drafted.append(tok)
        self.dists.append((ids.tolist(), q.tolist()))
        if len(self.drafted) == self.k or self.cut:
            self.finish(Proposal(self.drafted, self.dists, self.elapsed_ms()))
        else:
            self._feed(self.start, [tok], 1)


class DraftEngine(PooledEngine[_Session]):
    role = "draft"

    def __init__(self, runner: BatchRunner, config: DraftConfig | None = None, on_step=None):
        super().__init__(runner, config or DraftConfig(), on_step)

    async def open(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, target_fingerprint: str,
                   target_vocab_size: int, max_support: int = 0, max_tokens: int = 0, max_draft: int = 0) -> None:
        """Admit a session: it reserves what the request can make it hold (prompt + max_tokens +
        two rounds of drafts), capped at the draft's context; no model work (see `prefill`)."""
        check_open(self.facts, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_support)
        least = len(prompt_ids) + 2 * max_draft + 2
        if least > self.facts.max_context:
            raise InvalidArgument(f"prompt ({len(prompt_ids)} tokens) and two rounds of drafts do not fit the "
                                  f"draft context of {self.facts.max_context}")
        need = min(self.facts.max_context, least + max(0, max_tokens))
        seq = await self._admit(session_id, need)
        self._sessions[session_id] = _Session(seq, list(prompt_ids), sampling,
                                              max_support or self.config.max_support, need)

    def prefill(self, session_id: str) -> Future:
        """-> Future[float]: the prompt's milliseconds."""
        return self.loop.submit(_Prefill(self._get(session_id)))

    def propose(self, session_id: str, keep: int, append: list[int], k: int, seed: int,
                guess_first: bool = False) -> Future:
        """-> Future[Proposal]."""
        s = self._get(session_id)
        check_propose(len(s.tokens), keep, append, k, self.facts.vocab_size)
        if keep + len(append) + k > s.reserved:
            raise InvalidArgument(f"the draft session is full ({s.reserved} tokens)")
        del s.tokens[keep:]
        s.tokens.extend(append)
        cached = s.cached
        if s.cached > keep:  # cache entries past `keep` belong to tokens that are gone
            s.cached, s.last_logits = keep, None
        if k > 0 and s.cached == len(s.tokens) and s.last_logits is None:  # nothing to feed, no logits to start from
            s.cached -= 1  # feed the last token again
        if s.cached < cached:
            self.loop.call(self.runner.truncate, s.seq, s.cached)  # in the model thread, before the job
        if k == 0 and s.cached == len(s.tokens):  # a catch-up with nothing to feed
            return _done(Proposal([], [], 0.0))
        job = s.proposing = _Propose(s, k, make_generator(seed), guess_first)
        return job.future if job.done else self.loop.submit(job)

    def cut(self, session_id: str) -> None:
        """Finish the session's propose in flight after its current draft step, with what it has
        drafted (at least one token); nothing when none is running or the session is gone."""
        s = self._sessions.get(session_id)
        if s is not None and s.proposing is not None:
            s.proposing.cut = True


@dataclass
class NgramDraftEngine:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n from max_ngram
    down to min_ngram) and propose what followed it. Proposals are deterministic, so q~ is
    one-hot and the acceptance rule accepts with probability p(x)."""

    config: DraftConfig = field(default_factory=DraftConfig)
    facts: ModelFacts = field(default_factory=lambda: ModelFacts("ngram", "ngram", "", 0, 1 << 30))
    _sessions: dict[str, list[int]] = field(default_factory=dict)

    def start(self) -> "NgramDraftEngine":
        return self

    def stop(self) -> None:
        pass

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    @property
    def kv_tokens_in_use(self) -> int:
        return 0

    async def open(self, session_id: str, prompt_ids: list[int], sampling: SamplingParams, target_fingerprint: str,
                   target_vocab_size: int, max_support: int = 0, max_tokens: int = 0, max_draft: int = 0) -> None:
        check_open(self.facts, prompt_ids, sampling, target_fingerprint, target_vocab_size, max_support)
        if session_id in self._sessions:
            raise FailedPrecondition(f"draft session {session_id!r} already open")
        self._sessions[session_id] = list(prompt_ids)

    def prefill(self, session_id: str) -> Future:
        self._get(session_id)
        return _done(0.0)

    def propose(self, session_id: str, keep: int, append: list[int], k: int, seed: int,
                guess_first: bool = False) -> Future:
        toks = self._get(session_id)
        check_propose(len(toks), keep, append, k, 0)
        t0 = time.perf_counter()
        del toks[keep:]
        toks.extend(append)
        out = self.lookup(toks, k)
        toks.extend(out)
        return _done(Proposal(out, [([t], [1.0]) for t in out], (time.perf_counter() - t0) * 1e3))

    def lookup(self, toks: list[int], k: int) -> list[int]:
        c = self.config
        for n in range(min(c.ngram_max, len(toks) - 1), c.ngram_min - 1, -1):
            pattern = toks[-n:]
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start:start + n] == pattern:
                    return toks[start + n:start + n + k]
        return []

    def cut(self, session_id: str) -> None:
        """Proposals are made at once: there is never one in flight to cut."""

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def _get(self, session_id: str) -> list[int]:
        toks = self._sessions.get(session_id)
        if toks is None:
            raise NotFound(f"no draft session {session_id!r}")
        return toks


def _done(result) -> Future:
    f: Future = Future()
    f.set_result(result)
    return f
