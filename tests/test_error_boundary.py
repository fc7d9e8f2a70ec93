"""One error boundary at each edge: the user gets a status about what *they* did, never a peer's
status passed through, and a hung peer gives a clear status in bounded time.

Real orchestrator and target processes (tiny models); the misbehaving peer is a fake service
from tests/fake_peers.py.
"""
from __future__ import annotations

import re
import time
from dataclasses import fields

import grpc
import pytest

from conftest import tiny_config
from fake_peers import BrokenDraft, HungTarget, ThreadedServer, add_draft, add_target
from specdec import Client
from specdec.launcher import Stack
from specdec.stats import RoundRecord, Summary
from specdec.v1 import common_pb2, specdec_pb2


def tiny_cfg(tiny_models):
    cfg = tiny_config(tiny_models)
    cfg.orchestrator.probe_interval_s = 0.2
    return cfg


def target_info(tiny_models) -> common_pb2.ModelInfo:
    """What the tiny target says about itself (asked of a real target process)."""
    cfg = tiny_cfg(tiny_models)
    with Stack(cfg, None, with_draft=False) as stack:
        stack.start_service("target")
        stack.wait_ready(120, ["target"])
        from specdec.v1 import target_pb2_grpc

        with grpc.insecure_channel(stack.address("target")) as ch:
            return target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)


@pytest.fixture(scope="module")
def tiny_target_info(tiny_models):
    return target_info(tiny_models)


def test_a_malformed_draft_never_reaches_the_user_as_invalid_argument(tiny_models, tiny_target_info, tmp_path):
    broken = BrokenDraft(tiny_target_info)
    with ThreadedServer(add_draft(broken)) as fake:
        cfg = tiny_cfg(tiny_models)
        cfg.draft.port = fake.port
        with Stack(cfg, tmp_path) as stack:
            stack.start_service("target")
            stack.start_service("orchestrator")
            stack.wait_ready(120, ["target", "orchestrator"])
            with Client(stack.address("orchestrator"), timeout=60) as c:
                for mode in ("sequential", "pipelined"):
                    res = c.complete("Tell me a story", max_tokens=12, ignore_eos=True, mode=mode, k=3)
                    base = c.complete("Tell me a story", max_tokens=12, ignore_eos=True, mode="target-only")
                    assert res.token_ids == base.token_ids, mode  # the round was verified again without drafts
                    assert res.stats["draft_fallback_rounds"] > 0
                    stack_log = stack.log("orchestrator")
                    assert "refused a round" in stack_log
                    # the draft is offered again by the monitor (it answers Info): wait for it
                    deadline = time.monotonic() + 10
                    while not c.info()["draft_available"] and time.monotonic() < deadline:
                        time.sleep(0.1)
    assert broken.proposals > 0


@pytest.fixture()
def hung_target_stack(tiny_models, tiny_target_info, tmp_path):
    info = common_pb2.ModelInfo()
    info.CopyFrom(tiny_target_info)
    info.model = str(tiny_models["target"])  # the orchestrator loads its tokenizer from here
    with ThreadedServer(add_target(HungTarget(info))) as fake:
        cfg = tiny_cfg(tiny_models)
        cfg.target.port = fake.port
        cfg.orchestrator.rpc_timeout_s = 2.0
        with Stack(cfg, tmp_path, with_draft=False) as stack:
            stack.start_service("orchestrator")
            stack.wait_ready(120, ["orchestrator"])
            yield stack


def test_a_hung_peer_with_time_left_is_unavailable_within_the_rpc_timeout(hung_target_stack):
    t0 = time.monotonic()
    with Client(hung_target_stack.address("orchestrator"), timeout=30) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hello", max_tokens=4)
    elapsed = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert re.search(r"target service \(\S+\) did not answer", e.value.details()) and "rpc_timeout_s" in e.value.details()
    assert 1.5 < elapsed < 5.0


def test_a_hung_peer_past_the_request_deadline_is_deadline_exceeded(hung_target_stack):
    t0 = time.monotonic()
    with Client(hung_target_stack.address("orchestrator"), timeout=1.0) as c:  # sooner than rpc_timeout_s (2 s)
        with pytest.raises(grpc.RpcError) as e:
            c.complete("hello", max_tokens=4)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e.value.details()
    assert time.monotonic() - t0 < 3.0


def test_round_statistics_have_one_schema():
    """The engine's records and the proto messages carry the same fields, by name."""
    rec = {f.name for f in fields(RoundRecord)}
    proto = {f.name for f in specdec_pb2.RoundStats.DESCRIPTOR.fields}
    assert proto == rec | {"round"}
    summ = {f.name for f in fields(Summary)}
    proto = {f.name for f in specdec_pb2.Summary.DESCRIPTOR.fields}
    assert proto == summ | {"finish_reason", "mode", "k", "seed", "prompt_token_ids"}
