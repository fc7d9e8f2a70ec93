"""Reliability under chaos and fuzzing, through real processes on loopback (tiny models; the draft
carries the target's own weights, so nearly every round drafts and is accepted: a changed token
would show).

- Draft chaos: the draft service is SIGKILLed and restarted 20 times while 8 clients send greedy
  requests: no request fails, no output changes.
- Fuzzing: 1,200 requests of random field values and raw random bytes, to the public port and to
  both internal ports: no INTERNAL, no UNKNOWN, no crash; every service healthy afterwards, and a
  normal request still gives its reference output.
"""
from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter

import grpc
import pytest

from specdec import Client
from conftest import running, tiny_config, with_metrics
from specdec.launcher import is_serving
from specdec.v1 import common_pb2, draft_pb2, specdec_pb2, target_pb2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chaos_stack(tiny_models, tmp_path_factory):
    cfg = with_metrics(tiny_config(tiny_models))
    cfg.draft.model = str(tiny_models["target"])  # the target's own weights: drafts are accepted
    cfg.orchestrator.probe_interval_s = 0.3
    with running(cfg, tmp_path_factory.mktemp("chaos")) as stack:
        yield stack


def _prompt(i: int) -> list[int]:
    return [100 + (i * 31 + j * 7) % 3000 for j in range(8 + i % 24)]


def test_the_draft_killed_and_restarted_20_times_under_8_clients_fails_and_changes_nothing(chaos_stack):
    stack = chaos_stack
    prompts = [_prompt(i) for i in range(16)]
    with Client(stack.address("orchestrator"), timeout=60) as c:
        refs = [c.complete(token_ids=p, max_tokens=48, ignore_eos=True, mode="target-only").token_ids
                for p in prompts]
    stop = threading.Event()
    results: list[tuple[int, object]] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        i = n
        with Client(stack.address("orchestrator"), timeout=60) as c:
            while not stop.is_set():
                mode = ("pipelined", "sequential")[i % 2]
                try:
                    res = c.complete(token_ids=prompts[i % 16], max_tokens=48, ignore_eos=True, k=4, mode=mode)
                except grpc.RpcError as e:
                    res = e
                with lock:
                    results.append((i % 16, res))
                i += 8

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            time.sleep(random.uniform(0.3, 1.0))
            stack.stop_service("draft", signal.SIGKILL)
            time.sleep(random.uniform(0.0, 0.5))
            stack.start_service("draft")
            stack.wait_ready(60, ["draft"])
        time.sleep(2.0)  # requests after the last restart draft again
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    failed = [(i, r.code().name, r.details()) for i, r in results if isinstance(r, grpc.RpcError)]
    assert not failed, failed[:5]
    changed = [i for i, r in results if r.token_ids != refs[i]]
    assert not changed, changed
    drafted = sum(r.stats["draft_tokens"] > 0 for _, r in results)
    fallbacks = sum(r.stats["draft_fallback_rounds"] > 0 for _, r in results)
    print(f"\n[chaos] {len(results)} requests across 20 draft kills: 0 failed, 0 changed; {drafted} drafted, "
          f"{fallbacks} ran some rounds target-only")
    assert len(results) >= 80 and fallbacks > 0 and drafted > 0


# -- fuzzing ----------------------------------------------------------------------------------------

def _random_value(rng: random.Random):
    return rng.choice([0, -1, 1, 2**31 - 1, -2**31, rng.randint(-10**6, 10**6), float("nan"), float("inf"),
                       -0.5, 1e30, rng.random()])


def _fuzz_generate(rng: random.Random) -> specdec_pb2.GenerateRequest:
    r = specdec_pb2.GenerateRequest()
    kind = rng.randrange(4)
    if kind == 0:
        r.text = "".join(chr(rng.randrange(1, 0x3000)) for _ in range(rng.randrange(0, 40)))
    elif kind == 1:
        r.token_ids.ids.extend(rng.randint(-5, 60000) for _ in range(rng.randrange(0, 30)))
    elif kind == 2:
        for _ in range(rng.randrange(0, 3)):
            r.chat.messages.add(role=rng.choice(["user", "system", "assistant", "robot", ""]),
                                content=rng.choice(["hi", "", "x" * rng.randrange(200)]))
    for name, cast in (("max_tokens", int), ("k", int), ("mode", int)):
        if rng.random() < 0.7:
            v = _random_value(rng)
            try:
                setattr(r, name, max(-2**31, min(2**31 - 1, cast(v))) if v == v and abs(v) != float("inf") else 3)
            except (ValueError, OverflowError):
                pass
    if r.max_tokens > 24 or rng.random() < 0.3:
        r.max_tokens = rng.randrange(-2, 24)  # the valid ones stay short
    for msg in (r.sampling, r.draft_sampling):
        if rng.random() < 0.5:
            msg.temperature = float(_random_value(rng))
            msg.top_p = float(_random_value(rng))
            msg.top_k = int(max(-2**31, min(2**31 - 1, rng.randint(-10, 10**6))))
    if rng.random() < 0.3:
        r.stop.extend(rng.choice(["", "a", "\n", "x" * 300]) for _ in range(rng.randrange(0, 12)))
    if rng.random() < 0.3:
        r.seed = rng.randrange(2**64)
    r.ignore_eos = rng.random() < 0.5
    return r


def _fuzz_target(rng: random.Random) -> list[target_pb2.TargetRequest]:
    o = target_pb2.TargetOpen(session_id=rng.choice(["", "fuzz", "x" * 500]) + str(rng.random()),
                              prompt_token_ids=[rng.randint(-5, 60000) for _ in range(rng.randrange(0, 20))],
                              seed=rng.randrange(2**64), max_tokens=rng.randint(-5, 30),
                              max_draft=rng.randint(-3, 40))
    o.sampling.temperature = float(_random_value(rng))
    msgs = [target_pb2.TargetRequest(open=o)]
    for _ in range(rng.randrange(0, 3)):
        n = rng.randrange(0, 6)
        v = target_pb2.TargetVerify(draft_token_ids=[rng.randint(-5, 60000) for _ in range(n)])
        for _ in range(rng.choice([0, n, n + 1])):
            v.draft_dists.add(token_ids=[rng.randint(-5, 60000)], probs=[float(_random_value(rng))])
        msgs.append(target_pb2.TargetRequest(verify=v))
    return rng.sample(msgs, len(msgs)) if rng.random() < 0.2 else msgs


def _fuzz_draft(rng: random.Random) -> list[draft_pb2.DraftRequest]:
    o = draft_pb2.DraftOpen(session_id="fuzz" + str(rng.random()),
                            prompt_token_ids=[rng.randint(-5, 60000) for _ in range(rng.randrange(0, 20))],
                            target_tokenizer_fingerprint=rng.choice(["", "nope"]),
                            target_vocab_size=rng.randint(-1, 10**6), max_support=rng.randint(-1, 10**5),
                            max_tokens=rng.randint(-5, 30), max_draft=rng.randint(-3, 40))
    o.sampling.top_p = float(_random_value(rng))
    msgs = [draft_pb2.DraftRequest(open=o)]
    for _ in range(rng.randrange(0, 3)):
        msgs.append(draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(
            keep=rng.randint(-5, 40), append_token_ids=[rng.randint(-5, 60000) for _ in range(rng.randrange(0, 5))],
            k=rng.randint(-3, 40), seed=rng.randrange(2**64))))
    return rng.sample(msgs, len(msgs)) if rng.random() < 0.2 else msgs


def _raw_bytes(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))


SESSION = {"target": "/specdec.v1.TargetService/Session", "draft": "/specdec.v1.DraftService/Session"}
INFO = {"target": "/specdec.v1.TargetService/Info", "draft": "/specdec.v1.DraftService/Info"}
ident = lambda b: b  # noqa: E731


def _one_fuzz(stack, channels: dict, i: int) -> str:
    """One fuzzed call; -> its status code's name."""
    rng = random.Random(i)
    service = ("orchestrator", "target", "draft")[i % 3]
    raw = rng.random() < 0.4
    ch = channels[service]
    try:
        if service == "orchestrator":
            data = _raw_bytes(rng) if raw else _fuzz_generate(rng).SerializeToString()
            if rng.random() < 0.1:
                ch.unary_unary("/specdec.v1.SpecDec/GetInfo", request_serializer=ident, response_deserializer=ident)(
                    data, timeout=20)
            else:
                list(ch.unary_stream("/specdec.v1.SpecDec/Generate", request_serializer=ident,
                                     response_deserializer=ident)(data, timeout=20))
        elif rng.random() < 0.1:
            ch.unary_unary(INFO[service], request_serializer=ident, response_deserializer=ident)(
                _raw_bytes(rng) if raw else b"", timeout=20)
        else:
            if raw:
                msgs = [_raw_bytes(rng)] if rng.random() < 0.5 else [
                    (_fuzz_target(rng) if service == "target" else _fuzz_draft(rng))[0].SerializeToString(),
                    _raw_bytes(rng)]
            else:
                msgs = [m.SerializeToString() for m in (_fuzz_target(rng) if service == "target" else _fuzz_draft(rng))]
            list(ch.stream_stream(SESSION[service], request_serializer=ident, response_deserializer=ident)(
                iter(msgs), timeout=20))
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def test_1200_fuzzed_requests_on_all_three_ports_give_clear_statuses_and_break_nothing(chaos_stack):
    stack = chaos_stack
    stack.wait_ready(60)
    with Client(stack.address("orchestrator"), timeout=60) as c:
        reference = c.complete(token_ids=_prompt(3), max_tokens=24, ignore_eos=True).token_ids
    channels = {s: grpc.insecure_channel(stack.address(s)) for s in ("orchestrator", "target", "draft")}
    counts: dict[str, Counter] = {s: Counter() for s in channels}
    lock = threading.Lock()
    ids = iter(range(1200))

    def worker() -> None:
        while True:
            with lock:
                i = next(ids, None)
            if i is None:
                return
            code = _one_fuzz(stack, channels, i)
            with lock:
                counts[("orchestrator", "target", "draft")[i % 3]][code] += 1

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for ch in channels.values():
        ch.close()
    print("\n[fuzz] " + "; ".join(f"{s}: {dict(c)}" for s, c in counts.items()))
    assert sum(sum(c.values()) for c in counts.values()) == 1200
    for s, c in counts.items():
        assert not (set(c) & {"INTERNAL", "UNKNOWN"}), (s, c)
        assert c["INVALID_ARGUMENT"] > 0, (s, c)
    for s in ("target", "draft", "orchestrator"):
        assert stack.procs[s].poll() is None, f"{s} crashed:\n{stack.log(s)[-3000:]}"
        assert is_serving(stack.address(s)), s
    with Client(stack.address("orchestrator"), timeout=60) as c:
        res = c.complete(token_ids=_prompt(3), max_tokens=24, ignore_eos=True)
        assert res.token_ids == reference
        assert res.stats["draft_tokens"] > 0
    for s in ("target", "draft"):
        assert "Traceback" not in stack.log(s), stack.log(s)[-3000:]
