"""How long a service takes to start serving, with and without its load manifest, and how long
the default tokenizer takes to load, pickled or through transformers (README "Service start",
BENCHMARKS §6t).

    python scripts/service_start_probe.py [--reps 5] [--services target,draft,stack,tokenizer]

Each run starts the default configuration's service (or the whole stack) as a fresh process
and times it from the process start to its health check answering SERVING (polled every
20 ms). `load_manifest` on and off alternate run by run, after one untimed start that writes
the manifests; the table gives the median, min and max. `tokenizer` times
`models.load_tokenizer` in a fresh process (after importing torch, as every service does),
from the load cache's pickle (on) or through transformers (off).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

from specdec.launcher import SERVICES, Stack, is_serving, local_config


TOKENIZER_LOAD = ("import time, torch; from specdec import models; src = models.resolve(models.DEFAULT_TARGET_MODEL); "
                  "t = time.perf_counter(); models.load_tokenizer(src, cached={cached}); print(time.perf_counter() - t)")


def start_seconds(service: str, manifest: bool) -> float:
    if service == "tokenizer":
        code = TOKENIZER_LOAD.format(cached=manifest)
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.split()[-1])
    cfg = local_config()
    cfg.target.load_manifest = cfg.draft.load_manifest = manifest
    names = list(SERVICES) if service == "stack" else [service]
    with Stack(cfg, tempfile.mkdtemp(prefix="specdec-start-")) as stack:
        t0 = time.perf_counter()
        for name in names:
            stack.start_service(name)
        pending = set(names)
        while pending:
            for name in list(pending):
                if stack.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited:\n{stack.log(name)[-2000:]}")
                if is_serving(stack.address(name), timeout_s=0.5):
                    pending.discard(name)
            if time.perf_counter() - t0 > 300:
                raise TimeoutError(f"not serving after 300 s: {sorted(pending)}")
            time.sleep(0.02)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--services", default="target,draft,stack,tokenizer")
    args = ap.parse_args()
    print("| start | load manifest (tokenizer: its pickle) | median s | min | max |")
    print("|---|---|---|---|---|")
    for service in args.services.split(","):
        start_seconds(service, True)  # untimed: writes the manifests if they are missing
        times: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(args.reps):
            for manifest in ((True, False) if rep % 2 == 0 else (False, True)):
                times[manifest].append(start_seconds(service, manifest))
        for manifest in (True, False):
            t = times[manifest]
            print(f"| {service} | {'on' if manifest else 'off'} | {statistics.median(t):.2f} | {min(t):.2f} | "
                  f"{max(t):.2f} |", flush=True)


if __name__ == "__main__":
    main()
