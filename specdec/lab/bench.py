"""`specdec bench`: side-by-side throughput of our modes and the peers, on real prompts.

    specdec bench                         # the comparison tables, outputs of 128 and 256 tokens
    specdec bench --runs 5 --prompts 3 --max-tokens 128 --out bench-results
    specdec bench --tiny --max-tokens 8   # tiny random models: checks the machinery in seconds

One run = every system generates the same prompts (greedy, fixed length, EOS ignored), once
per output length (`--max-tokens`, one table each);
systems are interleaved inside each run (their order rotates), so ratios are measured
side by side under the same machine noise. The report gives, per system, the median /
min / max over runs of tok/s (tokens / wall time of all prompts, prefill included), and
per ratio the median / min / max of the per-run ratios.

Systems:
- ours, through the real gRPC services started by this command (`specdec up` layout,
  target pinned to core 0, draft to core 1; `--config` or `--tiny` choose the models):
  target-only, sequential, pipelined;
- hf-generate: transformers `generate` with the same fp32 target (2 threads);
- hf-assisted: transformers assisted generation, bf16 copy of the target as assistant,
  k=4 constant (its best setting here), 2 threads;
- llamacpp-spec: llama.cpp's own speculative example, F32 target GGUF + shipped Q4_1
  draft, 2 threads (built by scripts/build_llamacpp_peer.sh; skipped if not built), once per
  draft length in `--llamacpp-ks` (systems llamacpp-spec-k4, -k8, ...), so that it runs at its
  best k.

Decode rate: besides tok/s, each system reports tokens per second of generation without the
prompt's prefill: ours from each request's own summary (tokens after the first / time after
the first token), llama.cpp from what its example prints ("decoded N tokens in T seconds").
"pipelined decode / llamacpp-spec best k" (and the same for sequential) is, per run, our decode
rate over the highest of llama.cpp's decode rates at its draft lengths in that run.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.devices import parse_int_ranges
from specdec.lab.analysis import aggregate_summaries, spread
from specdec.lab.live import base_config, start_stack
from specdec.lab.report import compare_markdown
from specdec.lab.workloads import TokenizedPrompt, default_prompts
from specdec.modes import Mode

OURS = (Mode.TARGET_ONLY.label, Mode.SEQUENTIAL.label, Mode.PIPELINED.label)
PEERS = ("hf-generate", "hf-assisted", "llamacpp-spec")
LLAMACPP_SPEC = "llamacpp-spec"


def llamacpp_spec_system(k: int) -> str:
    return f"{LLAMACPP_SPEC}-k{k}"


def llamacpp_spec_k(system: str) -> int | None:
    """llamacpp-spec-k8 -> 8; None for other systems."""
    prefix = LLAMACPP_SPEC + "-k"
    return int(system[len(prefix):]) if system.startswith(prefix) and system[len(prefix):].isdigit() else None


@dataclass
class SystemRun:
    system: str
    run: int
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)
    length: int = 0  # new tokens asked per prompt

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float | None:
        """Generation without the prefill (`decode_tokens` over `decode_s` in extra); None if not measured."""
        s = self.extra.get("decode_s")
        return self.extra["decode_tokens"] / s if s else None


class OurSystem:
    """Our modes through a running orchestrator."""

    def __init__(self, address: str):
        from specdec.client import Client

        self.client = Client(address)

    def run(self, mode: str, prompts: list[TokenizedPrompt], max_tokens: int, k: int,
            **sampling) -> tuple[int, float, dict]:
        tokens, summaries = 0, []
        t0 = time.perf_counter()
        for p in prompts:
            res = self.client.complete(token_ids=p.ids, max_tokens=max_tokens, ignore_eos=True, mode=mode, k=k,
                                       **sampling)
            tokens += len(res.token_ids)
            summaries.append(res.stats)
        seconds = time.perf_counter() - t0
        after_first = [max(int(s.get("completion_tokens", 0)) - 1, 0) for s in summaries]
        decode_s = sum(n * float(s.get("tpot_ms", 0)) for n, s in zip(after_first, summaries)) / 1e3
        return tokens, seconds, aggregate_summaries(summaries) | {"decode_tokens": sum(after_first),
                                                                  "decode_s": decode_s}


class Peers:
    """transformers generate / assisted generation on the same target as our services, and llama.cpp."""

    def __init__(self, target_model: str, threads: int = 2):
        import torch

        from specdec import models

        self.threads = threads
        src = models.resolve(target_model)
        self.model = models.load_model(src, "float32")
        self.assistant = None
        self._src = src
        torch.set_num_threads(threads)

    def run(self, system: str, prompts: list[TokenizedPrompt], max_tokens: int) -> tuple[int, float, dict]:
        from specdec import models
        from specdec.lab import peers

        tokens, t0, extra = 0, time.perf_counter(), {}
        for p in prompts:
            if system == "hf-generate":
                r = peers.hf_generate(self.model, p.ids, max_tokens, threads=self.threads, measure_prefill=False)
            elif system == "hf-assisted":
                if self.assistant is None:
                    self.assistant = models.load_model(self._src, "bfloat16")
                r = peers.hf_assisted_generate(self.model, self.assistant, p.ids, max_tokens, 4,
                                               threads=self.threads, measure_prefill=False)
            else:
                r = peers.llamacpp_speculative(p.text, max_tokens, draft_max=llamacpp_spec_k(system),
                                               threads=self.threads)
                extra.setdefault("acceptance", []).append(r.extra.get("accept_rate"))
                extra["decode_tokens"] = extra.get("decode_tokens", 0) + r.n_new
                extra["decode_s"] = extra.get("decode_s", 0.0) + r.decode_s
            tokens += r.n_new
        return tokens, time.perf_counter() - t0, extra


def llamacpp_available() -> bool:
    try:
        from specdec.lab import peers

        peers.ensure_llamacpp_built()
        return True
    except Exception:  # noqa: BLE001 - reported as skipped
        return False


def run_compare(a) -> dict:
    from tqdm import tqdm

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, _ = base_config(a, out)
    lengths = parse_int_ranges(a.max_tokens)
    prompts = default_prompts(a.workloads, a.prompts, a.seed)
    systems = [s for s in a.systems.split(",") if s]
    unknown = [s for s in systems if s not in OURS + PEERS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; known: {', '.join(OURS + PEERS)}")
    if LLAMACPP_SPEC in systems and (a.tiny or not llamacpp_available()):
        print("llamacpp-spec: " + ("runs the shipped GGUF pair only, not --tiny" if a.tiny else
                                   "not built (run scripts/build_llamacpp_peer.sh)") + "; skipped", file=sys.stderr)
        systems.remove(LLAMACPP_SPEC)
    if LLAMACPP_SPEC in systems:
        i = systems.index(LLAMACPP_SPEC)
        systems[i:i + 1] = [llamacpp_spec_system(k) for k in parse_int_ranges(a.llamacpp_ks)]
    stack = start_stack(cfg, out / "logs") if not a.address else None
    address = a.address or stack.address("orchestrator")
    bar = tqdm(total=a.runs * len(lengths) * len(systems), desc="bench", unit="system-run", disable=a.no_progress,
               file=sys.stderr)
    try:
        ours = OurSystem(address)
        peers = Peers(cfg.target.model, a.peer_threads) if any(s not in OURS for s in systems) else None
        # warm-up: one short request per mode (caches, allocator, first-call costs)
        for mode in OURS:
            if mode in systems:
                ours.run(mode, prompts[:1], 8, a.k)
        runs: list[SystemRun] = []
        for run in range(a.runs):
            for length in lengths:
                order = systems[run % len(systems):] + systems[: run % len(systems)]
                for system in order:
                    bar.set_postfix_str(f"run {run + 1} L{length} {system}", refresh=False)
                    if system in OURS:
                        tokens, seconds, extra = ours.run(system, prompts, length, a.k)
                    else:
                        tokens, seconds, extra = peers.run(system, prompts, length)
                    runs.append(r := SystemRun(system, run, tokens, seconds, extra, length))
                    bar.update(1)
                    if a.no_progress:
                        decode = f", decode {r.decode_tok_s:7.1f}" if r.decode_tok_s else ""
                        print(f"run {run + 1} L{length} {system:<17} {r.tok_s:7.1f} tok/s{decode}", file=sys.stderr,
                              flush=True)
    finally:
        bar.close()
        if stack is not None:
            stack.stop()
    result = summarize_compare(runs, systems, lengths, a, prompts)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    md = compare_markdown(result)
    (out / "compare.md").write_text(md)
    print(md)
    return result


def run_load(a) -> dict:
    """`specdec bench --concurrency ...`: see specdec/lab/load.py."""
    from specdec.lab import load
    from specdec.lab.live import scrape_metrics
    from specdec.lab.report import load_markdown, load_plot
    from specdec.launcher import free_port

    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    a.max_tokens = parse_int_ranges(a.max_tokens)[0]
    prompts = default_prompts("chat", a.load_prompts, a.seed)
    stacks = {}

    def memory(stack) -> tuple[dict, dict]:
        rss, pool = {}, {}
        for svc in ("target", "draft", "orchestrator"):
            c = getattr(stack.cfg, svc)
            m = scrape_metrics(c.host, c.metrics_port)
            rss[svc] = m[f'specdec:memory_rss_bytes{{service="{svc}"}}']
            if f'specdec:kv_blocks_total{{service="{svc}"}}' in m:
                pool[svc] = int(m[f'specdec:kv_blocks_total{{service="{svc}"}}']
                                * m[f'specdec:kv_block_size{{service="{svc}"}}'])
        return rss, pool

    mem: dict[str, dict] = {}
    try:
        for engine in [e for e in a.target_engines.split(",") if e]:
            cfg, _ = base_config(a, out)
            cfg.target.engine = engine
            for svc in (cfg.target, cfg.draft, cfg.orchestrator):
                svc.metrics_port = free_port()
            stacks[engine] = start_stack(cfg, out / "logs" / engine)
            mem[engine] = {"start": memory(stacks[engine])[0]}
        for engine, stack in stacks.items():  # warm-up: one short request per mode
            for mode in OURS:
                OurSystem(stack.address("orchestrator")).run(mode, prompts[:1], 8, a.k)

        def show(p: load.Point) -> None:
            print(f"run {p.run + 1} C={p.clients:<3} {p.system:<24} "
                  + (f"{p.tok_s:7.1f} tok/s" if not p.error else f"failed: {p.error}"), file=sys.stderr, flush=True)

        points = load.run_sweep(a, prompts, {e: s.address("orchestrator") for e, s in stacks.items()}, out, show)
        for engine, stack in stacks.items():
            end, pool = memory(stack)
            served = sum(len(p.requests) for p in points if p.system.endswith("/" + engine))
            mem[engine].update(end=end, pool=pool, requests=served)
    finally:
        for stack in stacks.values():
            stack.stop()
    result = {"command": "specdec bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "specdec bench",
              "settings": {"concurrency": a.concurrency, "max_tokens": a.max_tokens, "k": a.k, "runs": a.runs,
                           "requests_per_client": a.requests_per_client, "target_engines": a.target_engines,
                           "prompts": [p.id for p in prompts]},
              **load.summarize(points), "memory": mem, "points": load.points_json(points)}
    (out / "load.json").write_text(json.dumps(result, indent=2))
    md = load_markdown(result)
    (out / "load.md").write_text(md)
    load_plot(out, result)
    print(md)
    return result


RATIOS = [("pipelined", "target-only"), ("pipelined", "sequential"), ("pipelined", "hf-assisted"),
          ("pipelined", "hf-generate"), ("sequential", "target-only"), ("hf-assisted", "hf-generate")]


def summarize_length(runs: list[SystemRun], systems: list[str]) -> dict:
    """One output length: tok/s (and decode tok/s where measured) per system over runs, and the
    per-run ratios (same run = side by side)."""
    per = {s: [r for r in runs if r.system == s] for s in systems}
    table = {}
    for s, rs in per.items():
        if rs:
            decode = [r.decode_tok_s for r in rs if r.decode_tok_s]
            table[s] = {"tok_s": spread([r.tok_s for r in rs]), "extra": rs[-1].extra,
                        **({"decode_tok_s": spread(decode)} if decode else {})}
    llama = [s for s in systems if llamacpp_spec_k(s) is not None]
    ratios = {}

    def ratio(name: str, vals: list[float]) -> None:
        if vals:
            ratios[name] = spread(vals)

    for num, den in RATIOS + [("pipelined", s) for s in llama]:
        if per.get(num) and per.get(den):
            ratio(f"{num} / {den}", [n.tok_s / d.tok_s for n, d in zip(per[num], per[den]) if d.tok_s > 0])
    theirs: dict[int, float] = {}  # per run: llama.cpp's best decode rate (its best k) in that run
    for x in (x for s in llama for x in per[s] if x.decode_tok_s):
        theirs[x.run] = max(theirs.get(x.run, 0.0), x.decode_tok_s)
    for ours in ("pipelined", "sequential"):
        if per.get(ours) and theirs:
            ratio(f"{ours} decode / llamacpp-spec best k decode",
                  [r.decode_tok_s / theirs[r.run] for r in per[ours] if r.decode_tok_s and r.run in theirs])
    return {"systems": table, "ratios": ratios}


def summarize_compare(runs: list[SystemRun], systems: list[str], lengths: list[int], a, prompts) -> dict:
    return {"command": " ".join(["specdec", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "specdec bench",
            "settings": {"runs": a.runs, "lengths": lengths, "k": a.k, "workloads": a.workloads, "tiny": a.tiny,
                         "prompts_per_workload": a.prompts, "peer_threads": a.peer_threads,
                         "llamacpp_ks": a.llamacpp_ks},
            "prompts": [p.id for p in prompts],
            "by_length": {str(L): summarize_length([r for r in runs if r.length == L], systems) for L in lengths},
            "runs": [asdict(r) | {"tok_s": r.tok_s, "decode_tok_s": r.decode_tok_s} for r in runs]}
