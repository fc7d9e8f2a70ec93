"""End to end through the real services on the default pair (no mocks).

Exactness: for 10 prompts from ShareGPT and HumanEval, 64 greedy tokens each, one request at
a time (so at the full k = 8), every mode outputs exactly what transformers `generate` outputs
with the target alone, with fixed and with adaptive k. All 20 prompts, 8 clients at once (k
shared out under load), are in test_serving_e2e.py.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from conftest import NEW_TOKENS, hf_greedy
from specdec import Client

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode,adaptive_k", [("target-only", False), ("sequential", False), ("pipelined", False),
                                             ("sequential", True), ("pipelined", True)],
                         ids=["target-only", "sequential", "pipelined", "sequential-adaptive-k", "pipelined-adaptive-k"])
def test_greedy_output_identical_to_transformers_generate(default_stack, prompts, references, mode, adaptive_k):
    """adaptive k (k <= 8 chosen per round from the measured costs, 0 included) changes only the
    rounds, never a token."""
    addr = default_stack.address("orchestrator")
    prompts = prompts[:10]
    with Client(addr) as c:
        mismatches = []
        for pid, ids in prompts:
            res = c.complete(token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True, mode=mode, k=8,
                             adaptive_k=adaptive_k)
            assert len(res.token_ids) == NEW_TOKENS
            if res.token_ids != references[pid]:
                mismatches.append(pid)
            if mode != "target-only":
                assert res.stats["draft_tokens"] > 0
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ in {mode} mode: {mismatches}"


def test_draft_killed_mid_generation_stream_finishes_identically(default_stack, target_model, prompts):
    pid, ids = prompts[1]
    n = 160
    ref = hf_greedy(target_model, ids, n)
    addr = default_stack.address("orchestrator")
    tokens, summary, killed_at = [], None, None
    try:
        with Client(addr) as c:
            deadline = time.monotonic() + 30
            while not c.info().get("draft_available") and time.monotonic() < deadline:
                time.sleep(0.2)
            for i, chunk in enumerate(c.generate(token_ids=ids, max_tokens=n, ignore_eos=True, mode="pipelined",
                                                 k=4)):
                tokens.extend(chunk.token_ids)
                # killed once it has drafted (it joins after its own prefill, later on a busy machine)
                if killed_at is None and chunk.HasField("round") and chunk.round.k > 0 and len(tokens) < n // 2:
                    killed_at = len(tokens)
                    default_stack.stop_service("draft", signal.SIGKILL)
                if chunk.HasField("summary"):
                    summary = chunk.summary
        assert killed_at is not None, "the draft never joined the request"
        assert tokens == ref
        assert summary.draft_fallback_rounds > 0
        assert summary.draft_tokens > 0
    finally:  # the stack is shared: leave it with a draft whatever happened
        if default_stack.procs["draft"].poll() is not None:
            default_stack.start_service("draft")
    # the draft comes back (restarted above) and the orchestrator picks it up by itself
    default_stack.wait_ready(120, ["draft"])
    with Client(addr) as c:
        deadline = time.monotonic() + 30
        while not c.info().get("draft_available") and time.monotonic() < deadline:
            time.sleep(0.2)
        res = c.complete(token_ids=ids, max_tokens=32, ignore_eos=True, mode="pipelined")
    assert res.token_ids == ref[:32]
    assert res.stats["draft_tokens"] > 0 and res.stats["draft_fallback_rounds"] == 0


def test_timing_and_acceptance_are_reported(default_stack, prompts):
    with Client(default_stack.address("orchestrator")) as c:
        res = c.complete(token_ids=prompts[0][1], max_tokens=40, ignore_eos=True, mode="pipelined", k=6)
    s = res.stats
    assert s["ttft_ms"] > 0 and s["tokens_per_s"] > 0 and s["tpot_ms"] > 0
    assert 0 < s["acceptance_rate"] <= 1
    assert s["rpc_overhead_ms_per_round"] >= 0
    assert sum(int(x) for x in s["accepted_by_position"]) == int(s["accepted_tokens"])
    assert len(res.rounds) == s["rounds"]
    assert all(r["k"] <= 6 for r in res.rounds)


def test_cli_generate_json(default_stack):
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "Name three colors.", "--address",
                          default_stack.address("orchestrator"), "--max-tokens", "12", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"prompt_token_ids", "token_ids", "text", "stats"} <= set(doc)
    assert len(doc["token_ids"]) <= 12 and doc["text"]


def test_cli_generate_reports_invalid_argument(default_stack):
    out = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "x", "--address",
                          default_stack.address("orchestrator"), "--max-tokens", "-3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "INVALID_ARGUMENT" in out.stderr and "max_tokens (--max-tokens) must be > 0" in out.stderr


def _scrape(port: int) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_scrape_after_generation_adds_up(default_stack, prompts):
    cfg = default_stack.cfg
    with Client(default_stack.address("orchestrator")) as c:
        res = c.complete(token_ids=prompts[2][1], max_tokens=48, ignore_eos=True, mode="pipelined", k=8)
    m = _scrape(cfg.orchestrator.metrics_port)
    drafted = m["specdec:spec_decode_num_draft_tokens_total"]
    accepted = m["specdec:spec_decode_num_accepted_tokens_total"]
    per_pos = sum(v for k, v in m.items() if k.startswith("specdec:spec_decode_num_accepted_tokens_per_pos_total"))
    assert 0 < accepted <= drafted
    assert per_pos == accepted
    assert m["specdec:spec_decode_num_drafts_total"] >= 1
    assert m["specdec:generation_tokens_total"] >= len(res.token_ids)
    assert m["specdec:time_to_first_token_seconds_count"] >= 1
    assert m["specdec:e2e_request_latency_seconds_count"] >= 1
    assert m["specdec:num_requests_running"] == 0
    assert m['specdec:rpc_overhead_seconds_count{peer="target"}'] >= 1
    t = _scrape(cfg.target.metrics_port)
    assert t["specdec:target_verify_seconds_count"] >= 1
    assert t['specdec:memory_rss_bytes{service="target"}'] > t['specdec:memory_weight_bytes{service="target"}'] > 0
    assert t['specdec:memory_kv_bytes_per_token{service="target"}'] > 0
    d = _scrape(cfg.draft.metrics_port)
    assert d["specdec:draft_propose_seconds_count"] >= 1
    assert d['specdec:memory_rss_bytes{service="draft"}'] > 0
