"""How long a service takes to start serving: from its kept built weights, from its load
manifest, or through transformers; and how long the default tokenizer takes to load, pickled or
through transformers (README "Service start", BENCHMARKS §6t, §6u).

    python scripts/service_start_probe.py [--reps 5] [--services target,draft,stack,tokenizer]

Each run starts the default configuration's service (or the whole stack) as a fresh process
and times it from the process start to its health check answering SERVING (polled every
20 ms). The three ways rotate run by run, after one untimed start that writes the manifests
and the built weights: `built` (the defaults: load_manifest and keep_built_weights on),
`manifest` (keep_built_weights off: the tensors from the manifest, packed again), `cold`
(load_manifest off: through transformers). The table gives the median, min and max.
`tokenizer` times `models.load_tokenizer` in a fresh process (after importing torch, as every
service does), from the load cache's pickle (built, manifest) or through transformers (cold).
`orchestrator-process` times what an orchestrator process loads before it serves (its modules,
its tokenizer, one chat template) and adds its peak RSS (run it in a worktree of an older commit
to compare; the orchestrator imported torch before 2026-12-07).
`target-runner` and `draft-runner` time `runners.load_runner` alone in a fresh process (torch
imported, one thread) and add its peak RSS; the built-weight files of the default model
directory are listed at the end.
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


RUNNER_LOAD = ("import resource, time, torch; torch.set_num_threads(1); from specdec.launcher import local_config; "
               "from specdec.serving import runners; c = local_config().{service}; c.engine = 'torch'; "
               "c.load_manifest, c.keep_built_weights = {manifest}, {built}; t = time.perf_counter(); "
               "runners.load_runner(c, 'cpu'); "
               "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
ORCHESTRATOR_LOAD = ("import resource, sys, time; t = time.perf_counter(); import orchestrator.server; "
                     "from specdec import hf_compat, models; "
                     "tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL), cached={cached}); "
                     "hf_compat.chat_token_ids(tok, [dict(role='user', content='hi')]); "
                     "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)")
WAYS = ("built", "manifest", "cold")
PEAK_RSS_MB: dict[tuple[str, str], list[float]] = {}


def start_seconds(service: str, way: str) -> float:
    if service == "tokenizer":
        code = TOKENIZER_LOAD.format(cached=way != "cold")
        return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                    check=True).stdout.split()[-1])
    if service.endswith("-runner") or service == "orchestrator-process":
        code = (ORCHESTRATOR_LOAD.format(cached=way != "cold") if service == "orchestrator-process" else
                RUNNER_LOAD.format(service=service.removesuffix("-runner"), manifest=way != "cold",
                                   built=way == "built"))
        seconds, rss = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                 check=True).stdout.split()[-2:])
        PEAK_RSS_MB.setdefault((service, way), []).append(rss)
        return seconds
    cfg = local_config()
    for c in (cfg.target, cfg.draft):
        c.load_manifest, c.keep_built_weights = way != "cold", way == "built"
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
    print("| start | from | median s | min | max | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for service in args.services.split(","):
        start_seconds(service, "built")  # untimed: writes the manifests and built weights if they are missing
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for rep in range(args.reps):
            for way in WAYS[rep % 3:] + WAYS[:rep % 3]:
                times[way].append(start_seconds(service, way))
        for way in WAYS:
            t = times[way]
            rss = PEAK_RSS_MB.get((service, way))
            print(f"| {service} | {way} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} | "
                  f"{f'{statistics.median(rss):.0f}' if rss else ''} |", flush=True)
    from specdec import models

    directory = models.hf_directory(models.resolve(models.DEFAULT_TARGET_MODEL))
    for f in sorted(models.load_cache_dir(directory, create=False).glob("built-*.safetensors")):
        print(f"{f.name}: {f.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
