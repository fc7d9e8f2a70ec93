"""Single stream on the default pair, several configurations side by side (issue 11).

    python scripts/single_stream_probe.py LOG_DIR [--reps 2] [--tokens 256] [--configs k8,k4,k6,adaptive,q8_0]

Each configuration starts its own default stack (`specdec.lab.live.start_stack`), runs the 4
default prompts (2 chat, 2 code, seed 0) greedily, target-only then pipelined, `--tokens` new
tokens each (EOS ignored), and stops; the configurations alternate, `--reps` times. For the
pipelined requests it splits the rounds the way BENCHMARKS §2b does: hits (drafts ready from
the speculation), misses (a redraft after a rejection or a wrong bonus guess), mean verify
and draft ms, and the miss loss (ms per round spent on redrafts the target waited for).
Prints one JSON object (per configuration: tok/s per rep, the round split of the last rep).
"""
import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, ".")
from pathlib import Path  # noqa: E402

sys.path.insert(0, "scripts")
from single_stream_probe_configs import CONFIGS  # noqa: E402
from specdec.client import Client  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.lab.live import start_stack  # noqa: E402
from specdec.lab.workloads import default_prompts  # noqa: E402


ap = argparse.ArgumentParser()
ap.add_argument("log_dir")
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--configs", default="k8,k4,adaptive,q8_0")
a = ap.parse_args()
prompts = default_prompts("chat,code", 2, 0)


def split(results) -> dict:
    rounds = [r for res in results for r in res.rounds]
    drafting = [r for r in rounds if r.get("k", 0) > 0]
    hits = [r for r in drafting if r.get("pipeline_hit")]
    misses = [r for r in drafting if not r.get("pipeline_hit")]
    mean = lambda rs, f: round(statistics.fmean([r.get(f, 0.0) for r in rs]), 1) if rs else 0.0  # noqa: E731
    return {"rounds": len(rounds), "hits": len(hits), "misses": len(misses),
            "accepted_per_round": round(statistics.fmean([r.get("accepted", 0) for r in drafting]), 2),
            "round_ms": mean(rounds, "round_ms"), "hit_round_ms": mean(hits, "round_ms"),
            "miss_round_ms": mean(misses, "round_ms"), "verify_ms": mean(drafting, "verify_ms"),
            "draft_ms": mean(drafting, "draft_ms"), "spec_wait_ms": mean(drafting, "spec_wait_ms"),
            "wasted_draft_tokens_per_miss": mean([r for r in drafting if r.get("wasted_draft_tokens")],
                                                 "wasted_draft_tokens"),
            # after a rejection, how long the round waited for the speculation it then threw away
            "spec_wait_after_rejection_ms": mean([r for r in drafting if r.get("accepted", 0) < r["k"]],
                                                 "spec_wait_ms"),
            "miss_loss_ms_per_round": round(sum(r.get("draft_ms", 0.0) for r in misses) / max(1, len(rounds)), 1)}


out: dict = {"command": "python scripts/single_stream_probe.py " + " ".join(sys.argv[1:]),
             "prompt_tokens": [len(p.ids) for p in prompts], "configs": {}}
for rep in range(a.reps):
    for name in a.configs.split(","):
        cfg = SpecdecConfig()
        for section, field, value in CONFIGS[name]:
            setattr(getattr(cfg, section), field, value)
        stack = start_stack(cfg, Path(a.log_dir) / f"rep{rep}-{name}")
        row = out["configs"].setdefault(name, {"target-only tok/s": [], "pipelined tok/s": [], "ratio": []})
        try:
            with Client(stack.address("orchestrator")) as c:
                c.complete(token_ids=prompts[0].ids, max_tokens=16)  # warm-up
                rates = {}
                for mode in ("target-only", "pipelined"):
                    t0, results = time.perf_counter(), []
                    for p in prompts:
                        results.append(c.complete(token_ids=p.ids, max_tokens=a.tokens, ignore_eos=True, mode=mode))
                    rates[mode] = sum(len(r.token_ids) for r in results) / (time.perf_counter() - t0)
                    row[f"{mode} tok/s"].append(round(rates[mode], 1))
                row["ratio"].append(round(rates["pipelined"] / rates["target-only"], 2))
                row["rounds (last rep)"] = split(results)
                print(name, rep, row["pipelined tok/s"][-1], row["ratio"][-1], file=sys.stderr, flush=True)
        finally:
            stack.stop()
print(json.dumps(out, indent=1))
