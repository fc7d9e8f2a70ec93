"""`specdec bench`: side-by-side throughput of our modes and the peers, on real prompts.

    specdec bench                         # the comparison table (BENCHMARKS.md)
    specdec bench --runs 5 --prompts 3 --max-tokens 128 --out bench-results

One run = every system generates the same prompts (greedy, fixed length, EOS ignored);
systems are interleaved inside each run (their order rotates), so ratios are measured
side by side under the same machine noise. The report gives, per system, the median /
min / max over runs of tok/s (tokens / wall time of all prompts, prefill included), and
per ratio the median / min / max of the per-run ratios.

Systems:
- ours, through the real gRPC services started by this command (`specdec up` layout,
  target pinned to core 0, draft to core 1): target-only, sequential, pipelined;
- hf-generate: transformers `generate` with the fp32 target (2 threads);
- hf-assisted: transformers assisted generation, bf16 copy of the target as assistant,
  k=4 constant (its best setting here), 2 threads;
- llamacpp-spec: llama.cpp's own speculative example, F32 target GGUF + shipped Q4_1
  draft, 2 threads (built by scripts/build_llamacpp_peer.sh; skipped if not built).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

OURS = ("target-only", "sequential", "pipelined")
PEERS = ("hf-generate", "hf-assisted", "llamacpp-spec")


@dataclass
class SystemRun:
    system: str
    run: int
    tokens: int
    seconds: float
    extra: dict = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def spread(values: list[float]) -> dict:
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0, "n": len(values)}


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def load_prompts(tokenizer, workloads: list[str], per_workload: int, seed: int = 0) -> list[dict]:
    from specdec.data import load_workload

    out = []
    for w in workloads:
        for p in load_workload(w, per_workload, seed=seed):
            ids = chat_prompt_ids(tokenizer, p.messages)
            text = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=False)
            out.append({"id": p.id, "workload": w, "ids": ids, "text": text})
    return out


class OurSystem:
    """Our modes through a running orchestrator."""

    def __init__(self, address: str):
        from specdec.client import Client

        self.client = Client(address)

    def run(self, mode: str, prompts: list[dict], max_tokens: int, k: int, **sampling) -> tuple[int, float, dict]:
        tokens, summaries = 0, []
        t0 = time.perf_counter()
        for p in prompts:
            res = self.client.complete(token_ids=p["ids"], max_tokens=max_tokens, ignore_eos=True, mode=mode, k=k,
                                       **sampling)
            tokens += len(res.token_ids)
            summaries.append(res.stats)
        seconds = time.perf_counter() - t0
        return tokens, seconds, aggregate_summaries(summaries)


def aggregate_summaries(summaries: list[dict]) -> dict:
    def tot(key):
        return sum(float(s.get(key, 0)) for s in summaries)

    rounds = tot("rounds")
    drafted = tot("draft_tokens")
    return {
        "acceptance_rate": tot("accepted_tokens") / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + tot("accepted_tokens") / rounds if rounds else 1.0,
        "ttft_ms_median": statistics.median(float(s.get("ttft_ms", 0)) for s in summaries),
        "tpot_ms_median": statistics.median(float(s.get("tpot_ms", 0)) for s in summaries),
        "rpc_overhead_ms_per_round": tot("rpc_overhead_ms_per_round") / len(summaries),
        "draft_ms_per_round": tot("draft_ms_total") / rounds if rounds else 0.0,
        "verify_ms_per_round": tot("verify_ms_total") / rounds if rounds else 0.0,
        "overlap_ms_per_round": tot("overlap_ms_total") / rounds if rounds else 0.0,
        "wasted_draft_tokens": tot("wasted_draft_tokens"),
        "rounds": rounds,
        "wire_bytes_per_round": tot("mean_wire_bytes_per_round") / len(summaries),
    }


class Peers:
    def __init__(self, threads: int = 2):
        import torch

        from specdec import models

        self.threads = threads
        src = models.resolve(models.DEFAULT_TARGET_MODEL)
        self.model = models.load_model(src, "float32")
        self.assistant = None
        self._src = src
        torch.set_num_threads(threads)

    def run(self, system: str, prompts: list[dict], max_tokens: int) -> tuple[int, float, dict]:
        from specdec import models, peers

        tokens, t0, extra = 0, time.perf_counter(), {}
        for p in prompts:
            if system == "hf-generate":
                r = peers.hf_generate(self.model, p["ids"], max_tokens, threads=self.threads, measure_prefill=False)
            elif system == "hf-assisted":
                if self.assistant is None:
                    self.assistant = models.load_model(self._src, "bfloat16")
                r = peers.hf_assisted_generate(self.model, self.assistant, p["ids"], max_tokens, 4,
                                               threads=self.threads, measure_prefill=False)
            else:
                r = peers.llamacpp_speculative(p["text"], max_tokens, draft_max=4, threads=self.threads)
                extra.setdefault("acceptance", []).append(r.extra.get("acceptance"))
            tokens += r.n_new
        return tokens, time.perf_counter() - t0, extra


def llamacpp_available() -> bool:
    try:
        from specdec import peers

        peers.ensure_llamacpp_built()
        return True
    except Exception:  # noqa: BLE001 - reported as skipped
        return False


def start_stack(config_path: str | None, log_dir: Path):
    from specdec.config import SpecdecConfig
    from specdec.launcher import Stack, local_config

    stack = Stack(local_config(SpecdecConfig.load(config_path)), log_dir).start()
    stack.wait_ready(900)
    return stack


def run_compare(a) -> dict:
    from specdec import models

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    prompts = load_prompts(tok, a.workloads.split(","), a.prompts)
    systems = [s for s in a.systems.split(",") if s]
    if "llamacpp-spec" in systems and not llamacpp_available():
        print("llamacpp-spec: not built (run scripts/build_llamacpp_peer.sh); skipped", file=sys.stderr)
        systems.remove("llamacpp-spec")
    stack = start_stack(a.config, out / "logs") if not a.address else None
    address = a.address or stack.address("orchestrator")
    try:
        ours = OurSystem(address)
        peers = Peers(a.peer_threads) if any(s in PEERS for s in systems) else None
        # warm-up: one short request per mode (caches, allocator, first-call costs)
        for mode in OURS:
            if mode in systems:
                ours.run(mode, prompts[:1], 8, a.k)
        runs: list[SystemRun] = []
        total = a.runs * len(systems)
        done = 0
        for run in range(a.runs):
            order = systems[run % len(systems):] + systems[: run % len(systems)]
            for system in order:
                if system in OURS:
                    tokens, seconds, extra = ours.run(system, prompts, a.max_tokens, a.k)
                else:
                    tokens, seconds, extra = peers.run(system, prompts, a.max_tokens)
                runs.append(SystemRun(system, run, tokens, seconds, extra))
                done += 1
                print(f"[{done}/{total}] run {run + 1} {system:<13} {tokens / seconds:7.1f} tok/s", file=sys.stderr,
                      flush=True)
    finally:
        if stack is not None:
            stack.stop()
    result = summarize_compare(runs, systems, a, prompts)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    md = compare_markdown(result)
    (out / "compare.md").write_text(md)
    print(md)
    return result


RATIOS = [("pipelined", "target-only"), ("pipelined", "sequential"), ("pipelined", "hf-assisted"),
          ("pipelined", "hf-generate"), ("pipelined", "llamacpp-spec"), ("sequential", "target-only"),
          ("hf-assisted", "hf-generate")]


def summarize_compare(runs: list[SystemRun], systems: list[str], a, prompts) -> dict:
    per = {s: [r for r in runs if r.system == s] for s in systems}
    table = {s: {"tok_s": spread([r.tok_s for r in rs]), "extra": rs[-1].extra} for s, rs in per.items() if rs}
    ratios = {}
    for num, den in RATIOS:
        if num in per and den in per:
            vals = [n.tok_s / d.tok_s for n, d in zip(per[num], per[den]) if d.tok_s > 0]
            if vals:
                ratios[f"{num} / {den}"] = spread(vals)
    return {"command": " ".join(["specdec", "bench"] + sys.argv[2:]) if sys.argv[1:2] == ["bench"] else "specdec bench",
            "settings": {"runs": a.runs, "max_tokens": a.max_tokens, "k": a.k, "workloads": a.workloads,
                         "prompts_per_workload": a.prompts, "peer_threads": a.peer_threads},
            "prompts": [p["id"] for p in prompts], "systems": table, "ratios": ratios,
            "runs": [asdict(r) | {"tok_s": r.tok_s} for r in runs]}


def compare_markdown(result: dict) -> str:
    lines = ["| system | tok/s median | min | max | spread % | acceptance | TTFT ms (median) | RPC ms/round |",
             "|---|---|---|---|---|---|---|---|"]
    for s, row in result["systems"].items():
        t, e = row["tok_s"], row["extra"]
        acc = e.get("acceptance_rate")
        if acc is None and e.get("acceptance"):
            vals = [x for x in e["acceptance"] if x is not None]
            acc = sum(vals) / len(vals) if vals else None
        lines.append(f"| {s} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {t['spread_pct']:.0f} | "
                     f"{'' if acc is None else f'{acc:.3f}'} | "
                     f"{e['ttft_ms_median']:.0f} | {e['rpc_overhead_ms_per_round']:.2f} |".replace(
                         "| nan |", "| |") if "ttft_ms_median" in e else
                     f"| {s} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {t['spread_pct']:.0f} | "
                     f"{'' if acc is None else f'{acc:.3f}'} | | |")
    lines += ["", "| ratio (per run, side by side) | median | min | max |", "|---|---|---|---|"]
    for name, r in result["ratios"].items():
        lines.append(f"| {name} | {r['median']:.2f}× | {r['min']:.2f}× | {r['max']:.2f}× |")
    return "\n".join(lines) + "\n"


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmark our modes against the peers, side by side")
    b.add_argument("--config", help="TOML config for the services this command starts")
    b.add_argument("--address", help="use a running orchestrator instead of starting one")
    b.add_argument("--workloads", default="chat,code", help="comma list of chat, summarization, code, math")
    b.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--runs", type=int, default=3)
    b.add_argument("--k", type=int, default=8)
    b.add_argument("--systems", default=",".join(OURS + PEERS))
    b.add_argument("--peer-threads", type=int, default=2)
    b.add_argument("--out", default="bench-results")
    b.set_defaults(fn=lambda a: run_compare(a) and 0)
    # the studies and the tuner (specdec/studies.py, specdec/tune.py)
    from specdec import studies, tune

    studies.add_parser(sub)
    tune.add_parser(sub)
