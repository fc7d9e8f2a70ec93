"""Service behaviour through real processes on tiny models: errors, limits, health, reflection.

Each bad request gets a clear status and the services keep serving the next request.
"""
from __future__ import annotations

import math
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2

from specdec import Client
from conftest import running, tiny_config
from specdec.launcher import Stack, local_config
from specdec.v1 import specdec_pb2, specdec_pb2_grpc


@pytest.fixture(scope="module")
def tiny_stack(tiny_models, tmp_path_factory):
    cfg = tiny_config(tiny_models)
    cfg.target.kv_pool_tokens = 4096
    cfg.target.max_sessions = 4
    with running(cfg, tmp_path_factory.mktemp("tiny-stack")) as stack:
        yield stack


def _code(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


def _ok(client: Client) -> None:
    res = client.complete("Say hi", max_tokens=5, ignore_eos=True)
    assert len(res.token_ids) == 5


@pytest.mark.parametrize("kwargs, needle", [
    (dict(text=""), "prompt is empty"),
    (dict(messages=[{"role": "user", "content": ""}]), "prompt is empty"),
    (dict(token_ids=[]), "prompt is empty"),
    (dict(prompt="x", max_tokens=0), "max_tokens must be > 0"),
    (dict(prompt="x", max_tokens=-5), "max_tokens must be > 0"),
    (dict(prompt="x", max_tokens=5000), "context limit"),
    (dict(prompt="x", k=33), "k must be"),
    (dict(prompt="x", k=-1), "k must be"),
    (dict(prompt="x", mode=7), "unknown mode"),
    (dict(prompt="x", temperature=-0.5), "temperature"),
    (dict(prompt="x", temperature=math.nan), "temperature"),
    (dict(prompt="x", temperature=0.7, top_p=0.0), "top_p"),
    (dict(prompt="x", temperature=0.7, top_p=1.5), "top_p"),
    (dict(prompt="x", temperature=0.7, top_k=-2), "top_k"),
    (dict(prompt="x", draft_temperature=-1.0), "draft_temperature"),
    (dict(prompt="x", draft_temperature=math.inf), "draft_temperature"),
    (dict(prompt="x", draft_top_p=0.0), "draft_top_p"),
    (dict(prompt="x", draft_top_k=-1), "draft_top_k"),
    (dict(prompt="x", stop=["a"] * 9), "stop"),
    (dict(prompt="x", stop=["a" * 200]), "stop"),
    (dict(token_ids=[10**7]), "token ids"),
    (dict(messages=[{"role": "robot", "content": "hi"}]), "roles"),
])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(tiny_stack, kwargs, needle):
    with Client(tiny_stack.address("orchestrator")) as c:
        kwargs.setdefault("max_tokens", 4)
        code, details = _code(lambda: c.complete(**kwargs))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert needle in details
        _ok(c)


def test_modes_agree_on_tiny_models(tiny_stack):
    with Client(tiny_stack.address("orchestrator")) as c:
        outs = {m: c.complete("Tell me a story", max_tokens=24, ignore_eos=True, mode=m).token_ids
                for m in ("target-only", "sequential", "pipelined")}
    assert outs["target-only"] == outs["sequential"] == outs["pipelined"]


def test_a_burst_of_short_requests_keeps_the_draft(tiny_stack):
    """Each request's draft session is closed on the draft before the request ends, so a burst of
    short (or failing) requests never finds the draft at its session limit (16)."""
    with Client(tiny_stack.address("orchestrator")) as c, \
            Client(tiny_stack.address("orchestrator"), timeout=0.05) as hasty:
        for i in range(40):
            if i % 2:
                _code(lambda: c.complete("x", max_tokens=2, top_p=2.0))  # fails at validation
            else:  # ends at its deadline with sessions open (or just done: either way they must go)
                try:
                    hasty.complete(token_ids=list(range(100, 900)), max_tokens=100, mode="pipelined")
                except grpc.RpcError as e:
                    assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            res = c.complete("Hi", max_tokens=3, ignore_eos=True, mode="pipelined", k=2)
            assert res.stats["draft_fallback_rounds"] == 0, i


def test_sampled_output_is_reproducible_per_seed(tiny_stack):
    with Client(tiny_stack.address("orchestrator")) as c:
        kw = dict(max_tokens=16, ignore_eos=True, temperature=0.9, draft_temperature=0.5, k=4, mode="pipelined")
        a = c.complete("Once upon a time", seed=7, **kw)
        b = c.complete("Once upon a time", seed=7, **kw)
        other = [c.complete("Once upon a time", seed=s, **kw).token_ids for s in (8, 9, 10)]
    assert a.token_ids == b.token_ids
    assert a.stats["seed"] == 7
    assert any(o != a.token_ids for o in other)


def _reflection_call(ch: grpc.Channel, version: str):
    """ServerReflectionInfo under grpc.reflection.<version> (v1 and v1alpha are identical on the wire)."""
    return ch.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)


@pytest.mark.parametrize("version", ["v1alpha", "v1"])
def test_health_and_reflection_on_all_three(tiny_stack, version):
    expected = {"target": "specdec.v1.TargetService", "draft": "specdec.v1.DraftService",
                "orchestrator": "specdec.v1.SpecDec"}
    for service, name in expected.items():
        with grpc.insecure_channel(tiny_stack.address(service)) as ch:
            for svc in ("", name):
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)
                assert r.status == health_pb2.HealthCheckResponse.SERVING
            call = _reflection_call(ch, version)
            replies = call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert {name, "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                    "grpc.reflection.v1alpha.ServerReflection"} <= names
            # what a tool asks next: the file that defines the service, with its dependencies
            replies = list(call(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)]),
                                timeout=5))
            assert replies[0].file_descriptor_response.file_descriptor_proto, version


def test_server_info(tiny_stack):
    with Client(tiny_stack.address("orchestrator")) as c:
        info = c.info()
    assert info["target"]["engine"] == "torch" and info["draft"]["engine"] == "torch"
    assert info["target"]["tokenizer_fingerprint"] == info["draft"]["tokenizer_fingerprint"]
    assert info["draft_available"] is True


def test_a_draft_with_another_tokenizer_is_never_used_and_says_why(tiny_models, tmp_path):
    """A draft-side problem never fails a request: requests run target-only (same output), and
    GetInfo says why the draft is not available."""
    cfg = tiny_config(tiny_models)
    cfg.draft.model = str(tiny_models["other-tokenizer"])
    with running(cfg, tmp_path) as stack:
        with Client(stack.address("orchestrator")) as c:
            spec = c.complete("hello", max_tokens=4, ignore_eos=True, mode="pipelined")
            base = c.complete("hello", max_tokens=4, ignore_eos=True, mode="target-only")
            info = c.info()
    assert spec.token_ids == base.token_ids and spec.stats["draft_tokens"] == 0
    assert info["draft_available"] is False
    assert "tokenizer" in info["draft_problem"]


def test_target_down_is_unavailable_and_orchestrator_recovers(tiny_models, tmp_path):
    cfg = local_config()
    cfg.target.model = str(tiny_models["target"])
    cfg.target.cpu_cores = ""
    cfg.orchestrator.rpc_timeout_s = 10
    with Stack(cfg, tmp_path, with_draft=False).start() as stack:
        stack.wait_ready(300)
        with Client(stack.address("orchestrator")) as c:
            _ok(c)
            stack.stop_service("target")
            code, details = _code(lambda: c.complete("hello", max_tokens=4))
            assert code == grpc.StatusCode.UNAVAILABLE, details
            stack.start_service("target")
            stack.wait_ready(120, ["target"])
            # the orchestrator's health follows the target's: it is SERVING again once its probe
            # (every probe_interval_s) reaches the restarted target over its reconnected channel
            stack.wait_ready(10, ["orchestrator"])
            _ok(c)


def test_raw_proto_unknown_mode(tiny_stack):
    with grpc.insecure_channel(tiny_stack.address("orchestrator")) as ch:
        stub = specdec_pb2_grpc.SpecDecStub(ch)
        req = specdec_pb2.GenerateRequest(text="hi", max_tokens=3, mode=42)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- bytes that are not the request message ------------------------------------------------------------

BAD_BYTES = [b"\xff\xff\xff\xff", b"\x0a\xff\x01", bytes(range(256))]
METHODS = {  # service -> (full method name, client streaming)
    "orchestrator": [("/specdec.v1.SpecDec/Generate", False), ("/specdec.v1.SpecDec/GetInfo", False)],
    "target": [("/specdec.v1.TargetService/Info", False), ("/specdec.v1.TargetService/Session", True)],
    "draft": [("/specdec.v1.DraftService/Info", False), ("/specdec.v1.DraftService/Session", True)],
}


def _raw_call(channel: grpc.Channel, method: str, streaming: bool, messages: list[bytes]):
    """Send raw bytes as the request message(s); return the replies as raw bytes."""
    ident = lambda b: b  # noqa: E731
    if streaming:
        call = channel.stream_stream(method, request_serializer=ident, response_deserializer=ident)
        return list(call(iter(messages), timeout=30))
    if method.endswith("Generate"):
        return list(channel.unary_stream(method, request_serializer=ident, response_deserializer=ident)(
            messages[0], timeout=30))
    return [channel.unary_unary(method, request_serializer=ident, response_deserializer=ident)(messages[0], timeout=30)]


@pytest.mark.parametrize("service", ["orchestrator", "target", "draft"])
def test_bytes_that_do_not_parse_are_invalid_argument_on_every_service(tiny_stack, service):
    with grpc.insecure_channel(tiny_stack.address(service)) as ch:
        for method, streaming in METHODS[service]:
            for raw in BAD_BYTES:
                code, details = _code(lambda: _raw_call(ch, method, streaming, [raw]))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
                assert "do not parse" in details
    with Client(tiny_stack.address("orchestrator")) as c:
        _ok(c)
        assert c.info()["draft_available"]


@pytest.mark.parametrize("service", ["target", "draft"])
def test_a_corrupted_message_mid_session_ends_that_session_only(tiny_stack, service, smol_tokenizer):
    """A session stream opened properly, then garbage: INVALID_ARGUMENT, the session is closed
    (the service's count of active sessions goes back), and the service keeps serving."""
    from specdec.v1 import common_pb2, draft_pb2, target_pb2

    prompt = smol_tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    name = "TargetService" if service == "target" else "DraftService"
    if service == "target":
        opening = target_pb2.TargetRequest(open=target_pb2.TargetOpen(
            session_id="corrupt-1", prompt_token_ids=prompt, max_tokens=8, max_draft=4))
    else:
        opening = draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
            session_id="corrupt-1", prompt_token_ids=prompt, max_tokens=8, max_draft=4))
    with grpc.insecure_channel(tiny_stack.address(service)) as ch:
        code, details = _code(lambda: _raw_call(ch, f"/specdec.v1.{name}/Session", True,
                                                [opening.SerializeToString(), b"\xff\xff\xff\xff"]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        ask = ch.unary_unary(f"/specdec.v1.{name}/Info", request_serializer=common_pb2.InfoRequest.SerializeToString,
                             response_deserializer=common_pb2.ModelInfo.FromString)
        deadline = time.monotonic() + 1.0
        while ask(common_pb2.InfoRequest(), timeout=5).active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ask(common_pb2.InfoRequest(), timeout=5).active_sessions == 0
    with Client(tiny_stack.address("orchestrator")) as c:
        _ok(c)


def test_a_draft_cut_gets_no_reply_and_only_after_open(tiny_stack, smol_tokenizer):
    """`cut` on the draft's session stream: refused before open; after open, with no propose in
    flight, it does nothing and gets no reply: each propose still gets exactly its own reply,
    with every token it asked for."""
    import threading

    from specdec.v1 import draft_pb2, draft_pb2_grpc

    prompt = smol_tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    cut = draft_pb2.DraftRequest(cut=draft_pb2.DraftCut())
    opening = draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
        session_id="cut-1", prompt_token_ids=prompt, max_tokens=16, max_draft=4))
    replied = threading.Event()

    def messages():
        yield opening
        yield cut  # nothing to cut yet
        yield draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(keep=len(prompt), k=4, seed=1))
        assert replied.wait(30)
        yield cut  # the propose has ended: nothing to cut
        yield draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(keep=len(prompt) + 4, k=4, seed=2))

    with grpc.insecure_channel(tiny_stack.address("draft")) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        code, details = _code(lambda: list(stub.Session(iter([cut]), timeout=30)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "cut before open" in details
        replies = []
        for r in stub.Session(messages(), timeout=30):
            replies.append(r)
            if r.WhichOneof("kind") == "proposal":
                replied.set()
        assert [r.WhichOneof("kind") for r in replies] == ["opened", "proposal", "proposal"]
        assert [len(r.proposal.token_ids) for r in replies[1:]] == [4, 4]
