"""How long `specdec up` takes on a fresh machine, and then again: seconds from the command to
"specdec is up" (which waits until the orchestrator drafts), with an empty cache folder first.

    python scripts/first_start_probe.py [--starts 3] [--cache-dir DIR]

The first start converts the shipped GGUF to a safetensors copy, builds specdec's CPU kernels,
loads both models through transformers, and writes their load manifests and built weights
(README "The two commands", "Service start"); the later ones read them. DIR (default: a new
temporary folder) is emptied first and used as $SPECDEC_CACHE_DIR; the ports are free ones.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from specdec.launcher import free_port


def up_seconds(cache_dir: str, log_dir: str) -> float:
    env = dict(os.environ, SPECDEC_CACHE_DIR=cache_dir)
    ports = [str(free_port()) for _ in range(3)]
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--port", ports[0], "--target-port", ports[1],
                          "--draft-port", ports[2], "--log-dir", log_dir], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in p.stdout:
            if "specdec is up" in line:
                return time.perf_counter() - t0
        raise RuntimeError(f"specdec up exited with {p.wait()} before it was up")
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--starts", type=int, default=3)
    ap.add_argument("--cache-dir", default="")
    args = ap.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="specdec-fresh-")
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.makedirs(cache_dir)
    log_dir = tempfile.mkdtemp(prefix="specdec-up-logs-")
    for i in range(args.starts):
        print(f"start {i + 1}: {up_seconds(cache_dir, log_dir):.1f} s", flush=True)


if __name__ == "__main__":
    main()
