"""Where the two cores go under load: CPU seconds per wall second of each service and of the
load generator, C clients at once (BENCHMARKS.md §6w).

    python scripts/cpu_share_probe.py LOG_DIR [--clients 1,8,16] [--reps 2] [--tokens 128]

Starts the default stack (`specdec.lab.live.start_stack`), then for each C sends C ShareGPT chat
prompts (chat template, seed 0) from C client threads in this process at once, pipelined, k = 8,
greedy, EOS ignored (the concurrency sweep's sender, `specdec.lab.load`). Around each batch it
reads each process's user + system CPU time (/proc/PID/stat; the services' child processes are
none) and reports, per C, aggregate tok/s and the cores each used on average (CPU s / wall s):
target, draft, orchestrator, and this process (the clients). Prints one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
from specdec.client import Client  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.lab.live import start_stack  # noqa: E402
from specdec.lab.load import drive, ours_sender  # noqa: E402
from specdec.lab.workloads import default_prompts  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # fields 14 and 15 of stat(5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log_dir")
    ap.add_argument("--clients", default="1,8,16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    prompts = default_prompts("chat", max(levels), 0)
    stack = start_stack(SpecdecConfig(), Path(a.log_dir))
    rows: dict[int, dict[str, list[float]]] = {c: {} for c in levels}
    try:
        pids = {s: p.pid for s, p in stack.procs.items()}
        pids["clients"] = os.getpid()
        address = stack.address("orchestrator")
        with Client(address) as c:
            c.complete(token_ids=prompts[0].ids, max_tokens=16)  # warm-up
        for _ in range(a.reps):
            for clients in levels:
                jobs = prompts[:clients]
                start, send = ours_sender(address, "pipelined", a.tokens, 8)
                before, t0 = {s: cpu_seconds(p) for s, p in pids.items()}, time.perf_counter()
                seconds, timings = drive(clients, jobs, start, send)
                wall = time.perf_counter() - t0
                row = rows[clients]
                row.setdefault("tok_s", []).append(sum(t.tokens for t in timings) / seconds)
                for s, p in pids.items():
                    row.setdefault(f"{s}_cores", []).append((cpu_seconds(p) - before[s]) / wall)
                print(clients, {k: round(v[-1], 2) for k, v in row.items()}, file=sys.stderr, flush=True)
    finally:
        stack.stop()
    out = {"command": "python scripts/cpu_share_probe.py " + " ".join(sys.argv[1:]),
           "clients": {str(c): {k: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                    "max": round(max(v), 2)} for k, v in row.items()} for c, row in rows.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
