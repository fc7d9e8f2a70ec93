"""`specdec up` supervises: a service that exits is restarted in place with capped backoff, each
exit and restart is logged, and the other services keep serving (item 6).

The backoff policy and the supervisor's state machine are tested without processes (a fake
stack and clock); one test runs a real `specdec up` on the tiny models and SIGKILLs services."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from specdec.supervisor import Backoff, Supervisor, describe_exit


# -- the policy -----------------------------------------------------------------------------
def test_backoff_doubles_from_half_a_second_up_to_the_cap():
    b = Backoff()
    assert [b.delay(n) for n in range(1, 10)] == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert b.delay(10_000) == 30  # no overflow, however long it keeps crashing
    assert b.delay(0) == 0.5


def test_backoff_starts_a_new_run_after_a_long_healthy_stretch():
    b = Backoff(reset_after_s=60)
    assert b.next_attempt(0, None) == 1
    assert b.next_attempt(5, None) == 6  # exited before it ever got healthy
    assert b.next_attempt(5, 59.9) == 6
    assert b.next_attempt(5, 60.0) == 1


def test_describe_exit():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(-15) == "signal SIGTERM"


# -- the supervisor over a fake stack -------------------------------------------------------
class FakeProc:
    _next_pid = 1000

    def __init__(self):
        FakeProc._next_pid += 1
        self.pid = FakeProc._next_pid
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeStack:
    def __init__(self, services=("target", "draft", "orchestrator")):
        self.procs = {s: FakeProc() for s in services}
        self.started: list[str] = []

    def start_service(self, s):
        self.started.append(s)
        self.procs[s] = FakeProc()
        return self.procs[s]

    def address(self, s):
        return f"127.0.0.1:{5000 + len(s)}"


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def make(services=("target", "draft", "orchestrator")):
    stack, clock, lines, up = FakeStack(services), Clock(), [], {"ok": True}
    sup = Supervisor(stack, healthy=lambda s: up["ok"], log=lines.append, clock=clock)
    return stack, clock, lines, up, sup


def test_a_crashed_service_is_restarted_after_the_backoff_and_the_others_are_left_alone():
    stack, clock, lines, up, sup = make()
    others = {s: stack.procs[s] for s in ("target", "orchestrator")}
    dead = stack.procs["draft"]
    dead.returncode = -9
    sup.tick()
    assert stack.started == [] and len(lines) == 1
    assert re.search(rf"draft +exited unexpectedly \(pid {dead.pid}, signal SIGKILL\); restarting in 0\.5s "
                     r"\(attempt 1\)", lines[0])
    clock.t += 0.4
    sup.tick()
    assert stack.started == []  # still backing off
    clock.t += 0.1
    up["ok"] = False  # it is still loading
    sup.tick()
    assert stack.started == ["draft"] and stack.procs["draft"] is not dead
    assert f"restarted (attempt 1, pid {stack.procs['draft'].pid})" in lines[-1]
    sup.tick()
    assert len(lines) == 2  # not healthy yet: nothing to say
    up["ok"] = True
    sup.tick()
    assert re.search(rf"draft +healthy again on 127\.0\.0\.1:\d+ \(pid {stack.procs['draft'].pid}\)", lines[-1])
    sup.tick()
    assert len(lines) == 3 and stack.started == ["draft"]
    assert all(stack.procs[s] is p for s, p in others.items())


def test_repeated_crashes_back_off_up_to_the_cap_and_keep_being_retried():
    stack, clock, lines, up, sup = make(("target",))
    up["ok"] = False
    delays = []
    for _ in range(9):
        stack.procs["target"].returncode = 1  # crashes while loading, every time
        sup.tick()
        delays.append(float(re.search(r"restarting in ([\d.]+)s", lines[-1]).group(1)))
        clock.t += delays[-1]
        sup.tick()
        assert "restarted" in lines[-1]
    assert delays == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert len(stack.started) == 9


def test_a_service_healthy_for_a_minute_starts_a_new_run_of_backoff():
    stack, clock, lines, up, sup = make(("target",))
    for _ in range(3):
        stack.procs["target"].returncode = 1
        sup.tick()
        clock.t += 10
        sup.tick()  # restarted
        sup.tick()  # healthy again
    assert "restarting in 2.0s (attempt 3)" in lines[-3]
    clock.t += 59
    stack.procs["target"].returncode = 1
    sup.tick()
    assert "restarting in 4.0s (attempt 4)" in lines[-1]
    clock.t += 4
    sup.tick()
    sup.tick()
    clock.t += 60
    stack.procs["target"].returncode = 1
    sup.tick()
    assert "restarting in 0.5s (attempt 1)" in lines[-1]


def test_a_failed_spawn_is_retried_with_backoff():
    stack, clock, lines, up, sup = make(("draft",))
    real_start, calls = stack.start_service, []

    def flaky(s):
        calls.append(s)
        if len(calls) == 1:
            raise OSError("Resource temporarily unavailable")
        return real_start(s)

    stack.start_service = flaky
    stack.procs["draft"].returncode = 1
    sup.tick()
    clock.t += 0.5
    sup.tick()
    assert "could not be restarted (Resource temporarily unavailable); retrying in 1.0s (attempt 2)" in lines[-1]
    clock.t += 1.0
    sup.tick()
    assert "restarted (attempt 2" in lines[-1]


# -- a real `specdec up` --------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


class Output:
    """The lines `up` prints, read on a thread; wait_for returns the first new line matching."""

    def __init__(self, p: subprocess.Popen):
        self.lines: list[str] = []
        self.seen = 0
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, p):
        for line in p.stdout:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                for i in range(self.seen, len(self.lines)):
                    m = re.search(pattern, self.lines[i])
                    if m:
                        self.seen = i + 1
                        return m
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matching {pattern!r} in {timeout_s}s:\n{''.join(self.lines)}")
                self.cond.wait(left)


def _complete(port: int, within_s: float = 60.0, **kw):
    """A request, retried while the orchestrator answers UNAVAILABLE (its target is down)."""
    from specdec import Client

    deadline = time.monotonic() + within_s
    while True:
        try:
            with Client(f"127.0.0.1:{port}", timeout=30) as c:
                return c.complete("hello", max_tokens=6, ignore_eos=True, **kw)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _until_drafted(port: int, within_s: float = 15.0) -> None:
    """Requests until one is drafted for. A greedy request does not wait for its draft session to
    open (its first rounds run target-only), so 6 tokens of the tiny pair can all come before it."""
    deadline = time.monotonic() + within_s
    while _complete(port).stats["draft_tokens"] == 0:
        assert time.monotonic() < deadline, f"no request was drafted for in {within_s} s"
        time.sleep(0.3)


def test_up_restarts_a_killed_draft_and_target_and_keeps_serving(tiny_models, tmp_path):
    from specdec.launcher import free_port, is_serving

    port, tport, dport = free_port(), free_port(), free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[target]\ncpu_cores = ""\n[draft]\ncpu_cores = ""\n[orchestrator]\nprobe_interval_s = 0.3\n')
    p = subprocess.Popen([sys.executable, "-m", "specdec.cli", "up", "--config", str(cfg), "--port", str(port),
                          "--target-port", str(tport), "--draft-port", str(dport),
                          "--target-model", str(tiny_models["target"]), "--draft-model", str(tiny_models["draft"]),
                          "--draft-engine", "torch", "--log-dir", str(tmp_path / "logs")],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Output(p)
    try:
        pids = {}
        for _ in range(3):
            m = out.wait_for(r"(\w+) +healthy on \S+ \(pid (\d+)\)", 240)
            pids[m.group(1)] = int(m.group(2))
        out.wait_for("specdec is up", 30)
        assert set(pids) == {"target", "draft", "orchestrator"} and sorted(_children(p.pid)) == sorted(pids.values())
        _until_drafted(port)

        # the draft dies: logged, requests go on target-only, and it comes back on its port
        os.kill(pids["draft"], signal.SIGKILL)
        out.wait_for(rf"draft +exited unexpectedly \(pid {pids['draft']}, signal SIGKILL\); restarting in 0\.5s", 10)
        res = _complete(port)  # during the outage or just after: served either way
        assert len(res.token_ids) == 6
        new_draft = int(out.wait_for(r"draft +restarted \(attempt 1, pid (\d+)\)", 10).group(1))
        out.wait_for(rf"draft +healthy again on 127\.0\.0\.1:{dport} \(pid {new_draft}\)", 60)
        assert is_serving(f"127.0.0.1:{dport}")
        _until_drafted(port)  # the orchestrator re-attaches it within a probe interval

        # the target dies: the orchestrator answers UNAVAILABLE until it is back, then serves again
        os.kill(pids["target"], signal.SIGKILL)
        out.wait_for(rf"target +exited unexpectedly \(pid {pids['target']}, signal SIGKILL\)", 10)
        new_target = int(out.wait_for(r"target +restarted \(attempt 1, pid (\d+)\)", 10).group(1))
        assert len(_complete(port, within_s=60).token_ids) == 6
        out.wait_for(rf"target +healthy again on 127\.0\.0\.1:{tport} \(pid {new_target}\)", 30)

        children = _children(p.pid)
        assert sorted(children) == sorted([pids["orchestrator"], new_draft, new_target])
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        time.sleep(0.5)
        assert all(_gone(pid) for pid in children)
        assert not any("exited unexpectedly" in x for x in out.lines[out.seen:])  # no restart while stopping
    finally:
        if p.poll() is None:
            p.kill()
