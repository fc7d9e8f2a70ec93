"""`specdec bench --concurrency 1,2,4,8,16`: many clients at once, on every system, side by side.

At each concurrency C, C client threads send ShareGPT chat prompts (greedy, `--max-tokens`
new tokens, EOS ignored), each client `--requests-per-client` of them, one after another.
Per point: aggregate tok/s (all tokens / wall time from the first send to the last reply),
and per request the time to first token (TTFT) and the time per output token after it
(TPOT), as p50 and p99. One run walks all concurrencies; inside a run the systems of one
concurrency are measured one after the other (order rotating per run), so that ratios are
side by side; the report gives medians with min and max over runs.

Systems:
- ours: target-only, sequential and pipelined, through the real services, for each
  `--target-engines` (torch: the paged fp32 runner; llamacpp: the F32 copy of the file),
  with the default draft (llama.cpp, the shipped Q4_1);
- llama-server: llama.cpp's server with `-np` slots (as many as the largest concurrency),
  the same F32 target and the shipped Q4_1 draft (`--model-draft`, `--spec-draft-n-max k`),
  2 threads, its other settings at their defaults: the serving peer a CPU user would pick
  (built by scripts/build_llamacpp_peer.sh);
- hf-continuous-batching: transformers `generate_batch` (continuous batching) on the fp32
  target, target only, 2 threads; it is an offline API, so each point hands it all
  C x requests-per-client prompts at once and only the aggregate tok/s is reported.
"""
from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specdec.lab.analysis import spread
from specdec.lab.workloads import TokenizedPrompt
from specdec.modes import LABELS

SERVER = "llama-server"
HF_CB = "hf-continuous-batching"


@dataclass
class Timing:
    """One request, as its client saw it."""

    tokens: int
    ttft_s: float
    total_s: float

    @property
    def tpot_s(self) -> float:
        return (self.total_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else 0.0


@dataclass
class Point:
    system: str
    clients: int
    run: int
    tokens: int
    seconds: float
    requests: list[Timing] = field(default_factory=list)
    error: str = ""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def drive(clients: int, jobs: list[TokenizedPrompt], start_client: Callable[[], object],
          send: Callable[[object, TokenizedPrompt], Timing]) -> tuple[float, list[Timing]]:
    """`clients` threads take the jobs from one queue; -> (wall seconds, per-request timings)."""
    todo: queue.Queue = queue.Queue()
    for j in jobs:
        todo.put(j)
    timings: list[Timing] = []
    errors: list[BaseException] = []
    go = threading.Barrier(clients + 1)

    def worker():
        conn = start_client()
        go.wait()
        try:
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                timings.append(send(conn, job))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            close = getattr(conn, "close", None)
            if close:
                close()

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds, timings


# -- ours ---------------------------------------------------------------------------------------------

def ours_sender(address: str, mode: str, max_tokens: int, k: int):
    from specdec.client import Client

    def send(client, p: TokenizedPrompt) -> Timing:
        t0 = time.perf_counter()
        first, n = 0.0, 0
        for chunk in client.generate(token_ids=p.ids, max_tokens=max_tokens, ignore_eos=True, mode=mode, k=k):
            if chunk.token_ids and not n:
                first = time.perf_counter() - t0
            n += len(chunk.token_ids)
        return Timing(n, first, time.perf_counter() - t0)

    return (lambda: Client(address)), send


# -- llama-server --------------------------------------------------------------------------------------

class LlamaServer:
    """llama.cpp's server with the F32 target and the shipped Q4_1 draft, on a loopback port."""

    def __init__(self, slots: int, k: int, ctx_per_slot: int = 2048, threads: int = 2, log: Path | None = None):
        from specdec import models
        from specdec.lab import peers
        from specdec.launcher import free_port
        from specdec.serving.llamacpp import gguf_variant

        peers.ensure_llamacpp_built()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(peers.llamacpp_binary("llama-server")), "-m", str(gguf_variant(models.DEFAULT_TARGET_MODEL, "f32")),
               "--model-draft", str(models.resolve(models.DEFAULT_DRAFT_MODEL).gguf_path),
               "--spec-draft-n-max", str(k), "-np", str(slots), "-c", str(slots * ctx_per_slot),
               "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = cmd
        self._log = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start ({' '.join(cmd)})")
            time.sleep(0.3)

    def sender(self, max_tokens: int):
        def send(_conn, p: TokenizedPrompt) -> Timing:
            body = json.dumps({"prompt": p.ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                               "ignore_eos": True, "stream": True, "cache_prompt": False}).encode()
            req = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
            t0 = time.perf_counter()
            first, n = 0.0, 0
            with urllib.request.urlopen(req, timeout=600) as r:
                for line in r:
                    if not line.startswith(b"data: "):
                        continue
                    ev = json.loads(line[6:])
                    if ev.get("content") or ev.get("tokens"):
                        if not first:
                            first = time.perf_counter() - t0
                    if ev.get("stop"):
                        n = int(ev.get("tokens_predicted") or ev.get("timings", {}).get("predicted_n") or 0)
            return Timing(n, first, time.perf_counter() - t0)
        return (lambda: None), send

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# -- transformers continuous batching --------------------------------------------------------------------

class HFContinuousBatching:
    def __init__(self, threads: int = 2):
        import torch

        from specdec import models

        torch.set_num_threads(threads)
        self.model = models.load_model(models.resolve(models.DEFAULT_TARGET_MODEL), "float32")

    def run(self, prompts: list[TokenizedPrompt], max_tokens: int) -> tuple[int, float]:
        from transformers import GenerationConfig

        gc = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        out = self.model.generate_batch([p.ids for p in prompts], generation_config=gc, progress_bar=False)
        seconds = time.perf_counter() - t0
        return sum(len(o.generated_tokens) for o in out.values()), seconds


# -- the sweep ------------------------------------------------------------------------------------------

def run_sweep(a, prompts: list[TokenizedPrompt], addresses: dict[str, str], out: Path,
              on_point: Callable[[Point], None]) -> list[Point]:
    """addresses: target engine -> our orchestrator. Returns every measured point."""
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = [m for m in LABELS if m in a.systems.split(",")]  # --systems picks our modes
    systems = [f"{m}/{e}" for e in addresses for m in modes]
    peers = [s for s in a.load_peers.split(",") if s in (SERVER, HF_CB)]
    server = hf = None
    if SERVER in peers:
        try:
            server = LlamaServer(max(levels), a.k, log=out / "logs" / "llama-server.log")
        except Exception as e:  # noqa: BLE001 - reported as a missing row
            print(f"llama-server: skipped ({e})")
    if HF_CB in peers:
        hf = HFContinuousBatching()
    systems += [s for s, ok in ((SERVER, server), (HF_CB, hf)) if ok]
    points: list[Point] = []
    try:
        for run in range(a.runs):
            for c in levels:
                jobs = [prompts[(i + run) % len(prompts)] for i in range(c * a.requests_per_client)]
                order = systems[run % len(systems):] + systems[:run % len(systems)]
                for system in order:
                    p = measure(system, c, run, jobs, a, addresses, server, hf)
                    points.append(p)
                    on_point(p)
    finally:
        if server is not None:
            server.close()
    return points


def measure(system, clients, run, jobs, a, addresses, server, hf) -> Point:
    try:
        if system == HF_CB:
            tokens, seconds = hf.run(jobs, a.max_tokens)
            return Point(system, clients, run, tokens, seconds)
        if system == SERVER:
            start, send = server.sender(a.max_tokens)
        else:
            mode, engine = system.split("/")
            start, send = ours_sender(addresses[engine], mode, a.max_tokens, a.k)
        seconds, timings = drive(clients, jobs, start, send)
        return Point(system, clients, run, sum(t.tokens for t in timings), seconds, timings)
    except Exception as e:  # noqa: BLE001 - one failed point is reported, the sweep goes on
        return Point(system, clients, run, 0, 0.0, error=f"{type(e).__name__}: {e}")


def summarize(points: list[Point]) -> dict:
    """Per system and concurrency: tok/s over runs (median, min, max) and latency percentiles over all
    requests of all runs; and the ratios the issue asks for, per run (side by side)."""
    table: dict[str, dict[str, dict]] = {}
    for (system, c) in sorted({(p.system, p.clients) for p in points}, key=lambda x: (x[0], x[1])):
        ps = [p for p in points if p.system == system and p.clients == c and not p.error]
        reqs = [t for p in ps for t in p.requests]
        table.setdefault(system, {})[str(c)] = {
            "tok_s": spread([p.tok_s for p in ps]) if ps else None,
            "ttft_p50_ms": percentile([t.ttft_s for t in reqs], 50) * 1e3,
            "ttft_p99_ms": percentile([t.ttft_s for t in reqs], 99) * 1e3,
            "tpot_p50_ms": percentile([t.tpot_s for t in reqs], 50) * 1e3,
            "tpot_p99_ms": percentile([t.tpot_s for t in reqs], 99) * 1e3,
            "requests": len(reqs),
            "errors": [p.error for p in points if p.system == system and p.clients == c and p.error],
        }
    return {"table": table, "ratios": ratios(points)}


def ratios(points: list[Point]) -> dict[str, dict]:
    """Per run, side by side: each of our systems at C clients / itself at 1 client, and ours / llama-server."""
    by = {(p.system, p.clients, p.run): p.tok_s for p in points if not p.error}
    out: dict[str, dict] = {}
    for (system, c, run), v in sorted(by.items()):
        if system in (SERVER, HF_CB):
            continue
        if c > 1 and (system, 1, run) in by and by[(system, 1, run)] > 0:
            out.setdefault(f"{system} @{c} / @1", []).append(v / by[(system, 1, run)])
        if (SERVER, c, run) in by and by[(SERVER, c, run)] > 0:
            out.setdefault(f"{system} / {SERVER} @{c}", []).append(v / by[(SERVER, c, run)])
    return {k: spread(v) for k, v in out.items()}


def points_json(points: list[Point]) -> list[dict]:
    return [asdict(p) | {"tok_s": p.tok_s} for p in points]
