"""Session lifecycle under load and faults, through real service processes on loopback.

Whatever way a request ends (completion, a client deadline during the prefill, a target that
dies or refuses a round while a speculative draft call is in flight), both services end up
holding no session and no KV, the client gets a clear status in seconds, and the gauges on
/metrics come back to zero. The orchestrator's health follows the target's.
"""
from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec import Client
from specdec.lab.live import scrape_metrics
from conftest import running, tiny_config, wait_until_zero, with_metrics
from specdec.launcher import Stack
from specdec.modes import LABELS

pytestmark = pytest.mark.slow

MODES = LABELS


def gauges(stack: Stack) -> dict[str, float]:
    """The occupancy gauges of all three services."""
    c = stack.cfg
    o = scrape_metrics(c.orchestrator.host, c.orchestrator.metrics_port)
    out = {"requests_running": o["specdec:num_requests_running"]}
    for s in ("target", "draft"):
        if s == "draft" and not (stack.with_draft and stack.procs["draft"].poll() is None):
            continue
        m = scrape_metrics(getattr(c, s).host, getattr(c, s).metrics_port)
        for name in ("sessions", "kv_cache_tokens", "kv_blocks_used", "kv_blocks_reserved"):
            out[f"{s}_{name}"] = m[f'specdec:{name}{{service="{s}"}}']
    return out


def wait_all_zero(stack: Stack, within_s: float) -> dict[str, float]:
    return wait_until_zero(lambda: gauges(stack), within_s)


def held(stack: Stack) -> dict[str, int]:
    """Sessions and KV entries each service says it holds (its Info, through the orchestrator)."""
    with Client(stack.address("orchestrator")) as c:
        info = c.info()
    return {f"{s}_{what}": int(info[s].get(what, 0)) for s in ("target", "draft")
            for what in ("active_sessions", "kv_tokens_in_use")}


# -- ordinary load ---------------------------------------------------------------------------------

def test_ordinary_load_leaves_no_session_behind_and_keeps_the_draft(default_stack, smol_tokenizer):
    """200 short requests from 8 clients (no faults): afterwards neither service holds a session,
    no request of the last 16 ran a round without its draft for want of one, and requests after
    the load still draft (before the fix the draft leaked one session per close that waited
    behind other sessions' work, until every request ran target-only). 12 tokens each: a greedy
    request's first rounds run without drafts while its draft session still prefills, so under
    load a request may end before its draft joins; the sampled requests after the load wait for
    their draft before the first round, so each of them drafts unless the draft refuses it."""
    from specdec.lab.workloads import load_workload

    prompts = [p.messages for p in load_workload("chat", 16, seed=3)]
    addr = default_stack.address("orchestrator")
    results: list[dict] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    counter = iter(range(200))

    def client_loop():
        with Client(addr) as c:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    res = c.complete(messages=prompts[i % len(prompts)], max_tokens=12, ignore_eos=True)
                    with lock:
                        results.append({"i": i, **res.stats})
                except grpc.RpcError as e:
                    errors.append(e)

    threads = [threading.Thread(target=client_loop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors[:3]
    assert len(results) == 200
    g = wait_all_zero(default_stack, 2.0)
    assert not any(g.values()), g
    assert not any(held(default_stack).values()), held(default_stack)
    last = sorted(results, key=lambda r: r["i"])[-16:]
    assert all(r["draft_fallback_rounds"] == 0 for r in last), [
        (r["i"], r["draft_fallback_rounds"], r["draft_tokens"]) for r in last]
    with Client(addr) as c:
        after = [c.complete(messages=prompts[i], max_tokens=12, ignore_eos=True, temperature=0.7, seed=i).stats
                 for i in range(3)]
    assert all(r["draft_fallback_rounds"] == 0 and r["draft_tokens"] > 0 for r in after), [
        (r["draft_fallback_rounds"], r["draft_tokens"]) for r in after]


# -- a deadline during the prefill ---------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_deadline_during_prefill_frees_both_services_within_1s(default_stack, mode):
    long_prompt = [(i * 37) % 30000 + 100 for i in range(1500)]  # ~1-2 s of target prefill
    with Client(default_stack.address("orchestrator"), timeout=0.3) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=long_prompt, max_tokens=8, mode=mode)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    g = wait_all_zero(default_stack, 1.0)
    assert not any(g.values()), g
    assert not any(held(default_stack).values()), held(default_stack)


# -- the target fails mid-request ----------------------------------------------------------------

@pytest.fixture(scope="module")
def fragile_stack(tiny_models, tmp_path_factory):
    """Tiny models; the target is killed and restarted by the tests."""
    cfg = with_metrics(tiny_config(tiny_models))
    cfg.target.kv_pool_tokens = 512
    cfg.target.admission_wait_s = 0.2  # short: the holder below is still running when it ends
    cfg.orchestrator.rpc_timeout_s = 60  # a failure must be noticed long before this
    with running(cfg, tmp_path_factory.mktemp("fragile")) as stack:
        yield stack


def orchestrator_health(stack: Stack) -> int:
    with grpc.insecure_channel(stack.address("orchestrator")) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def wait_health(stack: Stack, status: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if orchestrator_health(stack) == status:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("mode", MODES)
def test_target_killed_mid_request_gives_unavailable_within_5s(fragile_stack, mode):
    stack = fragile_stack
    stack.ensure_running("target")
    with Client(stack.address("orchestrator"), timeout=75) as c:
        stream = c.generate(token_ids=list(range(100, 120)), max_tokens=450, ignore_eos=True, mode=mode, k=4)
        with pytest.raises(grpc.RpcError) as e:
            for i, _ in enumerate(stream):
                if i == 3:
                    stack.stop_service("target", signal.SIGKILL)
                    killed = time.monotonic()
        elapsed = time.monotonic() - killed
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert elapsed < 5.0
    assert "target" in e.value.details()
    # the orchestrator's health follows the target's: NOT_SERVING while it is down, SERVING once back
    assert wait_health(stack, health_pb2.HealthCheckResponse.NOT_SERVING, 5.0)
    stack.start_service("target")
    stack.wait_ready(120, ["target"])
    assert wait_health(stack, health_pb2.HealthCheckResponse.SERVING, 10.0)
    g = wait_all_zero(stack, 2.0)
    assert not any(g.values()), g


@pytest.fixture(scope="module")
def lone_target_stack(tiny_models, tmp_path_factory):
    """Tiny models, one target replica with room for 4 long requests; killed by the test."""
    cfg = with_metrics(tiny_config(tiny_models))
    cfg.orchestrator.rpc_timeout_s = 60
    with running(cfg, tmp_path_factory.mktemp("lone-target")) as stack:
        yield stack


def test_with_one_target_every_in_flight_request_ends_unavailable_within_5s(lone_target_stack):
    """4 clients mid-request (one per mode, and a second pipelined one) when the only target is
    SIGKILLed: each ends with UNAVAILABLE within 5 s of the kill."""
    stack = lone_target_stack
    started = threading.Barrier(5)
    ended: list[tuple[str, float, str]] = []

    def client(mode: str) -> None:
        with Client(stack.address("orchestrator"), timeout=75) as c:
            stream = c.generate(token_ids=list(range(100, 120)), max_tokens=900, ignore_eos=True, mode=mode, k=4)
            try:
                for i, _ in enumerate(stream):
                    if i == 2:
                        started.wait(30)
                ended.append((mode, time.monotonic(), "OK"))
            except grpc.RpcError as e:
                ended.append((mode, time.monotonic(), e.code().name))

    threads = [threading.Thread(target=client, args=(m,)) for m in [*MODES, "pipelined"]]
    for t in threads:
        t.start()
    started.wait(60)
    stack.stop_service("target", signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(60)
    try:
        assert [code for _, _, code in ended] == ["UNAVAILABLE"] * 4, ended
        assert max(t for _, t, _ in ended) - killed < 5.0, ended
    finally:
        stack.start_service("target")
        stack.wait_ready(120, ["target"])
    g = wait_all_zero(stack, 2.0)
    assert not any(g.values()), g


@pytest.mark.parametrize("mode", MODES)
def test_a_full_kv_pool_gives_resource_exhausted_within_5s(fragile_stack, mode):
    """Rounds can no longer be refused for KV (a session's worst case is reserved at admission):
    a newcomer that finds the pool full waits (admission_wait_s = 0.2 s here), then is refused."""
    stack = fragile_stack
    stack.ensure_running("target")
    with Client(stack.address("orchestrator"), timeout=75) as c:
        holder = c.generate(token_ids=list(range(100, 300)), max_tokens=280, ignore_eos=True, mode=mode, k=4)
        first = next(holder)  # admitted: it holds 485 of the 512 pool tokens until it ends
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=list(range(100, 200)), max_tokens=50, ignore_eos=True, mode=mode, k=4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert "KV pool" in e.value.details()
        assert time.monotonic() - t0 < 5.0
        assert len(first.token_ids) + sum(len(ch.token_ids) for ch in holder) == 280  # the holder finishes
        assert len(c.complete("hi", max_tokens=4, ignore_eos=True, mode=mode).token_ids) == 4
    g = wait_all_zero(stack, 2.0)
    assert not any(g.values()), g
