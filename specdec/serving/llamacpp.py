"""A GGUF model in ONE llama.cpp context holding many sequences (one llama.cpp seq_id per session).

`LlamaCppRunner` implements the `BatchRunner` protocol (specdec.serving.batch) through
llama-cpp-python's low-level bindings (`llama_cpp.llama_cpp`): every step's chunks, from
all sessions, go into one `llama_batch` and one `llama_decode` call (split into several
decode calls only when the step holds more than `max_step_tokens` tokens).

- The KV cache is one pool of `n_ctx` cells shared by all sequences (`kv_unified=True`,
  the default): with `kv_unified=False` llama.cpp gives every sequence a fixed
  `n_ctx / n_seq_max` slice, which caps each session at 1/max_seqs of the pool, while the
  `BlockManager` admits a session by its own reservation, up to the whole pool.
  The price (measured): in a unified cache every token's attention spans all cells in use
  by any sequence (masked), so attention costs tokens_in_step x tokens_cached_in_total;
  16 sequences x 300 cached tokens make a 16 x 9 verify ~3.5x dearer than with 20 cached
  tokens each. `kv_unified=False` is there for callers that prefer a fixed per-session cap
  (`facts.max_context` then says it) to that cost.
- `self.blocks` is the pool's accounting (`n_ctx = num_blocks * block_size` cells); the
  sequence ids it hands out (< max_seqs) are the llama.cpp seq_ids. llama.cpp places
  the cells itself; the block tables only count them.
- Rollback is `llama_memory_seq_rm(mem, seq, length, -1)`; free is the same from 0.

`gguf_variant(spec_or_path, "f32" | "f16" | "q8_0")` makes (once, cached under
`specdec.models.cache_dir() / "gguf"`) a copy of a GGUF file in another precision with
`llama_model_quantize`; the llama.cpp target engine uses the F32 copy of the shipped
Q4_1 file, i.e. the same weights the torch fp32 target dequantizes.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specdec import models
from specdec.errors import InvalidArgument
from specdec.serving.batch import ModelFacts, SeqChunk, StepAborted, StopCheck
from specdec.serving.blocks import BlockManager

log = logging.getLogger(__name__)

_backend_lock = threading.Lock()
_backend_ready = False


def _llama():
    """The low-level bindings, with llama.cpp's backend initialised once per process."""
    global _backend_ready
    from llama_cpp import llama_cpp as L

    with _backend_lock:
        if not _backend_ready:
            L.llama_backend_init()
            _backend_ready = True
    return L


def _set_verbose(verbose: bool) -> None:
    # llama-cpp-python routes llama.cpp's log through one process-wide callback and logger
    from llama_cpp._logger import set_verbose

    set_verbose(verbose)


def _gguf_path(spec_or_path: str | os.PathLike) -> Path:
    src = models.resolve(str(spec_or_path))
    if src.gguf_path is None:
        raise InvalidArgument(f"the llama.cpp engine needs a GGUF model, got {str(spec_or_path)!r}")
    return src.gguf_path


# --------------------------------------------------------------------------------------------
# requantized copies
# --------------------------------------------------------------------------------------------

_FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def gguf_variant_path(spec_or_path: str | os.PathLike, ftype: str) -> Path:
    """Where `gguf_variant` keeps the copy (keyed by the source file's path, size and mtime)."""
    if ftype not in _FTYPES:
        raise ValueError(f"ftype must be one of {sorted(_FTYPES)}, got {ftype!r}")
    src = _gguf_path(spec_or_path).resolve()
    st = src.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return models.cache_dir() / "gguf" / f"{src.stem}-{key}.{ftype.upper()}.gguf"


def gguf_variant(spec_or_path: str | os.PathLike, ftype: str, n_threads: int = 0, verbose: bool = False) -> Path:
    """A copy of a GGUF model requantized to `ftype` ("f32", "f16" or "q8_0"), made once.

    Requantizing from a quantized file (allow_requantize) keeps exactly its weights for
    f32 (dequantization) and rounds them for f16 / q8_0. The copy is written to a temporary
    file next to its final path and renamed into place, so concurrent makers are safe.
    """
    out = gguf_variant_path(spec_or_path, ftype)
    if out.exists():
        return out
    src = _gguf_path(spec_or_path)
    L = _llama()
    _set_verbose(verbose)  # llama_model_quantize logs every tensor
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.stem}-", suffix=".tmp")
    os.close(fd)
    try:
        params = L.llama_model_quantize_default_params()
        params.ftype = getattr(L, _FTYPES[ftype])
        params.allow_requantize = True
        params.nthread = n_threads
        log.info("requantizing %s to %s at %s (once)", src, ftype, out)
        rc = L.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize({src} -> {ftype}) failed with code {rc}")
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, out)  # atomic; another process may have won the race with the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# --------------------------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------------------------


def _meta_int(L, model, key: str) -> int | None:
    buf = ctypes.create_string_buffer(64)
    if L.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    try:
        return int(buf.value.decode())
    except ValueError:
        return None


class LlamaCppRunner:
    """BatchRunner over one llama.cpp context; see the module docstring."""

    engine = "llamacpp"

    def __init__(self, L, model, ctx, facts: ModelFacts, blocks: BlockManager, n_batch: int):
        self._L = L
        self._model = model
        self._ctx = ctx
        self._mem = L.llama_get_memory(ctx)
        self.facts = facts
        self.blocks = blocks
        self.n_batch = n_batch  # most tokens in one llama_decode call
        self.n_ctx = blocks.capacity_tokens
        self._lock = threading.RLock()  # llama.cpp contexts are not thread-safe
        self._batch = L.llama_batch_init(n_batch, 0, 1)
        b = self._batch
        self._tok = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        self._seq_rows = [b.seq_id[i] for i in range(n_batch)]  # each holds 1 seq id
        self._nseq[:] = 1
        self._closed = False

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def load(cls, spec: str, pool_tokens: int, max_seqs: int = 16, n_threads: int = 1,
             max_step_tokens: int = 512, block_size: int = 16, *, n_ubatch: int | None = None,
             kv_unified: bool = True, flash_attn: bool = False, extra_buffers: bool = False,
             fingerprint: str | None = None, verbose: bool = False) -> "LlamaCppRunner":
        """Load a GGUF model (a spec as in `specdec.models.resolve`) with a KV pool of
        `pool_tokens` tokens (rounded up to whole blocks) shared by up to `max_seqs` sequences.

        `max_step_tokens` is llama.cpp's n_batch (most tokens per decode call; bigger steps
        are split); `n_ubatch` (default 128) its physical batch, which sizes the compute
        buffers. `kv_unified=False` splits the pool into max_seqs equal per-sequence caches
        (see the module docstring). `flash_attn` is off by default: on CPU it skips other
        sequences' cells (so 16 x 9 over a full unified cache is ~1.8x faster) but is ~1.6x
        slower for a 1 x 9 step, and moves logits further from the torch reference (F32 max
        |diff| ~0.06 vs ~0.04); it is also what llama-cpp-python's `Llama` uses by default.
        `fingerprint` skips loading the tokenizer when the caller already knows it.
        `extra_buffers` turns on llama.cpp's extra weight buffer types (repacking, and Intel
        AMX for quantized weights); off by default because the AMX kernels die with SIGILL
        on some virtual machines that report AMX (seen on an Intel Xeon under Firecracker),
        and they do nothing for F32/F16 weights.
        """
        if pool_tokens <= 0 or max_seqs <= 0 or max_step_tokens <= 0 or block_size <= 0:
            raise ValueError("pool_tokens, max_seqs, max_step_tokens and block_size must be > 0")
        src = models.resolve(spec)
        if src.gguf_path is None:
            raise InvalidArgument(f"the llama.cpp engine needs a GGUF model, got {spec!r}")
        path = src.gguf_path
        L = _llama()
        _set_verbose(verbose)
        if max_seqs > L.llama_max_parallel_sequences():
            raise ValueError(f"max_seqs {max_seqs} > llama.cpp's limit of {L.llama_max_parallel_sequences()}")
        blocks = BlockManager(-(-pool_tokens // block_size), block_size, max_seqs)
        n_ctx = blocks.capacity_tokens
        n_batch = max_step_tokens
        # the physical batch sizes the compute buffers (attention scores: n_ubatch x n_ctx floats
        # per head); 128 rows run as fast as 512 on CPU (measured) and need a quarter of the memory
        n_ubatch = min(n_ubatch or 128, n_batch)

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.use_extra_bufts = extra_buffers
        model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        ctx = None
        try:
            cparams = L.llama_context_default_params()
            cparams.n_ctx = n_ctx
            cparams.n_seq_max = max_seqs
            cparams.n_batch = n_batch
            cparams.n_ubatch = n_ubatch
            cparams.n_outputs_max = 0  # = n_batch: any token may ask for logits
            cparams.n_outputs_max_per_seq = 0  # default 1; a verify needs k+1 rows of one sequence
            cparams.kv_unified = kv_unified  # True: one pool, any sequence may grow up to its reservation
            cparams.n_threads = n_threads
            cparams.n_threads_batch = n_threads
            cparams.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                       else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            cparams.type_k = L.GGML_TYPE_F16
            cparams.type_v = L.GGML_TYPE_F16
            cparams.embeddings = False
            cparams.no_perf = True
            ctx = L.llama_init_from_model(model, cparams)
            if not ctx:
                raise RuntimeError(f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={max_seqs})")
            n_ctx_seq = int(L.llama_n_ctx_seq(ctx))
            if L.llama_n_ctx(ctx) < n_ctx or (kv_unified and n_ctx_seq < n_ctx):
                raise RuntimeError(f"llama.cpp gave n_ctx={L.llama_n_ctx(ctx)}, n_ctx_seq={n_ctx_seq}; "
                                   f"wanted {n_ctx} shared by all sequences")

            vocab = L.llama_model_get_vocab(model)
            n_vocab = int(L.llama_vocab_n_tokens(vocab))
            if fingerprint is None:
                tok = models.load_tokenizer(src)
                fingerprint = models.tokenizer_fingerprint(tok)
                eos = set(models.eos_token_ids(tok))
            else:
                eos = set()
            if L.llama_vocab_eos(vocab) >= 0:
                eos.add(int(L.llama_vocab_eos(vocab)))
            n_layer, n_head = L.llama_model_n_layer(model), L.llama_model_n_head(model)
            n_head_kv = L.llama_model_n_head_kv(model)
            arch = ctypes.create_string_buffer(64)
            L.llama_model_meta_val_str(model, b"general.architecture", arch, len(arch))
            a = arch.value.decode()
            head_k = _meta_int(L, model, f"{a}.attention.key_length") or L.llama_model_n_embd(model) // n_head
            head_v = _meta_int(L, model, f"{a}.attention.value_length") or head_k
            facts = ModelFacts(
                model=spec, engine="llamacpp", fingerprint=fingerprint, vocab_size=n_vocab,
                max_context=min(int(L.llama_model_n_ctx_train(model)), n_ctx, n_ctx_seq),
                eos_token_ids=sorted(eos), dtype=_ftype_name(L, model), device="cpu",
                weight_bytes=path.stat().st_size,
                kv_bytes_per_token=n_layer * n_head_kv * (head_k + head_v) * 2)  # f16 K and V
            return cls(L, model, ctx, facts, blocks, n_batch)
        except BaseException:
            if ctx:
                L.llama_free(ctx)
            L.llama_model_free(model)
            raise

    # -- the protocol --------------------------------------------------------------------------
    def forward(self, chunks: Sequence[SeqChunk], stop: StopCheck | None = None) -> list[torch.Tensor]:
        """Append every chunk to its sequence; logits [num_logits, V] float32 per chunk.

        All chunks go into one llama_decode call when they hold at most `n_batch` tokens
        together; otherwise they are packed, in order, into as few calls as needed (a chunk
        may straddle two). On any failure every chunk's sequence is rolled back to its start.
        `stop()` is asked before each llama_decode call (not inside one: llama.cpp's abort
        callback would call into Python for every graph node).
        """
        L, V = self._L, self.facts.vocab_size
        with self._lock:
            self._check_open()
            self._validate(chunks)
            grown: list[SeqChunk] = []
            try:
                for c in chunks:
                    self.blocks.ensure(c.seq, c.start + len(c.tokens))
                    grown.append(c)
                    if c.start == 0:
                        L.llama_memory_seq_rm(self._mem, c.seq, 0, -1)  # stale cells, if any
                out: list[list[np.ndarray]] = [[] for _ in chunks]
                for plan in self._plan(chunks):
                    if stop is not None and stop():
                        raise StepAborted("stopped between llama_decode calls")
                    self._decode(plan, chunks, out)
            except BaseException:
                for c in grown:
                    L.llama_memory_seq_rm(self._mem, c.seq, c.start, -1)
                    self.blocks.truncate(c.seq, c.start)
                raise
            return [torch.from_numpy(np.concatenate(rows) if rows else np.zeros((0, V), np.float32))
                    for rows in out]

    def truncate(self, seq: int, length: int) -> None:
        """Drop cache entries at positions >= length (rollback)."""
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        with self._lock:
            self._check_open()
            self._length(seq)
            if not self._L.llama_memory_seq_rm(self._mem, seq, length, -1):
                raise RuntimeError(f"llama.cpp could not remove positions >= {length} of sequence {seq}")
            self.blocks.truncate(seq, length)

    def free(self, seq: int) -> None:
        """Release the sequence's cells and blocks; a second call does nothing."""
        with self._lock:
            try:
                self.blocks.length(seq)
            except KeyError:
                return
            if not self._closed:
                self._L.llama_memory_seq_rm(self._mem, seq, 0, -1)
            self.blocks.free(seq)

    # -- helpers --------------------------------------------------------------------------------
    def cached_positions(self, seq: int) -> tuple[int, int]:
        """llama.cpp's (pos_min, pos_max) for a sequence; (-1, -1) when it holds nothing."""
        with self._lock:
            self._check_open()
            return (self._L.llama_memory_seq_pos_min(self._mem, seq),
                    self._L.llama_memory_seq_pos_max(self._mem, seq))

    def _length(self, seq: int) -> int:
        try:
            return self.blocks.length(seq)
        except KeyError:
            raise ValueError(f"sequence {seq} is not admitted (BlockManager.reserve first)") from None

    def _validate(self, chunks: Sequence[SeqChunk]) -> None:
        seen: set[int] = set()
        V, limit = self.facts.vocab_size, self.facts.max_context
        for c in chunks:
            n = len(c.tokens)
            if c.seq in seen:
                raise ValueError(f"sequence {c.seq} appears twice in one forward")
            seen.add(c.seq)
            length = self._length(c.seq)
            if c.start != length:
                raise ValueError(f"chunk for sequence {c.seq} starts at {c.start}, but {length} tokens are cached")
            if not 0 <= c.num_logits <= n:
                raise ValueError(f"num_logits must be in [0, {n}], got {c.num_logits}")
            if c.start + n > limit:
                raise ValueError(f"sequence {c.seq} would reach {c.start + n} tokens, past the context of {limit}")
            if n and not all(0 <= t < V for t in c.tokens):
                raise ValueError(f"token ids of sequence {c.seq} must be in [0, {V})")

    def _plan(self, chunks: Sequence[SeqChunk]) -> list[list[tuple[int, int, int]]]:
        """Decode calls, each a list of (chunk index, offset, count) with at most n_batch tokens."""
        plans: list[list[tuple[int, int, int]]] = [[]]
        room = self.n_batch
        for i, c in enumerate(chunks):
            off, n = 0, len(c.tokens)
            while off < n:
                if room == 0:
                    plans.append([])
                    room = self.n_batch
                take = min(room, n - off)
                plans[-1].append((i, off, take))
                off += take
                room -= take
        return [p for p in plans if p]

    def _decode(self, plan, chunks: Sequence[SeqChunk], out: list[list[np.ndarray]]) -> None:
        L, V = self._L, self.facts.vocab_size
        j = 0
        wants: list[tuple[int, int, int]] = []  # (chunk index, first batch row, rows)
        for i, off, take in plan:
            c = chunks[i]
            self._tok[j:j + take] = np.asarray(c.tokens[off:off + take], dtype=np.int32)
            self._pos[j:j + take] = np.arange(c.start + off, c.start + off + take, dtype=np.int32)
            self._out[j:j + take] = 0
            first_out = max(off, len(c.tokens) - c.num_logits)  # chunk offset of the first wanted row
            if first_out < off + take:
                self._out[j + first_out - off:j + take] = 1
                wants.append((i, j + first_out - off, off + take - first_out))
            for r in range(j, j + take):
                self._seq_rows[r][0] = c.seq
            j += take
        self._batch.n_tokens = j
        rc = L.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc}"
                               + (" (no KV slot for the batch)" if rc == 1 else ""))
        for i, row0, rows in wants:
            out[i].append(self._logits(row0, rows, V))

    def _logits(self, row0: int, rows: int, V: int) -> np.ndarray:
        """Copy of the logits of batch rows row0 .. row0+rows-1 (llama.cpp reuses its buffer)."""
        L = self._L
        first = L.llama_get_logits_ith(self._ctx, row0)
        if not first:
            raise RuntimeError(f"llama.cpp has no logits for batch row {row0}")
        if rows > 1:
            last = L.llama_get_logits_ith(self._ctx, row0 + rows - 1)
            if not last:
                raise RuntimeError(f"llama.cpp has no logits for batch row {row0 + rows - 1}")
            step = ctypes.sizeof(ctypes.c_float) * V
            if ctypes.addressof(last.contents) - ctypes.addressof(first.contents) != (rows - 1) * step:
                return np.stack([self._logits(row0 + r, 1, V)[0] for r in range(rows)])
        return np.ctypeslib.as_array(first, shape=(rows, V)).copy()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the runner is closed")

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._L.llama_batch_free(self._batch)
            self._L.llama_free(self._ctx)
            self._L.llama_model_free(self._model)
            self._seq_rows = []
            self._mem = self._ctx = self._model = None

    def __enter__(self) -> "LlamaCppRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _ftype_name(L, model) -> str:
    """The file's weight type as llama.cpp names it (e.g. "Q4_1", "F16", "all F32")."""
    name = L.llama_ftype_name(L.llama_model_ftype(model))
    return name.decode(errors="replace") if name else ""
