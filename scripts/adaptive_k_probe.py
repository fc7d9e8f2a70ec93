"""Adaptive k against fixed k at target temperature 1.0 (issue 11), with target-only in the
same stack: 4 ShareGPT/HumanEval prompts, 128 new tokens, seeds fixed, `--reps` times.
    python scripts/adaptive_k_probe.py LOG_DIR [--reps 2]
Starts the default stack twice (orchestrator.adaptive_k false, then true), alternating, and
prints one JSON line: tok/s (all tokens / wall time) per configuration and mode, per rep."""
import argparse, json, sys, time
sys.path.insert(0, ".")
from pathlib import Path
from specdec.config import SpecdecConfig
from specdec.lab.live import start_stack
from specdec.lab.workloads import default_prompts
from specdec.client import Client

ap = argparse.ArgumentParser()
ap.add_argument("log_dir")
ap.add_argument("--reps", type=int, default=2)
a = ap.parse_args()
prompts = default_prompts("chat,code", 2, 0)
out: dict = {"prompt_tokens": [len(p.ids) for p in prompts]}
for rep in range(a.reps):
    for adaptive in (False, True):
        cfg = SpecdecConfig()
        cfg.orchestrator.adaptive_k = adaptive
        stack = start_stack(cfg, Path(a.log_dir) / f"rep{rep}-adaptive{int(adaptive)}")
        try:
            with Client(stack.address("orchestrator")) as c:
                c.complete(token_ids=prompts[0].ids, max_tokens=16, temperature=1.0)  # warm-up
                for mode in ("target-only", "pipelined"):
                    tokens, t0 = 0, time.perf_counter()
                    for i, p in enumerate(prompts):
                        r = c.complete(token_ids=p.ids, max_tokens=128, ignore_eos=True, temperature=1.0,
                                       seed=1000 + i, mode=mode)
                        tokens += len(r.token_ids)
                    key = f"{'adaptive' if adaptive else 'fixed-k8'}/{mode}"
                    out.setdefault(key, []).append(round(tokens / (time.perf_counter() - t0), 2))
                    print(key, out[key][-1], file=sys.stderr, flush=True)
        finally:
            stack.stop()
print(json.dumps(out))
