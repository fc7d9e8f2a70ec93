"""TTFT of prompts of 200+ tokens (4 ShareGPT/HumanEval prompts, 3 reps), target-only and pipelined,
on the code of the current directory (a checkout of any commit):
    cd CHECKOUT && PYTHONPATH=. python /path/to/scripts/ttft_probe.py LOG_DIR
Prints one JSON line (median/min/max ms per mode)."""
import json, statistics, sys
sys.path.insert(0, ".")
from pathlib import Path
import specdec
from specdec.config import SpecdecConfig
from specdec.lab.live import start_stack
from specdec.lab.workloads import default_prompts
from specdec.client import Client
prompts = [p for p in default_prompts("summarization,code,chat", 40, 0) if len(p.ids) >= 200][:4]
stack = start_stack(SpecdecConfig(), Path(sys.argv[1]))
out = {"code": specdec.__file__, "prompt_tokens": [len(p.ids) for p in prompts]}
try:
    with Client(stack.address("orchestrator")) as c:
        c.complete(token_ids=prompts[0].ids, max_tokens=4, mode="pipelined")  # warm-up
        for mode in ("target-only", "pipelined"):
            t = []
            for rep in range(3):
                for p in prompts:
                    t.append(c.complete(token_ids=p.ids, max_tokens=2, ignore_eos=True, mode=mode).stats["ttft_ms"])
            out[mode] = {"median": statistics.median(t), "min": min(t), "max": max(t), "n": len(t)}
finally:
    stack.stop()
print(json.dumps(out))
