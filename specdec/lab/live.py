"""The live stack the lab measures: our three services as local processes, the drafts it can
swap in, and the configuration it starts from.

- `base_config`: the configuration a bench / study / tune run measures (`--config`, or `--tiny`:
  tiny random models made by `make_tiny_models`) and the draft variants it can compare;
- `draft_variants`: the drafts this machine can load (the shipped Q4_1 GGUF, its llama.cpp
  re-quantizations when the llama.cpp peer is built, torch fp32/bf16 copies of the target, n-gram);
- `LiveStack`: the services on free loopback ports (`specdec up` layout), started on first use;
  `swap` restarts the draft service alone with another draft; `request` makes one timed request;
- `scrape_metrics`: a service's Prometheus /metrics as a dict.
"""
from __future__ import annotations

import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specdec.devices import resolve_draft_engine
from specdec.lab.workloads import TokenizedPrompt
from specdec.modes import Mode

# the summary fields kept in each request record
STAT_FIELDS = ("prompt_tokens", "completion_tokens", "ttft_ms", "total_ms", "rounds", "draft_tokens",
               "accepted_tokens", "accepted_by_position", "drafted_by_position", "wasted_draft_tokens",
               "draft_fallback_rounds", "rpc_overhead_ms_per_round", "seed", "finish_reason")


def make_tiny_models(root: Path, noise: float = 0.04) -> dict[str, Path]:
    """Tiny random Llama models with the SmolLM2 tokenizer (as tests/conftest.py makes them):
    a target (weights drawn with std 0.2, so that greedy output does not collapse onto one
    repeated token as it does at the usual 0.02), and a draft that is the target plus Gaussian
    noise (noise x each matrix's std): greedy agreement ~0.7. Made once per folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec import models

    root = Path(root)
    target, draft = root / "target", root / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return {"target": target, "draft": draft}
    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # perturb the matrices, leave the norms alone
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    model.save_pretrained(draft)
    tok.save_pretrained(draft)
    return {"target": target, "draft": draft}


@dataclass(frozen=True)
class DraftVariant:
    name: str
    engine: str
    model: str
    dtype: str = "float32"
    note: str = ""

    def settings(self) -> dict:
        return {"engine": self.engine, "model": self.model, "dtype": self.dtype}

    def matches(self, draft_cfg) -> bool:
        engine = resolve_draft_engine(draft_cfg.engine, draft_cfg.device)
        return (engine == self.engine and (self.engine == "ngram" or draft_cfg.model == self.model)
                and (self.engine != "torch" or draft_cfg.dtype == self.dtype))


def draft_variants(target_model: str, tiny_draft: str | None = None) -> dict[str, DraftVariant]:
    from specdec.models import DEFAULT_DRAFT_MODEL

    out = {}
    if tiny_draft:
        out["tiny-draft"] = DraftVariant("tiny-draft", "torch", tiny_draft, "float32", "noisy copy of the tiny target")
    else:
        out["torch-int4"] = DraftVariant("torch-int4", "torch", DEFAULT_DRAFT_MODEL, "int4",
                                         "4-bit torch draft (the default on AVX-512 CPUs and GPUs)")
    out["llamacpp"] = DraftVariant("llamacpp", "llamacpp", DEFAULT_DRAFT_MODEL, "float32",
                                   "shipped Q4_1 GGUF (the default on other CPUs)")
    if not tiny_draft:
        out.update(requantized_draft_variants())
    out["torch-fp32"] = DraftVariant("torch-fp32", "torch", target_model, "float32", "fp32 copy of the target")
    out["torch-bf16"] = DraftVariant("torch-bf16", "torch", target_model, "bfloat16", "bf16 copy of the target")
    out["ngram"] = DraftVariant("ngram", "ngram", "ngram", "float32", "prompt lookup, no model")
    return out


REQUANTIZED_DRAFTS = ("Q8_0", "F16")


def requantized_draft_variants() -> dict[str, DraftVariant]:
    """The shipped GGUF re-quantized by llama.cpp's own tool (when the llama.cpp peer is built:
    scripts/build_llamacpp_peer.sh), as llama.cpp drafts in other precisions. The shipped file
    is Q4_1, so these hold the same (dequantized Q4_1) weights as the fp32 target, rounded to
    the type: Q8_0 and F16 differ from the target far less than Q4_1 does at inference, since
    llama.cpp also quantizes the activations to the weights' dot-product type."""
    import os

    from specdec.lab import peers

    if not os.access(peers.llamacpp_binary("llama-quantize"), os.X_OK):
        return {}
    out = {}
    for ftype in REQUANTIZED_DRAFTS:
        name = f"llamacpp-{ftype.lower()}"
        try:
            out[name] = DraftVariant(name, "llamacpp", str(peers.requantized_gguf(ftype)), "float32",
                                     f"shipped GGUF re-quantized to {ftype} by llama-quantize")
        except Exception as e:  # noqa: BLE001 - this draft is then not offered
            print(f"draft {name}: could not be made ({e}); left out", file=sys.stderr)
    return out


NO_DRAFT = DraftVariant("none", "", "", "", "no draft service running")


def variant_of(cfg_draft, variants: dict[str, DraftVariant]) -> DraftVariant:
    for v in variants.values():
        if v.matches(cfg_draft):
            return v
    return DraftVariant("config", resolve_draft_engine(cfg_draft.engine, cfg_draft.device), cfg_draft.model,
                        cfg_draft.dtype, "from the config file")


def scrape_metrics(host: str, port: int, timeout_s: float = 5.0) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


class LiveStack:
    """Our three services on free ports, started on first use; the draft can be swapped."""

    def __init__(self, cfg, log_dir: Path, variants: dict[str, DraftVariant], retry_interval_s: float = 0.3):
        from specdec.launcher import free_port, local_config

        self.cfg = local_config(cfg)
        self.cfg.draft.metrics_port = free_port()
        self.cfg.orchestrator.probe_interval_s = retry_interval_s
        self.log_dir = Path(log_dir)
        self.variants = variants
        self.current = variant_of(self.cfg.draft, variants)
        self.stack = None
        self.client = None
        self.swap_seconds: list[float] = []

    def start(self) -> "LiveStack":
        if self.stack is None:
            from specdec.client import Client
            from specdec.launcher import Stack

            self.stack = Stack(self.cfg, self.log_dir).start()
            try:
                self.stack.wait_ready(900)
                self.client = Client(self.stack.address("orchestrator"))
                self._wait_draft(True, 120)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.stack is not None:
            self.stack.stop()
            self.stack = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _draft_info(self) -> dict:
        info = self.client.info()
        return {"available": bool(info.get("draft_available")), "engine": info.get("draft", {}).get("engine", ""),
                "model": info.get("draft", {}).get("model", "")}

    def _poke(self) -> None:
        """A tiny request, so that the orchestrator notices a draft that went away."""
        try:
            self.client.complete(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True, mode=Mode.SEQUENTIAL.label, k=1)
        except Exception:  # noqa: BLE001 - only a probe
            pass

    def _wait_draft(self, available: bool, timeout_s: float, engine: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self._draft_info()
            if st["available"] == available and (engine is None or st["engine"] == engine):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator reports draft {st}, waited for available={available} "
                                   f"engine={engine}; draft log:\n{self.stack.log('draft')[-2000:]}")
            if not available:
                self._poke()
            time.sleep(0.1)

    def swap(self, variant: DraftVariant) -> float:
        """Restart the draft service with another draft; returns the seconds it took."""
        self.start()
        if variant == self.current:
            return 0.0
        t0 = time.perf_counter()
        self.stack.stop_service("draft")
        self._wait_draft(False, 60)  # the orchestrator has noticed (and will re-read the draft's info)
        self.current = NO_DRAFT
        d = self.cfg.draft
        d.engine, d.model, d.dtype = variant.engine, variant.model, variant.dtype
        self.stack.config_path.write_text(self.cfg.to_toml())
        self.stack.start_service("draft")
        try:
            self.stack.wait_ready(900, ["draft"])
            self._wait_draft(True, 120, variant.engine)
        except BaseException:
            self.stack.stop_service("draft")
            raise
        self.current = variant
        dt = time.perf_counter() - t0
        self.swap_seconds.append(dt)
        return dt

    def draft_memory(self) -> dict:
        m = scrape_metrics(self.cfg.draft.host, self.cfg.draft.metrics_port)
        get = lambda n: m.get(f'specdec:memory_{n}{{service="draft"}}', 0.0)  # noqa: E731
        return {"rss_bytes": get("rss_bytes"), "peak_rss_bytes": get("peak_rss_bytes"),
                "weight_bytes": get("weight_bytes")}

    def info(self) -> dict:
        return self.client.info()

    def request(self, prompt: TokenizedPrompt, length: int, mode: str, k: int, temperature: float | None = None,
                draft_temperature: float | None = None, seed: int | None = None, adaptive_k: bool | None = None) -> dict:
        """One request, `length` tokens (EOS ignored), timed by the client: the study's request record
        (see specdec.lab.analysis), with every streamed chunk's arrival in `marks`. adaptive_k None
        follows the stack's config (tune, warm-up); the study sets it per cell."""
        kw = dict(token_ids=prompt.ids, max_tokens=length, ignore_eos=True, mode=mode, k=k, adaptive_k=adaptive_k)
        if temperature is not None:
            kw["temperature"] = temperature
        if draft_temperature is not None:
            kw["draft_temperature"] = draft_temperature
        if seed is not None:
            kw["seed"] = seed
        from specdec.client import ResultCollector

        collector, marks = ResultCollector(), []
        t0 = time.perf_counter()
        for chunk in self.client.generate(**kw):
            collector.add(chunk)
            marks.append([round(time.perf_counter() - t0, 6), len(collector.tokens), len(collector.rounds)])
        seconds = time.perf_counter() - t0
        res = collector.result()
        stats = {f: res.stats.get(f) for f in STAT_FIELDS}
        return {"prompt": prompt.id, "workload": prompt.workload, "tokens": len(res.token_ids),
                "seconds": seconds, "stats": stats, "rounds": res.rounds, "marks": marks}

    def warm_up(self, prompt: TokenizedPrompt, modes, k: int) -> None:
        for mode in modes:
            self.request(prompt, 8, mode, k)


def base_config(a, out: Path):
    """The configuration the study measures (and tune starts from), with its draft variants."""
    from specdec.config import SpecdecConfig

    cfg = SpecdecConfig.load(a.config)
    tiny_draft = None
    if a.tiny:
        tiny = make_tiny_models(out / "tiny-models")
        cfg.target.model = str(tiny["target"])
        cfg.draft.engine, cfg.draft.model, cfg.draft.dtype = "torch", str(tiny["draft"]), "float32"
        cfg.target.cpu_cores = cfg.draft.cpu_cores = ""
        tiny_draft = str(tiny["draft"])
    variants = draft_variants(cfg.target.model, tiny_draft)
    return cfg, variants


def start_stack(cfg, log_dir: Path):
    """The services of `cfg` on free loopback ports, ready (a plain `Stack`: no draft swaps)."""
    from specdec.launcher import Stack, local_config

    stack = Stack(local_config(cfg), log_dir).start()
    stack.wait_ready(900)
    return stack


def request_seed(base: int, prompt_index: int, run: int) -> int:
    """The seed of a sampled request: fixed per prompt and run, so settings compare on the same draws."""
    return base + 1000 * run + prompt_index


def parse_floats(spec: str) -> list[float]:
    """'0,0.6,1.0' -> [0.0, 0.6, 1.0] (the temperature grids)."""
    return [float(x) for x in spec.split(",") if x.strip()]
