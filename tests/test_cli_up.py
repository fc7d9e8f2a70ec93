"""`specdec up` starts the three services, reports them healthy, and SIGTERM stops all three."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from specdec import Client
from specdec.launcher import free_port


def _children_alive(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_up_serves_and_sigterm_stops_all(tiny_models, tmp_path):
    port, tport, dport = free_port(), free_port(), free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[target]\ncpu_cores = ""\n[draft]\ncpu_cores = ""\n')
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--config", str(cfg), "--port", str(port),
                          "--target-port", str(tport), "--draft-port", str(dport),
                          "--target-model", str(tiny_models["target"]), "--draft-model", str(tiny_models["draft"]),
                          "--draft-engine", "torch", "--log-dir", str(tmp_path / "logs")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "specdec is up" in line:
                break
        assert any("specdec is up" in x for x in lines), "".join(lines)
        assert sum("healthy on" in x for x in lines) == 3
        assert any("drafting for the orchestrator" in x for x in lines), "".join(lines)  # "up" means it drafts
        children = _children_alive(p.pid)
        assert len(children) == 3
        with Client(f"127.0.0.1:{port}") as c:
            # a greedy request's first rounds do not wait for its draft session to open: enough
            # tokens that later rounds draft
            res = c.complete("hello", max_tokens=24, ignore_eos=True)
        assert len(res.token_ids) == 24 and res.stats["draft_tokens"] > 0
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        time.sleep(0.5)
        for pid in children:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    finally:
        if p.poll() is None:
            p.kill()
