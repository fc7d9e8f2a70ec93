"""What `specdec up` does after startup: restart a service that exits, with backoff.

`Backoff` is the policy (pure). `Supervisor` applies it to a `Stack` one non-blocking `tick`
at a time, so the caller's loop still sees its stop flag between ticks: a service is never
restarted once the caller stops ticking (shutdown). Restarts are in place, on the same port;
the orchestrator re-attaches a draft that answers again and follows its target's health.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Backoff:
    """Delay before restart n of a run of crashes: initial_s, doubling, capped at max_s. A service
    that stayed healthy for reset_after_s before it exited starts a new run (n = 1)."""
    initial_s: float = 0.5
    factor: float = 2.0
    max_s: float = 30.0
    reset_after_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait before restart `attempt` (1, 2, ...) of a run of crashes."""
        return min(self.max_s, self.initial_s * self.factor ** min(max(attempt, 1) - 1, 64))

    def next_attempt(self, attempts: int, healthy_for_s: float | None) -> int:
        """The attempt number after an exit: a new run if the service had been healthy long enough."""
        if healthy_for_s is not None and healthy_for_s >= self.reset_after_s:
            return 1
        return attempts + 1


def describe_exit(returncode: int) -> str:
    """'exit code 3' or 'signal SIGKILL' (Popen's negative return codes)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _State:
    attempts: int = 0  # restarts in the current run of crashes
    healthy_since: float | None = None
    restart_at: float | None = None  # set while waiting out the backoff
    awaiting_health: bool = False  # restarted, not yet healthy


@dataclass
class Supervisor:
    """Watches `stack.procs` (all already started and healthy) and restarts those that exit.

    `healthy(service)` says whether a service answers its health check; `log` gets one line
    per event (exit, restart, healthy again)."""
    stack: object  # a launcher.Stack: procs, start_service(service), address(service)
    healthy: Callable[[str], bool]
    log: Callable[[str], None] = print
    backoff: Backoff = field(default_factory=Backoff)
    clock: Callable[[], float] = time.monotonic
    states: dict[str, _State] = field(default_factory=dict)

    def __post_init__(self):
        now = self.clock()
        for s in self.stack.procs:
            self.states.setdefault(s, _State(healthy_since=now))

    def tick(self) -> None:
        for s in list(self.stack.procs):
            self._tick(s, self.stack.procs[s], self.states.setdefault(s, _State(healthy_since=self.clock())))

    def _tick(self, s: str, p, st: _State) -> None:
        now = self.clock()
        if st.restart_at is not None:
            if now >= st.restart_at:
                st.restart_at = None
                st.awaiting_health = True
                st.healthy_since = None
                try:
                    p = self.stack.start_service(s)
                except OSError as e:  # could not even spawn it: count it as another crash
                    st.attempts += 1
                    delay = self.backoff.delay(st.attempts)
                    st.restart_at, st.awaiting_health = now + delay, False
                    self.log(f"  {s:<12} could not be restarted ({e}); retrying in {delay:.1f}s "
                             f"(attempt {st.attempts})")
                    return
                self.log(f"  {s:<12} restarted (attempt {st.attempts}, pid {p.pid}); waiting for health")
            return
        rc = p.poll()
        if rc is not None:
            healthy_for = None if st.healthy_since is None else now - st.healthy_since
            st.attempts = self.backoff.next_attempt(st.attempts, healthy_for)
            delay = self.backoff.delay(st.attempts)
            st.restart_at = now + delay
            st.awaiting_health = False
            st.healthy_since = None
            self.log(f"  {s:<12} exited unexpectedly (pid {p.pid}, {describe_exit(rc)}); "
                     f"restarting in {delay:.1f}s (attempt {st.attempts})")
            return
        if st.awaiting_health and self.healthy(s):
            st.awaiting_health = False
            st.healthy_since = now
            self.log(f"  {s:<12} healthy again on {self.stack.address(s)} (pid {p.pid})")
