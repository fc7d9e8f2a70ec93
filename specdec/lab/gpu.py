"""`python -m specdec.lab.gpu` (scripts/gpu_check.sh): the device check of issue 12, one command.

On a GPU it measures, with random weights at real shapes (`random:<shape>`, specdec/models.py:
a Qwen2.5-7B bf16 target, a Qwen2.5-0.5B bf16 draft), and writes a Markdown report:

  a. the device's memory bandwidth (a large copy: bytes read + written / time), and the floor
     of the target's step: the weight bytes a step reads / bandwidth;
  b. the target's verify latency T(k), k = 0..16 (one sequence, k+1 tokens after a 256-token
     prefill), `PagedLlamaRunner` eager and with CUDA graphs, against the floor;
  c. CUDA graphs on / off for the draft's decode step (batch 1 and 8) and the target's verify (k = 8);
  d. the real services (`Stack`, three processes): per mode, ms per round and per token from the
     SDK's per-round stats (random weights: acceptance means nothing, so step times, not tok/s),
     and each service's peak memory from its /metrics;
  e. projected tok/s for the pair: T(k) and the draft step (b, c) with the default pair's
     acceptance by position measured on CPU (`ACCEPT_BY_POSITION`), E(k) from specdec.kchoice;
  g. isolated pools, on a stack of its own: a raw session holds the target's whole KV pool; a
     request is refused with RESOURCE_EXHAUSTED and the draft still proposes; then the same with
     the draft's pool: a request is served target-only with the same tokens, and drafts again
     after; on a GPU also each service's peak allocated memory against its memory fraction;
  h. the services of d again, under an MPS daemon of their own (`nvidia-cuda-mps-control -d`; why
     not, if it cannot be started) and with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`
     (GPU only): ms per token per mode and pipelined / sequential against d's run, and each
     service's peak allocated and reserved GPU memory;
  f. the goals of the device: PASS / FAIL (isolation on any device).

`--tiny` runs the same code at tiny shapes on the CPU in seconds (graphs replay eagerly there,
`graphs.eager_capture`; goals n/a); the tests run it so that it cannot rot. Each section that
fails is reported as such and the rest still run (exit status 1); the report is rewritten after
every section, so a run cut short still leaves what it measured. Progress lines (elapsed
seconds) go to stderr. A section that would start after `--budget-s` is skipped.

A machine without the packaged SmolLM2 (whose tokenizer the random models carry) can be given
the model folders made elsewhere: `SPECDEC_CACHE_DIR=DIR python -m specdec.lab.gpu --prepare`
writes them under DIR; carry DIR and set SPECDEC_CACHE_DIR to it there.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specdec.kchoice import expected_tokens, round_ms
from specdec.modes import Mode

# P(draft i accepted | drafts 1..i-1 were), i = 1..16: the default pair (SmolLM2-135M target, its
# Q4_1 draft), greedy, k = 16, over chat, summarization, code and math: BENCHMARKS.md §2e, row
# "draft: llamacpp". The int4 torch draft (the default since) accepts about as often: 0.90-0.92
# of drafts at k = 8 (BENCHMARKS.md §6d). On a GPU pair with random weights acceptance means
# nothing, so the projection (e) takes this curve as the pair's.
ACCEPT_BY_POSITION = [0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.80, 0.75, 0.72, 0.72, 0.72, 0.70, 0.71, 0.69, 0.69, 0.67]
MAX_K = 16
GOAL_FLOOR_RATIO = 1.3  # verify at k <= 8 within 1.3x the floor (7B bf16)
GOAL_GRAPH_SPEEDUP = 2.0  # graphs >= 2x eager for the draft's decode step
SERVICE_MODES = ("target-only", "sequential", "pipelined")
SERVICE_K = 8


@dataclass(frozen=True)
class Plan:
    """What one run measures, and how often."""

    tiny: bool
    device: str  # cuda | cpu
    target: str  # model spec
    draft: str
    dtype: str  # of both
    prefill: int  # tokens cached before a verify / decode step
    runs: int  # timed repetitions per measurement (median)
    copy_bytes: int  # size of the bandwidth test's tensor
    copy_runs: int
    draft_batches: tuple[int, ...]
    service_prompt: int  # prompt tokens of a service request
    service_tokens: int  # new tokens per request
    service_requests: int  # per mode, after a warm-up
    fractions: tuple[float, float]  # target, draft gpu_memory_fraction
    budget_s: float

    @classmethod
    def make(cls, tiny: bool, device: str, budget_s: float | None) -> "Plan":
        if tiny:
            return cls(tiny, device, "random:tiny", "random:tiny", "float32" if device == "cpu" else "bfloat16",
                       prefill=256, runs=5, copy_bytes=64 << 20, copy_runs=3, draft_batches=(1, 8),
                       service_prompt=64, service_tokens=24, service_requests=1, fractions=(0.3, 0.1),
                       budget_s=budget_s or 300)
        return cls(tiny, device, "random:qwen2.5-7b", "random:qwen2.5-0.5b", "bfloat16", prefill=256, runs=15,
                   copy_bytes=2 << 30, copy_runs=10, draft_batches=(1, 8), service_prompt=256, service_tokens=128,
                   service_requests=2, fractions=(0.6, 0.2), budget_s=budget_s or 420)

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def median_ms(step: Callable[[], object], runs: int, device: str, after: Callable[[], object] = lambda: None,
              warmup: int = 2) -> float:
    """Median wall ms of `step` over `runs` (after `warmup` untimed ones); `after` runs untimed
    after each (rollback of the KV cache)."""
    for _ in range(warmup):
        step()
        after()
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        after()
    return statistics.median(times)


class Progress:
    def __init__(self):
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass
class Report:
    path: Path
    command: str
    header: list[str]
    sections: list[list[str]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def add(self, lines: list[str]) -> None:
        self.sections.append(lines)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = self.header + [""]
        for s in self.sections:
            body += s + [""]
        self.path.write_text("\n".join(body))

    def table_intro(self, what: str) -> str:
        return f"Command: `{self.command}` ({what})"


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:,.{digits}f}"


# ---------------------------------------------------------------------------------------------
# a. bandwidth
# ---------------------------------------------------------------------------------------------
def bandwidth_gbps(plan: Plan) -> float:
    """GB/s (1e9) of a device-to-device copy, counting bytes read and written."""
    import torch

    n = plan.copy_bytes // 2
    x = torch.ones(n, dtype=torch.bfloat16, device=plan.device)
    y = torch.empty_like(x)
    reps = 5
    ms = median_ms(lambda: [y.copy_(x) for _ in range(reps)], plan.copy_runs, plan.device) / reps
    del x, y
    return 2 * n * 2 / (ms / 1e3) / 1e9


def step_read_bytes(runner) -> int:
    """Weight bytes one step reads: every weight, less an untied embedding table (a step reads
    only its tokens' rows of it)."""
    w = runner.weights
    total = runner.facts.weight_bytes
    if not w.embed_is_head():
        total -= w.embed.untyped_storage().nbytes()
    return total


# ---------------------------------------------------------------------------------------------
# b, c. steps of the paged runner, eager and with graphs
# ---------------------------------------------------------------------------------------------
def graph_config():
    """The services' bucket sizes (ModelServiceConfig defaults)."""
    from specdec.config import ModelServiceConfig
    from specdec.serving.graphs import GraphConfig, parse_sizes

    c = ModelServiceConfig()
    return GraphConfig(parse_sizes(c.cuda_graph_batches, "batches"), parse_sizes(c.cuda_graph_tokens, "tokens"))


def capture_for(plan: Plan):
    from specdec.serving import graphs

    return graphs.cuda_capture() if plan.on_gpu else graphs.eager_capture


def load_runner(plan: Plan, spec: str, seqs: int):
    from specdec.serving.paged_llama import PagedLlamaRunner

    return PagedLlamaRunner.load(spec, plan.dtype, plan.device, pool_tokens=seqs * (plan.prefill + 64),
                                 block_size=16, max_seqs=seqs)


def _tokens(n: int, salt: int) -> list[int]:
    return [(97 * i + 31 * salt) % 40000 + 100 for i in range(n)]


def prefill(runner, seqs: list[int], n: int) -> None:
    from specdec.serving.batch import SeqChunk

    for b, s in enumerate(seqs):
        toks = _tokens(n, b)
        for i in range(0, n, 128):
            chunk = toks[i:i + 128]
            runner.forward([SeqChunk(s, chunk, i, 1 if i + len(chunk) >= n else 0)])


def in_graph(runner, batch: int, tokens: int, length: int) -> bool:
    from specdec.serving.graphs import pick_bucket

    blocks = -(-length // runner.pool.block_size)
    return runner.graphs is not None and pick_bucket(runner.graphs.cfg, runner.max_blocks, batch, tokens,
                                                     blocks) is not None


def verify_times(plan: Plan, runner, seq: int, progress: Progress) -> dict[str, dict[int, float]]:
    """T(k) ms, k = 0..MAX_K, eager then with graphs: {'eager': {k: ms}, 'graphs': {k: ms}}."""
    from specdec.serving.batch import SeqChunk

    out: dict[str, dict[int, float]] = {"eager": {}, "graphs": {}}
    for kind in ("eager", "graphs"):
        if kind == "graphs":
            runner.enable_graphs(graph_config(), capture_for(plan))
        for k in range(MAX_K + 1):
            toks = _tokens(k + 1, 1000 + k)
            out[kind][k] = median_ms(lambda: runner.forward([SeqChunk(seq, toks, plan.prefill, k + 1)]), plan.runs,
                                     plan.device, after=lambda: runner.truncate(seq, plan.prefill))
        progress(f"b: T(k) {kind}: " + " ".join(f"{k}:{v:.2f}" for k, v in out[kind].items()))
    return out


def decode_times(plan: Plan, runner, seqs: list[int], progress: Progress) -> dict[str, dict[int, float]]:
    """The draft's decode step (one token per sequence) at each batch: {'eager'|'graphs': {B: ms}}."""
    from specdec.serving.batch import SeqChunk

    out: dict[str, dict[int, float]] = {"eager": {}, "graphs": {}}
    for kind in ("eager", "graphs"):
        if kind == "graphs":
            runner.enable_graphs(graph_config(), capture_for(plan))
        for b in plan.draft_batches:
            chunks = [SeqChunk(s, [_tokens(1, 7 * i)[0]], plan.prefill, 1) for i, s in enumerate(seqs[:b])]

            def rollback():
                for s in seqs[:b]:
                    runner.truncate(s, plan.prefill)
            out[kind][b] = median_ms(lambda: runner.forward(chunks), plan.runs, plan.device, after=rollback)
        progress(f"c: draft decode {kind}: " + " ".join(f"B={b}:{v:.2f}" for b, v in out[kind].items()))
    return out


def free_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# d. the real services
# ---------------------------------------------------------------------------------------------
def service_config(plan: Plan):
    from specdec.launcher import free_port, local_config

    cfg = local_config()
    for s, spec, frac in ((cfg.target, plan.target, plan.fractions[0]), (cfg.draft, plan.draft, plan.fractions[1])):
        s.engine, s.model, s.dtype, s.device = "torch", spec, plan.dtype, plan.device
        if plan.on_gpu:
            s.gpu_memory_fraction = frac
        if plan.on_gpu and not plan.tiny:
            s.kv_pool_tokens = 0  # sized from the share, as on a GPU deployment
        else:
            s.kv_pool_tokens = 4096
        if plan.tiny:
            s.cpu_cores = ""  # unpinned: CI shares its cores
    for s in (cfg.target, cfg.draft, cfg.orchestrator):
        s.metrics_port = free_port()
    cfg.orchestrator.probe_interval_s = 0.3
    return cfg


def wait_draft(client, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.info().get("draft_available"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the orchestrator has not attached the draft after {timeout_s:.0f}s")
        time.sleep(0.2)


def run_services(plan: Plan, progress: Progress, ready_timeout_s: float | None = None, tag: str = "d",
                 while_up: Callable[[], object] | None = None) -> dict:
    """Per mode: the rounds of `service_requests` requests; per service: its /metrics memory;
    `while_up()`'s result (called before the services stop) as 'while_up'. The services inherit
    this process's environment (section h sets MPS's and the allocator's)."""
    from specdec.client import Client
    from specdec.lab.live import scrape_metrics
    from specdec.launcher import Stack

    cfg = service_config(plan)
    log_dir = Path(tempfile.mkdtemp(prefix="specdec-gpu-check-"))
    prompt = _tokens(plan.service_prompt, 5)
    out: dict = {"modes": {}, "memory": {}, "log_dir": str(log_dir)}
    with Stack(cfg, log_dir).start() as stack:
        try:
            stack.wait_ready(ready_timeout_s or (300 if plan.on_gpu else 240))
        except Exception as e:  # noqa: BLE001 - the report says why
            tails = {s: stack.log(s)[-1500:] for s in ("target", "draft", "orchestrator")}
            raise RuntimeError(f"{e}\n" + "\n".join(f"--- {s} log:\n{t}" for s, t in tails.items())) from None
        progress(f"{tag}: services ready")
        with Client(stack.address("orchestrator"), timeout=120) as client:
            wait_draft(client, 60)
            for mode in SERVICE_MODES:
                kw = dict(token_ids=prompt, ignore_eos=True, mode=mode, k=SERVICE_K)
                client.complete(max_tokens=8, **kw)  # warm-up: graph captures, first prefill
                rounds = []
                for _ in range(plan.service_requests):
                    rounds += client.complete(max_tokens=plan.service_tokens, **kw).rounds
                out["modes"][mode] = rounds
                progress(f"{tag}: {mode}: {len(rounds)} rounds")
        if while_up is not None:
            out["while_up"] = while_up()
        for name in ("target", "draft", "orchestrator"):
            c = getattr(cfg, name)
            m = scrape_metrics(c.host, c.metrics_port)
            get = lambda n: m.get(f'specdec:{n}{{service="{name}"}}')  # noqa: E731
            out["memory"][name] = {
                "peak_rss": get("memory_peak_rss_bytes"), "gpu_peak": get("memory_gpu_peak_allocated_bytes"),
                "gpu_peak_reserved": get("memory_gpu_peak_reserved_bytes"),
                "weights": get("memory_weight_bytes"), "kv_per_token": get("memory_kv_bytes_per_token"),
                "kv_tokens": (get("kv_blocks_total") or 0) * (get("kv_block_size") or 0) or None}
    return out


def round_summary(rounds: list[dict]) -> dict:
    def mean(key: str) -> float:
        return statistics.fmean(float(r.get(key, 0.0)) for r in rounds) if rounds else float("nan")

    tokens = sum(int(r.get("accepted", 0)) + 1 for r in rounds)
    return {"rounds": len(rounds), "round_ms": mean("round_ms"), "verify_ms": mean("verify_ms"),
            "draft_ms": mean("draft_ms"), "k": mean("k"), "accepted": mean("accepted"),
            "ms_per_token": sum(float(r.get("round_ms", 0.0)) for r in rounds) / tokens if tokens else float("nan")}


# ---------------------------------------------------------------------------------------------
# g. isolated pools
# ---------------------------------------------------------------------------------------------
ISOLATION_POOLS = (3072, 2048)  # target, draft KV pool tokens of the isolation stack (fixed: a pool to fill)


class HeldSession:
    """A raw session on the target or draft service that reserves as much of its KV pool as it
    can and then holds it, sending nothing, until `close()` (which ends the stream: the service
    frees it)."""

    def __init__(self, address: str, service: str, prompt: list[int], max_tokens: int, max_draft: int,
                 fingerprint: str = "", vocab: int = 0):
        import threading

        import grpc

        from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

        self.channel = grpc.insecure_channel(address)
        self.release = threading.Event()
        if service == "target":
            first = target_pb2.TargetRequest(open=target_pb2.TargetOpen(
                session_id="gpu-check-held-target", prompt_token_ids=prompt, max_tokens=max_tokens,
                max_draft=max_draft))
            stub = target_pb2_grpc.TargetServiceStub(self.channel)
        else:
            first = draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
                session_id="gpu-check-held-draft", prompt_token_ids=prompt, max_tokens=max_tokens,
                max_draft=max_draft, target_tokenizer_fingerprint=fingerprint, target_vocab_size=vocab))
            stub = draft_pb2_grpc.DraftServiceStub(self.channel)

        def requests():
            yield first
            self.release.wait()

        self.responses = stub.Session(requests(), timeout=600)
        self.opened = next(self.responses)

    def close(self) -> None:
        self.release.set()
        self.responses.cancel()
        self.channel.close()


def draft_proposes(address: str, prompt: list[int], k: int, fingerprint: str, vocab: int) -> tuple[int, float]:
    """Open a draft session, propose k tokens, close: (tokens proposed, ms)."""
    import grpc

    from specdec.v1 import draft_pb2, draft_pb2_grpc

    msgs = [draft_pb2.DraftRequest(open=draft_pb2.DraftOpen(
                session_id="gpu-check-probe", prompt_token_ids=prompt, max_tokens=k + 1, max_draft=k,
                target_tokenizer_fingerprint=fingerprint, target_vocab_size=vocab)),
            draft_pb2.DraftRequest(propose=draft_pb2.DraftPropose(keep=len(prompt), k=k))]
    t0 = time.perf_counter()
    with grpc.insecure_channel(address) as ch:
        out = list(draft_pb2_grpc.DraftServiceStub(ch).Session(iter(msgs), timeout=120))
    return len(out[-1].proposal.token_ids), (time.perf_counter() - t0) * 1e3


def isolation_config(plan: Plan):
    cfg = service_config(plan)
    cfg.target.kv_pool_tokens, cfg.draft.kv_pool_tokens = ISOLATION_POOLS
    cfg.target.admission_wait_s = 1.0  # a full target refuses within a second
    return cfg


def run_isolation(plan: Plan, progress: Progress) -> list[tuple[str, bool, str]]:
    """Fill the target's KV pool with a held session: a request is refused (RESOURCE_EXHAUSTED)
    and the draft still proposes; then fill the draft's: a request is served target-only with
    the same tokens, and drafts again once the draft is free. [(check, passed, detail)]."""
    import grpc

    from specdec.client import Client
    from specdec.lab.live import scrape_metrics
    from specdec.launcher import Stack

    cfg = isolation_config(plan)
    checks: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append((name, bool(ok), detail))
        progress(f"g: {name}: {'PASS' if ok else 'FAIL'} ({detail})")

    prompt = _tokens(64, 11)
    with Stack(cfg, Path(tempfile.mkdtemp(prefix="specdec-gpu-isolation-"))).start() as stack:
        stack.wait_ready(300 if plan.on_gpu else 240)
        with Client(stack.address("orchestrator"), timeout=120) as client:
            wait_draft(client, 60)
            info = client.info()
            fp, vocab = info["target"]["tokenizer_fingerprint"], int(info["target"]["vocab_size"])
            kw = dict(token_ids=prompt, ignore_eos=True, k=SERVICE_K)
            reference = client.complete(max_tokens=32, mode="target-only", **kw).token_ids

            def pool(name: str) -> tuple[int, int]:
                c = getattr(cfg, name)
                m = scrape_metrics(c.host, c.metrics_port)
                get = lambda n: int(m.get(f'specdec:{n}{{service="{name}"}}') or 0)  # noqa: E731
                return get("kv_blocks_reserved"), get("kv_blocks_total")

            # the target's pool full
            held = HeldSession(stack.address("target"), "target", prompt,
                               ISOLATION_POOLS[0] - len(prompt) - SERVICE_K - 1, SERVICE_K)
            try:
                used, total = pool("target")
                check("target pool held full", used == total, f"{used} of {total} blocks reserved")
                t0 = time.monotonic()
                try:
                    client.complete(max_tokens=16, mode="pipelined", **kw)
                    code = "OK"
                except grpc.RpcError as e:
                    code = e.code().name
                check("a request while the target is full is refused", code == "RESOURCE_EXHAUSTED",
                      f"{code} after {time.monotonic() - t0:.1f}s")
                n, ms = draft_proposes(stack.address("draft"), prompt, SERVICE_K, fp, vocab)
                check("the draft keeps working while the target is full", n == SERVICE_K,
                      f"{n} tokens proposed in {ms:.0f} ms")
            finally:
                held.close()
            # the draft's pool full
            deadline = time.monotonic() + 10
            while pool("target")[0] and time.monotonic() < deadline:
                time.sleep(0.05)
            held = HeldSession(stack.address("draft"), "draft", prompt, ISOLATION_POOLS[1], SERVICE_K, fp, vocab)
            try:
                used, total = pool("draft")
                check("draft pool held full", used == total, f"{used} of {total} blocks reserved")
                res = client.complete(max_tokens=32, mode="pipelined", **kw)
                check("the target keeps serving while the draft is full",
                      res.token_ids == reference and res.stats["draft_tokens"] == 0,
                      f"{len(res.token_ids)} tokens, {'same as' if res.token_ids == reference else 'NOT'} "
                      f"target-only; {res.stats['draft_tokens']} drafted")
            finally:
                held.close()
            deadline, drafted = time.monotonic() + 30, 0
            while time.monotonic() < deadline and not drafted:
                drafted = client.complete(max_tokens=16, mode="pipelined", **kw).stats["draft_tokens"]
                time.sleep(0.2 if not drafted else 0)
            check("drafting again once the draft's pool is free", drafted > 0, f"{drafted} drafted")
            mem = []
            for name in ("target", "draft"):
                c = getattr(cfg, name)
                m = scrape_metrics(c.host, c.metrics_port)
                peak = m.get(f'specdec:memory_gpu_peak_allocated_bytes{{service="{name}"}}')
                if plan.on_gpu:
                    import torch

                    cap = torch.cuda.get_device_properties(0).total_memory * c.gpu_memory_fraction
                    check(f"{name} peak GPU memory within its fraction", bool(peak) and peak <= cap,
                          f"{(peak or 0) / 2**30:.2f} of {cap / 2**30:.2f} GiB")
                else:
                    rss = m.get(f'specdec:memory_peak_rss_bytes{{service="{name}"}}') or 0
                    mem.append(f"{name} {rss / 2**20:.0f} MiB")
            if mem:
                progress("g: peak RSS " + ", ".join(mem))
    return checks


# ---------------------------------------------------------------------------------------------
# h. overlap and the allocator: the services again under MPS, and with expandable_segments
# ---------------------------------------------------------------------------------------------
MPS_CONTROL = "nvidia-cuda-mps-control"
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
SERVICE_VARIANTS = ("MPS", "expandable_segments")
END_SLACK_S = 50  # a variant may end this far past the budget (the whole check: under 8 minutes on a GPU)


@contextlib.contextmanager
def environment(overrides: dict[str, str]):
    """os.environ with `overrides` (what the services started inside inherit), restored after."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mps_control(env: dict[str, str], *args: str, command: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([shutil.which(MPS_CONTROL) or MPS_CONTROL, *args], input=command, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=20)


def start_mps(work: Path) -> tuple[dict[str, str] | None, str]:
    """Start an MPS control daemon of its own (pipe and log folders under `work`): (the clients'
    environment, what happened), or (None, why not)."""
    if shutil.which(MPS_CONTROL) is None:
        return None, f"{MPS_CONTROL} not found"
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(work / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(work / "log")}
    for d in env.values():
        Path(d).mkdir(parents=True, exist_ok=True)
    try:
        r = mps_control(env, "-d")
        if r.returncode != 0:
            return None, f"{MPS_CONTROL} -d exited with {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"
        r = mps_control(env, command="get_server_list\n")
        if r.returncode != 0:
            stop_mps(env)
            return None, f"the MPS daemon does not answer ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}"
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{MPS_CONTROL}: {e}"
    return env, f"started (`{MPS_CONTROL} -d`)"


def mps_servers(env: dict[str, str]) -> list[str]:
    """The MPS servers the daemon runs (one appears once a client has connected)."""
    r = mps_control(env, command="get_server_list\n")
    return r.stdout.split() if r.returncode == 0 else []


def stop_mps(env: dict[str, str]) -> None:
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        mps_control(env, command="quit\n")


def run_variants(plan: Plan, progress: Progress, d_seconds: float) -> dict:
    """The services of d again, once under MPS (if a daemon can be started) and once with
    expandable_segments (on a GPU): {variant: run_services(...) result, or {'error': why}}. A
    variant that would end more than END_SLACK_S past the budget (d took `d_seconds`) is left out."""
    late = lambda: progress.elapsed() + d_seconds > plan.budget_s + END_SLACK_S  # noqa: E731
    too_late = {"error": f"not run: it would end past the {plan.budget_s:.0f} s budget (+{END_SLACK_S} s)"}
    if late():
        return {"mps_start": "not tried", **{v: too_late for v in SERVICE_VARIANTS}}

    def run(variant: str, env: dict[str, str], while_up: Callable[[], object] | None = None) -> dict:
        try:
            with environment(env):
                return run_services(plan, progress, ready_timeout_s=120 if plan.on_gpu else 60, tag=f"h: {variant}",
                                    while_up=while_up)
        except Exception as e:  # noqa: BLE001 - the report says why
            return {"error": f"{type(e).__name__}: {str(e)[:400]}"}

    env, how = start_mps(Path(tempfile.mkdtemp(prefix="specdec-mps-")))
    out: dict = {"mps_start": how}
    progress(f"h: MPS {how}")
    if env is None:
        out["MPS"] = {"error": f"MPS could not be started: {how}"}
    else:
        try:
            out["MPS"] = run("MPS", env, while_up=lambda: mps_servers(env))
        finally:
            stop_mps(env)
    if not plan.on_gpu:
        out["expandable_segments"] = {"error": "n/a on CPU (a setting of CUDA's caching allocator)"}
    else:
        out["expandable_segments"] = too_late if late() else run("expandable_segments", EXPANDABLE)
    return out


# ---------------------------------------------------------------------------------------------
# e. projection
# ---------------------------------------------------------------------------------------------
def projection(verify_ms: dict[int, float], draft_ms: float, accept: list[float] = ACCEPT_BY_POSITION) -> dict:
    """Best k per mode: {mode: (k, E(k), round ms, tok/s)}. Sequential k d + T(k); pipelined
    max(T(k), (k+1) d) (every speculation hits) and with misses (kchoice.round_ms);
    target-only T(0) per token."""
    out = {"target-only": (0, 1.0, verify_ms[0], 1e3 / verify_ms[0])}
    models = {"sequential": lambda k: k * draft_ms + verify_ms[k],
              "pipelined (ideal)": lambda k: max(verify_ms[k], (k + 1) * draft_ms),
              "pipelined (with misses)": lambda k: round_ms(Mode.PIPELINED, k, accept, draft_ms, verify_ms[k])}
    for name, cost in models.items():
        best = max(range(1, MAX_K + 1), key=lambda k: expected_tokens(accept, k) / cost(k))
        e = expected_tokens(accept, best)
        out[name] = (best, e, cost(best), 1e3 * e / cost(best))
    return out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def header(plan: Plan, command: str) -> list[str]:
    import torch
    import transformers

    dev = torch.cuda.get_device_name(0) if plan.on_gpu else "CPU"
    lines = ["# GPU check (issue 12)", "",
             f"Command: `{command}`", "",
             f"Device: {dev} ({plan.device}); torch {torch.__version__}, transformers {transformers.__version__}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
             f"Models (random weights, specdec/models.py `random:<shape>`): target `{plan.target}`, draft "
             f"`{plan.draft}`, {plan.dtype}. Timings are medians of {plan.runs} runs after 2 warm-ups"
             + (" (torch.cuda.synchronize around each)." if plan.on_gpu else ".")]
    if not plan.on_gpu:
        lines.append("On the CPU, 'graphs' replay the padded step eagerly (`graphs.eager_capture`): graphs vs eager "
                     "is ~1x or below by construction, and the goals are n/a. This run checks the machinery, not "
                     "the device.")
    elif plan.tiny:
        lines.append("--tiny shapes on a GPU: the goals (7B bf16) are n/a.")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specdec.lab.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (random:tiny), seconds on a CPU")
    ap.add_argument("--out", default="docs/bench/gpu.md", help="the Markdown report")
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip sections that would start after this many seconds (420 on a GPU, 300 with --tiny)")
    ap.add_argument("--skip", default="", help="sections to skip, e.g. 'd' (comma-separated letters a-e, g, h)")
    ap.add_argument("--prepare", action="store_true",
                    help="only write the random model folders under $SPECDEC_CACHE_DIR (for a machine without "
                         "the packaged tokenizer) and exit")
    a = ap.parse_args(argv)
    from specdec import models

    if a.prepare:
        for shape in models.RANDOM_SHAPES:
            print(models.resolve(models.RANDOM_PREFIX + shape).directory)
        return 0
    import torch

    from specdec.devices import resolve_device

    device = resolve_device(a.device)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    plan = Plan.make(a.tiny, device, a.budget_s)
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if not plan.on_gpu:
        torch.set_num_threads(1)
    command = "python -m specdec.lab.gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    report = Report(Path(a.out), command.strip(), header(plan, command.strip()))
    progress = Progress()
    progress(f"device {device}, target {plan.target}, draft {plan.draft}, {plan.dtype}; report -> {a.out}")
    state: dict = {}

    def section(letter: str, title: str, body: Callable[[], list[str]]) -> None:
        head = [f"## {letter}. {title}", ""]
        if letter in skip:
            report.add(head + ["Skipped (--skip)."])
            return
        if progress.elapsed() > plan.budget_s:
            report.add(head + [f"Skipped: {progress.elapsed():.0f}s elapsed, over the {plan.budget_s:.0f}s budget."])
            progress(f"{letter}: skipped (over budget)")
            return
        progress(f"{letter}: {title}")
        try:
            report.add(head + body())
        except Exception as e:  # noqa: BLE001 - the report says what failed; the rest still runs
            report.failed.append(letter)
            tb = traceback.format_exc()
            progress(f"{letter}: FAILED: {e!r}")
            print(tb, file=sys.stderr)
            report.add(head + [f"FAILED: `{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}`", "",
                               "```", tb[-3000:].rstrip(), "```"])

    # -- a ----------------------------------------------------------------------------------
    def section_a() -> list[str]:
        bw = bandwidth_gbps(plan)
        progress(f"a: bandwidth {bw:.1f} GB/s")
        runner = load_runner(plan, plan.target, 1)
        progress(f"a: target loaded ({runner.facts.weight_bytes / 1e9:.2f} GB of weights)")
        read = step_read_bytes(runner)
        floor = read / (bw * 1e9) * 1e3
        state.update(bw=bw, floor=floor, target=runner)
        return [report.table_intro(f"a {plan.copy_bytes / 2**20:,.0f} MiB bf16 copy, 5 per timing, median of "
                                   f"{plan.copy_runs}"), "",
                "| what | value |", "|---|---|",
                f"| copy bandwidth (read + written) | {fmt(bw, 1)} GB/s |",
                f"| target weights ({plan.target}, {plan.dtype}) | {fmt(runner.facts.weight_bytes / 1e9, 3)} GB |",
                f"| weight bytes a step reads (untied embedding table excluded) | {fmt(read / 1e9, 3)} GB |",
                f"| floor of the target's step = bytes read / bandwidth | {fmt(floor, 3)} ms |"]

    # -- b ----------------------------------------------------------------------------------
    def section_b() -> list[str]:
        runner = state.get("target") or load_runner(plan, plan.target, 1)
        floor = state.get("floor")
        seq = runner.blocks.reserve(plan.prefill + MAX_K + 8)
        prefill(runner, [seq], plan.prefill)
        t = verify_times(plan, runner, seq, progress)
        in_g = {k: in_graph(runner, 1, k + 1, plan.prefill + k + 1) for k in range(MAX_K + 1)}
        state.update(verify=t)
        state.pop("target", None)
        del runner
        free_device_memory()
        lines = [report.table_intro(f"T(k): one sequence, k+1 tokens after {plan.prefill} cached, ms, median of "
                                    f"{plan.runs}; graphs: the services' buckets, "
                                    "'eager' where no bucket holds the step"), "",
                 "| k | eager ms | graphs ms | ran as a graph | eager / floor | graphs / floor |",
                 "|---|---|---|---|---|---|"]
        for k in range(MAX_K + 1):
            e, g = t["eager"][k], t["graphs"][k]
            lines.append(f"| {k} | {fmt(e, 3)} | {fmt(g, 3)} | {'yes' if in_g[k] else 'eager'} | "
                         f"{fmt(e / floor if floor else None)} | {fmt(g / floor if floor else None)} |")
        return lines

    # -- c ----------------------------------------------------------------------------------
    def section_c() -> list[str]:
        nseq = max(plan.draft_batches)
        runner = load_runner(plan, plan.draft, nseq)
        progress(f"c: draft loaded ({runner.facts.weight_bytes / 1e9:.2f} GB of weights)")
        seqs = [runner.blocks.reserve(plan.prefill + 8) for _ in range(nseq)]
        prefill(runner, seqs, plan.prefill)
        d = decode_times(plan, runner, seqs, progress)
        state.update(decode=d)
        del runner
        free_device_memory()
        lines = [report.table_intro(f"ms per step, median of {plan.runs}; each sequence holds {plan.prefill} "
                                    "tokens"), "",
                 "| step | eager ms | graphs ms | speed-up |", "|---|---|---|---|"]
        for b in plan.draft_batches:
            e, g = d["eager"][b], d["graphs"][b]
            lines.append(f"| draft decode, batch {b} x 1 token ({plan.draft}) | {fmt(e, 3)} | {fmt(g, 3)} | "
                         f"{fmt(e / g)}x |")
        v = state.get("verify")
        if v:
            e, g = v["eager"][8], v["graphs"][8]
            lines.append(f"| target verify, k = 8 (from b) | {fmt(e, 3)} | {fmt(g, 3)} | {fmt(e / g)}x |")
        if not plan.on_gpu:
            lines += ["", "CPU: 'graphs' replay the padded bucket eagerly (`graphs.eager_capture`): no launch is "
                      "saved, so the ratio shows only the cost of padding, not what graphs do on a GPU."]
        return lines

    # -- d ----------------------------------------------------------------------------------
    def section_d() -> list[str]:
        t0 = progress.elapsed()
        res = run_services(plan, progress)
        state.update(services=res, services_s=progress.elapsed() - t0)
        where = (f"cuda, gpu_memory_fraction {plan.fractions[0]} / {plan.fractions[1]}, "
                 + ("KV pools of 4096 tokens" if plan.tiny else "KV pools sized from the share")
                 if plan.on_gpu else "cpu, unpinned, KV pools of 4096 tokens")
        lines = [report.table_intro(
            f"the three services as local processes ({where}); per mode a warm-up request, then "
            f"{plan.service_requests} x {plan.service_tokens} new tokens after a {plan.service_prompt}-token prompt, "
            f"greedy, ignore_eos, k = {SERVICE_K}; means over the rounds of `Client.complete(...).rounds`. "
            "Random weights: acceptance means nothing, so these are step times, not tok/s"), "",
                 "| mode | rounds | ms / round | verify ms | draft ms | mean k | mean accepted | ms / token |",
                 "|---|---|---|---|---|---|---|---|"]
        for mode, rounds in res["modes"].items():
            s = round_summary(rounds)
            lines.append(f"| {mode} | {s['rounds']} | {fmt(s['round_ms'])} | {fmt(s['verify_ms'])} | "
                         f"{fmt(s['draft_ms'])} | {fmt(s['k'], 1)} | {fmt(s['accepted'])} | {fmt(s['ms_per_token'])} |")
        mem = "`specdec:memory_gpu_peak_allocated_bytes`" if plan.on_gpu else "`specdec:memory_peak_rss_bytes`"
        lines += ["", f"Peak memory of each service from its /metrics ({mem}; peak RSS for all), MiB:", "",
                  "| service | peak RSS MiB | GPU peak allocated MiB | weights MiB | KV pool tokens |",
                  "|---|---|---|---|---|"]
        mib = lambda v: fmt(v / 2**20, 0) if v else "n/a"  # noqa: E731
        for name, m in res["memory"].items():
            lines.append(f"| {name} | {mib(m['peak_rss'])} | {mib(m['gpu_peak'])} | {mib(m['weights'])} | "
                         f"{fmt(m['kv_tokens'], 0) if m['kv_tokens'] else 'n/a'} |")
        return lines

    # -- e ----------------------------------------------------------------------------------
    def section_e() -> list[str]:
        v, d = state.get("verify"), state.get("decode")
        if not v or not d:
            raise RuntimeError("needs the measurements of b and c")
        tk, dms = v["graphs"], d["graphs"][1]
        p = projection(tk, dms)
        base = p["target-only"][3]
        lines = [report.table_intro(
            f"projected from T(k) with graphs (b) and the draft's batch-1 decode with graphs (c: "
            f"{fmt(dms, 3)} ms per draft token), with the default pair's acceptance by position measured on "
            "CPU (BENCHMARKS.md §2e; `ACCEPT_BY_POSITION`); best k in 1..16 per mode"), "",
                 "| mode | best k | E(k) tokens / round | ms / round | tok/s | vs target-only |", "|---|---|---|---|---|---|"]
        for mode, (k, e, ms, tps) in p.items():
            lines.append(f"| {mode} | {k} | {fmt(e)} | {fmt(ms, 3)} | {fmt(tps, 1)} | {fmt(tps / base)}x |")
        lines += ["", "Sequential: k d + T(k); pipelined (ideal): max(T(k), (k+1) d), every speculation hits; "
                  "with misses: `kchoice.round_ms` (a miss costs a fresh proposal of k). Target and draft are "
                  "separate processes on one GPU: without MPS their kernels time-slice, so the pipelined overlap "
                  "is an upper bound (d shows what the services do)."]
        return lines

    # -- g ----------------------------------------------------------------------------------
    def section_g() -> list[str]:
        checks = run_isolation(plan, progress)
        state.update(isolation=checks)
        t, d = ISOLATION_POOLS
        lines = [report.table_intro(
            f"a stack of its own with fixed pools (target {t}, draft {d} tokens"
            + (f"; gpu_memory_fraction {plan.fractions[0]} / {plan.fractions[1]}" if plan.on_gpu else "")
            + "): a raw session holds one service's whole pool while requests go through the orchestrator"), "",
                 "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |" for name, ok, detail in checks]
        return lines

    # -- h ----------------------------------------------------------------------------------
    def section_h() -> list[str]:
        base = state.get("services")
        if not base:  # d skipped or failed: nothing to compare with, and no device time to spend
            return ["Not run: it compares with d's run of the services, which did not complete."]
        runs = run_variants(plan, progress, state["services_s"])
        lines = [report.table_intro(
            "d's services and requests again, under an MPS daemon of their own "
            f"(`{MPS_CONTROL} -d`: {runs['mps_start']}) and with "
            "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`; ms per token (round ms / tokens, as in d) "
            "and pipelined / sequential against d's run without either"), "",
                 "| mode | d: ms / token | MPS: ms / token | MPS / d | expandable_segments: ms / token | "
                 "expandable / d |", "|---|---|---|---|---|---|"]
        per = {v: (runs[v] if "error" not in runs[v] else None) for v in SERVICE_VARIANTS}

        def ms(res, mode):
            return round_summary(res["modes"][mode])["ms_per_token"] if res else None

        for mode in SERVICE_MODES:
            b, m, x = ms(base, mode), ms(per["MPS"], mode), ms(per["expandable_segments"], mode)
            lines.append(f"| {mode} | {fmt(b)} | {fmt(m)} | {fmt(m / b if m and b else None)} | {fmt(x)} | "
                         f"{fmt(x / b if x and b else None)} |")
        lines.append("")
        for name, res in (("d", base), ("MPS", per["MPS"]), ("expandable_segments", per["expandable_segments"])):
            if res:
                gain = ms(res, "sequential") / ms(res, "pipelined")
                lines.append(f"- {name}: pipelined is {fmt(gain)}x sequential per token.")
        for v in SERVICE_VARIANTS:
            if per[v] is None:
                lines.append(f"- {v}: {runs[v]['error']}")
        if per["MPS"] is not None:
            servers = per["MPS"].get("while_up") or []
            lines.append(f"- MPS servers while the services ran: {', '.join(servers) if servers else 'none'}"
                         + ("" if servers else " (the services did not go through MPS)"))
        mib = lambda v: fmt(v / 2**20, 0) if v else "n/a"  # noqa: E731
        lines += ["", "GPU memory of each service, MiB (peak allocated / peak reserved by torch's caching "
                  "allocator: reserved beyond allocated is what fragmentation costs):", "",
                  "| service | d | MPS | expandable_segments |", "|---|---|---|---|"]
        for name in ("target", "draft"):
            cells = []
            for res in (base, per["MPS"], per["expandable_segments"]):
                m = (res or {}).get("memory", {}).get(name, {})
                cells.append(f"{mib(m.get('gpu_peak'))} / {mib(m.get('gpu_peak_reserved'))}" if res else "n/a")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return lines

    # -- f ----------------------------------------------------------------------------------
    def goals() -> list[str]:
        lines = ["## f. Goals", ""]
        applies = plan.on_gpu and not plan.tiny
        na = "n/a on CPU" if not plan.on_gpu else "n/a with --tiny"
        v, d, floor = state.get("verify"), state.get("decode"), state.get("floor")
        if applies and v and floor:
            worst = max(range(9), key=lambda k: v["graphs"][k])
            ratio = v["graphs"][worst] / floor
            ok = ratio <= GOAL_FLOOR_RATIO
            lines.append(f"- verify at k <= 8 within {GOAL_FLOOR_RATIO}x the floor (7B bf16, graphs): "
                         f"{'PASS' if ok else 'FAIL'} (worst k = {worst}: {fmt(v['graphs'][worst], 3)} ms = "
                         f"{fmt(ratio)}x the {fmt(floor, 3)} ms floor)")
        else:
            lines.append(f"- verify at k <= 8 within {GOAL_FLOOR_RATIO}x the floor (7B bf16): "
                         f"{na if not applies else 'not measured'}")
        for b in plan.draft_batches:
            if applies and d:
                s = d["eager"][b] / d["graphs"][b]
                lines.append(f"- graphs >= {GOAL_GRAPH_SPEEDUP:g}x eager, draft decode batch {b}: "
                             f"{'PASS' if s >= GOAL_GRAPH_SPEEDUP else 'FAIL'} ({fmt(s)}x)")
            else:
                lines.append(f"- graphs >= {GOAL_GRAPH_SPEEDUP:g}x eager, draft decode batch {b}: "
                             f"{na if not applies else 'not measured'}")
        iso = state.get("isolation")
        if iso:
            failed = [name for name, ok, _ in iso if not ok]
            lines.append(f"- isolation (g), every check: {'PASS' if not failed else 'FAIL'}"
                         + (f" ({'; '.join(failed)})" if failed else f" ({len(iso)} checks)"))
        else:
            lines.append("- isolation (g): not measured")
        return lines

    section("a", "Memory bandwidth and the floor of the target's step", section_a)
    section("b", "The target's verify latency T(k), eager and with CUDA graphs", section_b)
    section("c", "CUDA graphs on / off", section_c)
    section("d", "Through the real services", section_d)
    section("e", "Projected tok/s for the pair", section_e)
    section("g", "Isolated pools: one service's full pool does not stop the other", section_g)
    section("h", "Overlap and the allocator on one GPU: MPS and expandable_segments", section_h)
    report.add(goals())
    total = progress.elapsed()
    status = f"failed sections: {', '.join(report.failed)}" if report.failed else "all sections ran"
    report.add([f"Total {total:.0f}s; {status}."])
    progress(f"done in {total:.0f}s ({status}); report: {a.out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
