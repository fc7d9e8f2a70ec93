"""Baselines we compare specdec against. Each runs one prompt and returns a `PeerResult`.

- `hf_generate`: greedy transformers `generate`, the exactness reference. EOS does not stop
  it (eos_token_id=None), so exactly `max_new_tokens` tokens come back.
- `hf_assisted_generate`: transformers assisted generation (speculative decoding) with a
  constant number of assistant tokens per round; greedy, same no-EOS rule. The usual
  assistant is a bf16 copy of the target (`models.load_model(src, "bfloat16")`).
- `llamacpp_speculative`: llama.cpp's own speculative example (`llama-speculative` or
  `llama-speculative-simple`) on an F32 GGUF of the target with the shipped Q4_1 GGUF as the
  draft. The binaries are built by scripts/build_llamacpp_peer.sh from the llama.cpp sources
  vendored in the llama-cpp-python 0.3.36 sdist, into $SPECDEC_CACHE_DIR/llamacpp-peer/bin.

Timing: `seconds` is the wall time of the whole call for the HF peers (prefill included);
`decode_s`/`decode_tokens_per_s` leave the prefill out, to compare with llama.cpp, whose
"decoded N tokens in T seconds" line leaves its prompt encoding out too. For the HF peers the
prefill is measured by one separate forward pass over the prompt (`measure_prefill`).
"""
from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec import models

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "scripts" / "build_llamacpp_peer.sh"
LLAMACPP_BINARIES = ("llama-speculative", "llama-speculative-simple", "llama-quantize")


@dataclass
class PeerResult:
    peer: str
    tokens: list[int] | None  # generated ids (None for llama.cpp, which prints text only)
    text: str | None  # generated text, when the peer gives it
    n_new: int  # generated tokens as the peer counts them
    seconds: float  # wall time of the generation call
    decode_s: float  # generation time without the prompt's prefill
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.n_new / self.seconds if self.seconds > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.n_new / self.decode_s if self.decode_s > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# transformers


def _greedy_config(model, max_new_tokens: int, pad_token_id: int | None):
    gc = copy.deepcopy(model.generation_config)
    gc.do_sample = False
    gc.num_beams = 1
    gc.temperature = None
    gc.top_p = None
    gc.top_k = None
    gc.max_new_tokens = max_new_tokens
    gc.max_length = None
    gc.min_new_tokens = None
    gc.min_length = 0
    gc.eos_token_id = None  # exactly max_new_tokens tokens, EOS included if greedy picks it
    if pad_token_id is None:
        pad_token_id = gc.pad_token_id
    if pad_token_id is None:
        eos = getattr(model.config, "eos_token_id", None)
        pad_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
    gc.pad_token_id = pad_token_id if pad_token_id is not None else 0
    return gc


def _prefill_seconds(model, ids) -> float:
    import torch

    from specdec import hf_compat

    with torch.inference_mode():
        cache = hf_compat.new_dynamic_cache(model)
        t0 = time.perf_counter()
        hf_compat.forward_logits(model, ids, cache)
        return time.perf_counter() - t0


def _as_input(model, prompt_ids):
    import torch

    return torch.tensor([list(map(int, prompt_ids))], dtype=torch.long, device=model.device)


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def hf_generate(model, prompt_ids: list[int], max_new_tokens: int, *, pad_token_id: int | None = None,
                threads: int | None = None, measure_prefill: bool = True) -> PeerResult:
    """Greedy `generate`, no EOS stopping: the exactness reference."""
    import torch

    _set_threads(threads)
    ids = _as_input(model, prompt_ids)
    gc = _greedy_config(model, max_new_tokens, pad_token_id)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, eos_token_id=None)
        seconds = time.perf_counter() - t0
    new = [int(t) for t in out[0, ids.shape[1]:]]
    if len(new) != max_new_tokens:
        raise RuntimeError(f"generate returned {len(new)} tokens, expected {max_new_tokens}")
    prefill = _prefill_seconds(model, ids) if measure_prefill else 0.0
    return PeerResult("hf_generate", new, None, len(new), seconds, max(seconds - prefill, 1e-9),
                      {"prefill_s": prefill, "prompt_tokens": ids.shape[1],
                       "threads": torch.get_num_threads()})


def hf_assisted_generate(model, assistant_model, prompt_ids: list[int], max_new_tokens: int,
                         num_assistant_tokens: int = 4, *, pad_token_id: int | None = None,
                         threads: int | None = None, measure_prefill: bool = True) -> PeerResult:
    """transformers assisted generation, greedy, constant `num_assistant_tokens` per round.

    transformers reads the schedule from the *assistant's* generation config, and by default
    also stops drafting early when the assistant's confidence drops below 0.4
    (assistant_confidence_threshold); that is turned off (0) so every round drafts exactly
    `num_assistant_tokens`. The assistant's config is restored afterwards.
    extra: target_forwards (verification rounds, prefill excluded), tokens_per_round, and
    accept_rate = accepted draft tokens / drafted tokens, derived from the round count.
    """
    import torch

    _set_threads(threads)
    ids = _as_input(model, prompt_ids)
    gc = _greedy_config(model, max_new_tokens, pad_token_id)
    gc.num_assistant_tokens = num_assistant_tokens
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0

    saved = assistant_model.generation_config
    agc = copy.deepcopy(saved)
    agc.num_assistant_tokens = num_assistant_tokens
    agc.num_assistant_tokens_schedule = "constant"
    agc.assistant_confidence_threshold = 0.0
    assistant_model.generation_config = agc

    calls = {"target": 0, "assistant": 0}

    def counter(name):
        def hook(module, args, kwargs):
            calls[name] += 1
        return hook

    handles = [model.register_forward_pre_hook(counter("target"), with_kwargs=True),
               assistant_model.register_forward_pre_hook(counter("assistant"), with_kwargs=True)]
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, eos_token_id=None,
                                 assistant_model=assistant_model)
            seconds = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
        assistant_model.generation_config = saved
    new = [int(t) for t in out[0, ids.shape[1]:]]
    if len(new) != max_new_tokens:
        raise RuntimeError(f"assisted generate returned {len(new)} tokens, expected {max_new_tokens}")
    prefill = _prefill_seconds(model, ids) if measure_prefill else 0.0
    # the first target forward is the prefill, which also yields the first token
    rounds = max(calls["target"] - 1, 1)
    accepted = max(len(new) - 1 - rounds, 0)  # each round adds its accepted drafts + 1 target token
    return PeerResult("hf_assisted_generate", new, None, len(new), seconds, max(seconds - prefill, 1e-9),
                      {"prefill_s": prefill, "prompt_tokens": ids.shape[1], "k": num_assistant_tokens,
                       "target_forwards": calls["target"], "assistant_forwards": calls["assistant"],
                       "tokens_per_round": (len(new) - 1) / rounds,
                       "accept_rate": accepted / (rounds * num_assistant_tokens),
                       "threads": torch.get_num_threads()})


# ---------------------------------------------------------------------------------------------
# llama.cpp


def llamacpp_root() -> Path:
    return models.cache_dir() / "llamacpp-peer"


def llamacpp_binary(name: str) -> Path:
    return llamacpp_root() / "bin" / name


def ensure_llamacpp_built(build: bool = False) -> None:
    """Raise FileNotFoundError unless the binaries exist; with build=True, build them (minutes)."""
    missing = [b for b in LLAMACPP_BINARIES if not os.access(llamacpp_binary(b), os.X_OK)]
    if not missing:
        return
    if not build:
        raise FileNotFoundError(f"llama.cpp peer binaries missing ({', '.join(missing)}): run {BUILD_SCRIPT}")
    subprocess.run(["bash", str(BUILD_SCRIPT)], check=True)


def shipped_q4_1_gguf(spec: str = models.DEFAULT_DRAFT_MODEL) -> Path:
    src = models.resolve(spec)
    if src.gguf_path is None:
        raise ValueError(f"{spec} is not a GGUF model")
    return src.gguf_path


def f32_gguf(src_gguf: Path | None = None) -> Path:
    """An F32 GGUF of the target (the llama.cpp peer's target).

    The shipped file is Q4_1, so the F32 copy holds the dequantized Q4_1 weights: the same
    weights that transformers dequantizes into the torch fp32 target.
    """
    return requantized_gguf("F32", src_gguf)


def requantized_gguf(ftype: str, src_gguf: Path | None = None) -> Path:
    """A copy of the shipped GGUF in another llama.cpp type (F32, F16, Q8_0, ...), made once with
    `llama-quantize --allow-requantize <in> <out> <ftype>` into the llama.cpp peer's models folder."""
    src_gguf = Path(src_gguf or shipped_q4_1_gguf())
    out_dir = llamacpp_root() / "models"
    out = out_dir / f"{src_gguf.stem}.{ftype}.gguf"
    if out.exists() and out.stat().st_mtime >= src_gguf.stat().st_mtime:
        return out
    ensure_llamacpp_built()
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".tmp-", suffix=".gguf")
    os.close(fd)
    try:
        proc = subprocess.run([str(llamacpp_binary("llama-quantize")), "--allow-requantize", str(src_gguf), tmp, ftype],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_FLOAT = r"([0-9.]+|nan|-?inf)"
_RE_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds, speed:\s+" + _FLOAT + " t/s")
_RE_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+" + _FLOAT + r" seconds, speed:\s+" + _FLOAT + " t/s")
_RE_STAT = re.compile(r"^(?:[^\n]*?\s)?(n_draft|n_predict|n_drafted|n_accept|accept)\s+=\s+" + _FLOAT, re.M)


def parse_speculative_output(stderr: str) -> dict:
    """The timing and acceptance lines that llama-speculative(-simple) prints at the end."""
    out: dict = {}
    m = _RE_ENCODED.search(stderr)
    if m:
        out.update(prompt_tokens=int(m[1]), encode_s=float(m[2]), encode_tokens_per_s=float(m[3]))
    m = _RE_DECODED.search(stderr)
    if not m:
        raise RuntimeError("no 'decoded N tokens in T seconds' line in the llama.cpp output:\n" + stderr[-3000:])
    out.update(decoded_tokens=int(m[1]), decode_s=float(m[2]), decode_tokens_per_s=float(m[3]))
    for key, val in _RE_STAT.findall(stderr):
        out.setdefault(key, float(val) if key == "accept" else int(float(val)))
    if "accept" in out:
        out["accept_rate"] = out.pop("accept") / 100.0
    return out


def _default_cpus(threads: int) -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus[:max(threads, 1)])


def llamacpp_speculative(prompt_text: str, max_new_tokens: int, *, draft_max: int = 4, draft_min: int = 0,
                         draft_p_min: float = 0.0, threads: int = 2, draft_threads: int | None = None,
                         cpus: str | None = "auto", ctx_size: int = 4096, binary: str = "llama-speculative",
                         target_gguf: Path | None = None, draft_gguf: Path | None = None,
                         ignore_eos: bool = True, seed: int = 0, extra_args: tuple[str, ...] = (),
                         timeout: float = 900) -> PeerResult:
    """Run llama.cpp's speculative example once, greedy, and parse its printed statistics.

    prompt_text: the prompt, already chat-templated (special tokens are parsed; no BOS is
    added for SmolLM2, whose GGUF says add_bos_token=false). Draft length is fixed at
    `draft_max` (draft_p_min=0 turns off llama.cpp's confidence cut-off). `cpus` pins the
    process with taskset ("auto": the first `threads` CPUs of this process's affinity;
    None: no pinning). `ignore_eos` keeps it generating past EOS, like the HF peers; note
    that llama.cpp does this by banning EOS, which changes the text after the point where
    greedy would have picked EOS (timing is unaffected). llama.cpp stops at the end of the
    verification round that passes `max_new_tokens`, so it may report a few tokens more.
    """
    ensure_llamacpp_built()
    target = Path(target_gguf) if target_gguf else f32_gguf()
    draft = Path(draft_gguf) if draft_gguf else shipped_q4_1_gguf()
    # flags as printed by `llama-speculative --help` in this llama.cpp version (0.3.36 sdist):
    # --draft-max/--draft-min were removed in favour of --spec-draft-n-max/--spec-draft-n-min
    nd = draft_threads or threads
    cmd = [str(llamacpp_binary(binary)),
           "-m", str(target), "-md", str(draft),
           "-p", prompt_text, "--no-escape",  # the prompt is used verbatim (no backslash escapes)
           "-n", str(max_new_tokens),
           "--temp", "0", "--top-k", "1", "-s", str(seed),
           "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", str(draft_min),
           "--spec-draft-p-min", str(draft_p_min),
           "-t", str(threads), "-tb", str(threads), "-td", str(nd), "-tbd", str(nd),
           "-c", str(ctx_size), "--color", "off",
           *(["--ignore-eos"] if ignore_eos else []),
           *extra_args]
    if binary == "llama-speculative":
        # one draft sequence (-np 1: a chain, not a tree); p-split only matters with more
        cmd += ["-np", "1", "--spec-draft-p-split", "1.0"]
    else:  # llama-speculative-simple goes through common_speculative, which needs the type named
        cmd += ["--spec-type", "draft-simple"]
    if cpus == "auto":
        cpus = _default_cpus(threads)
    if cpus and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus, *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, errors="replace")
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} failed ({proc.returncode}): {shlex.join(cmd[:8])} ...\n{proc.stderr[-4000:]}")
    stats = parse_speculative_output(proc.stderr + "\n" + proc.stdout)
    text = proc.stdout
    # stdout holds "\n\n" + prompt + generated text + "\n\n"
    idx = text.find(prompt_text)
    if idx >= 0:
        text = text[idx + len(prompt_text):]
    text = text.rstrip("\n")
    extra = dict(stats, wall_s=wall, command=cmd, draft_max=draft_max, threads=threads, cpus=cpus,
                 binary=binary)
    return PeerResult(f"llamacpp:{binary}", None, text, stats["decoded_tokens"],
                      stats.get("encode_s", 0.0) + stats["decode_s"], stats["decode_s"], extra)
