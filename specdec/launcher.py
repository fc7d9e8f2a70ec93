"""Run the three services as local processes (what `specdec up` does, and what tests use)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.config import SpecdecConfig
from specdec.security import open_channel

SERVICES = ("target", "draft", "orchestrator")
MODULES = {"target": "target_service", "draft": "draft_service", "orchestrator": "orchestrator"}


_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this process handed out before (the OS may offer a just
    closed port again, and a stack asks for several before any service binds them)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def is_serving(address: str, timeout_s: float = 1.0, credentials: grpc.ChannelCredentials | None = None) -> bool:
    """Whether the health service at `address` answers SERVING (over TLS with `credentials`)."""
    try:
        with open_channel(address, credentials, aio=False) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
            return r.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


class Stack:
    """The target, draft and orchestrator processes of one configuration."""

    def __init__(self, cfg: SpecdecConfig, log_dir: str | Path | None = None, with_draft: bool = True):
        self.cfg = cfg
        self.with_draft = with_draft
        if not with_draft:
            cfg.orchestrator.draft_address = ""
        else:
            cfg.orchestrator.draft_address = f"{cfg.draft.host}:{cfg.draft.port}"
        cfg.orchestrator.target_address = f"{cfg.target.host}:{cfg.target.port}"
        self.dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.dir / "specdec.toml"
        self.config_path.write_text(cfg.to_toml())
        self.procs: dict[str, subprocess.Popen] = {}

    def address(self, service: str) -> str:
        c = getattr(self.cfg, service)
        return f"{c.host}:{c.port}"

    def start_service(self, service: str) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.dir / f"{service}.log", "ab") as log:  # the child keeps its own copy (restarts leak none)
            p = subprocess.Popen([sys.executable, "-m", MODULES[service], "--config", str(self.config_path)],
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[service] = p
        return p

    def start(self) -> "Stack":
        for s in SERVICES:
            if s != "draft" or self.with_draft:
                self.start_service(s)
        return self

    def wait_ready(self, timeout_s: float = 300.0, services=None,
                   credentials: grpc.ChannelCredentials | None = None) -> None:
        """Wait until `services` (all started ones) are healthy; `credentials` for TLS ports."""
        deadline = time.monotonic() + timeout_s
        pending = list(services or self.procs)
        while pending:
            for s in list(pending):
                p = self.procs[s]
                if p.poll() is not None:
                    raise RuntimeError(f"{s} service exited with {p.returncode}; log:\n{self.log(s)[-3000:]}")
                if is_serving(self.address(s), credentials=credentials):
                    pending.remove(s)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"services not ready after {timeout_s}s: {pending}")
            if pending:
                time.sleep(0.3)

    def ensure_running(self, service: str, timeout_s: float = 120.0) -> None:
        """Start `service` again if its process has exited, and wait until it is healthy."""
        p = self.procs.get(service)
        if p is None or p.poll() is not None:
            self.start_service(service)
            self.wait_ready(timeout_s, [service])

    def log(self, service: str) -> str:
        path = self.dir / f"{service}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop_service(self, service: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> None:
        p = self.procs.get(service)
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def stop(self) -> None:
        for s in reversed(SERVICES):
            self.stop_service(s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def local_config(base: SpecdecConfig | None = None, ports: dict | None = None) -> SpecdecConfig:
    """A config on free loopback ports (tests)."""
    cfg = base or SpecdecConfig()
    for s in SERVICES:
        getattr(cfg, s).port = (ports or {}).get(s) or free_port()
    return cfg
