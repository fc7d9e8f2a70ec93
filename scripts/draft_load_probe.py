"""The draft's activations under load: C clients at once, pipelined, for draft configurations side by side (BENCHMARKS §6q).

    python scripts/draft_load_probe.py LOG_DIR [--clients 1,8] [--reps 2] [--configs x8,x16] [--prompts 16]

A 16-bit draft step of many rows costs more than an 8-bit one (9 rows: 13.3 against 9.6 ms,
scripts/draft_agreement_probe.py), and with many clients the draft steps carry one row per
session. Each configuration starts its own default stack (the overrides of
scripts/single_stream_probe.py's CONFIGS), then for each C sends C x 2 ShareGPT chat prompts
(chat template, seed 0) from C client threads at once, 128 new tokens each, greedy, EOS ignored,
pipelined at k = 8; aggregate tok/s = all tokens / wall time. Configurations alternate, --reps
times. Prints one JSON object.
"""
import argparse
import json
import sys

sys.path.insert(0, ".")
sys.path.insert(0, "scripts")
from pathlib import Path  # noqa: E402

from single_stream_probe_configs import CONFIGS  # noqa: E402
from specdec.client import Client  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.lab.live import start_stack  # noqa: E402
from specdec.lab.load import drive, ours_sender  # noqa: E402
from specdec.lab.workloads import default_prompts  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("log_dir")
ap.add_argument("--clients", default="1,8")
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--configs", default="x8,x16")
ap.add_argument("--prompts", type=int, default=16)
ap.add_argument("--tokens", type=int, default=128)
a = ap.parse_args()
prompts = default_prompts("chat", a.prompts, 0)
out: dict = {"command": "python scripts/draft_load_probe.py " + " ".join(sys.argv[1:]), "configs": {}}
for rep in range(a.reps):
    for name in a.configs.split(","):
        cfg = SpecdecConfig()
        for section, field, value in CONFIGS[name]:
            setattr(getattr(cfg, section), field, value)
        stack = start_stack(cfg, Path(a.log_dir) / f"rep{rep}-{name}")
        row = out["configs"].setdefault(name, {})
        try:
            address = stack.address("orchestrator")
            with Client(address) as c:
                c.complete(token_ids=prompts[0].ids, max_tokens=16)  # warm-up
            for clients in (int(x) for x in a.clients.split(",")):
                jobs = [prompts[i % len(prompts)] for i in range(2 * clients)]
                start, send = ours_sender(address, "pipelined", a.tokens, 8)
                seconds, timings = drive(clients, jobs, start, send)
                rate = round(sum(t.tokens for t in timings) / seconds, 1)
                row.setdefault(f"{clients} clients tok/s", []).append(rate)
                print(name, rep, clients, rate, file=sys.stderr, flush=True)
        finally:
            stack.stop()
print(json.dumps(out, indent=1))
