"""Where a pipelined round's time goes on the default pair, against sequential rounds on the same
services (issue 11, item 5; BENCHMARKS.md §6r).

    python scripts/round_anatomy_probe.py [--tokens 256] [--reps 2] [--config FILE.toml]

Starts the default stack (`specdec.lab.live.start_stack`; a TOML file overrides its defaults) and
drives its target and draft services from an orchestrator engine in this process, so that each
speculation's timings can be read: the 4 default prompts, greedy, EOS ignored, pipelined then
sequential, --reps times. Prints one JSON object, medians over rounds:
  - the draft's service ms per drafted token while the target verifies (a pipelined round's
    speculation of k+1 tokens) against alone (a sequential round's proposal of k, drafted while
    the target waits): how much the two processes slow each other (caches, memory bandwidth);
  - the verify ms of rounds with k drafts (k = orchestrator.default_k, 8 by default) in each mode
    (the same contention, seen from the target);
  - a speculation's round trip beyond the draft's service time (gRPC both ways, the handoff to
    the draft's model thread), and the orchestrator's turnaround between a speculation's reply
    and the next speculation's request;
  - the pipelined hit round, and the decode rates (tokens / round time, per request).
"""
import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")
import orchestrator.engine as oe  # noqa: E402
from orchestrator.clients import GrpcBackends  # noqa: E402
from orchestrator.engine import GenerationRequest, Orchestrator  # noqa: E402
from specdec import models  # noqa: E402
from specdec.config import SpecdecConfig  # noqa: E402
from specdec.lab.live import start_stack  # noqa: E402
from specdec.lab.workloads import default_prompts  # noqa: E402
from specdec.modes import Mode  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--reps", type=int, default=2)
ap.add_argument("--config", default="")
ap.add_argument("--log-dir", default="/tmp/round-anatomy-logs")
a = ap.parse_args()
cfg = SpecdecConfig.load(a.config or None)
K = cfg.orchestrator.default_k
prompts = default_prompts("chat,code", 2, 0)
tok = models.load_tokenizer(models.resolve(cfg.target.model))

specs: list[tuple[float, float, float, int]] = []  # (sent, replied, service ms, tokens) per speculation
_timed = oe._timed


async def timed(propose, *args):
    res = await _timed(propose, *args)
    specs.append((res.started, res.finished, res.draft_ms, len(res.token_ids)))
    return res

oe._timed = timed  # the engine times each speculation with it


async def main(stack) -> dict:
    backends = GrpcBackends(stack.address("target"), stack.address("draft"), 60, 0.3)
    await backends.connect_target()
    backends.start_monitor()
    while not backends.draft_up:
        await asyncio.sleep(0.2)
    orch = Orchestrator(backends, lambda ids: tok.decode(ids, skip_special_tokens=True), cfg.orchestrator)
    m = {k: [] for k in ("d_pipe", "d_seq", "t_pipe", "t_seq", "rate_pipe", "rate_seq", "hit_round", "rpc", "turn")}
    for _ in range(a.reps):
        for mode in (Mode.PIPELINED, Mode.SEQUENTIAL):
            for p in prompts:
                specs.clear()
                rounds = []
                async for ev in orch.generate(GenerationRequest(list(p.ids), a.tokens, ignore_eos=True, mode=mode)):
                    if ev.round is not None:
                        rounds.append(ev.round)
                tag = "pipe" if mode == Mode.PIPELINED else "seq"
                m[f"t_{tag}"] += [r.verify_ms for r in rounds if r.k == K]
                m[f"rate_{tag}"].append(1e3 * sum(r.accepted + 1 for r in rounds) / sum(r.round_ms for r in rounds))
                if mode == Mode.PIPELINED:
                    whole = [s for s in specs if s[3] == K + 1]
                    m["d_pipe"] += [ms / n for _, _, ms, n in whole]
                    m["rpc"] += [(done - sent) * 1e3 - ms for sent, done, ms, _ in whole]
                    m["turn"] += [(nxt[0] - cur[1]) * 1e3 for cur, nxt in zip(specs, specs[1:])]
                    m["hit_round"] += [r.round_ms for r in rounds if r.pipeline_hit]
                else:
                    m["d_seq"] += [r.draft_ms / r.k for r in rounds if r.k == K]
    await backends.close()
    med = lambda v: round(statistics.median(v), 2)  # noqa: E731
    return {"command": "python scripts/round_anatomy_probe.py " + " ".join(sys.argv[1:]), "k": K,
            "draft ms/token alone (sequential proposals)": med(m["d_seq"]),
            "draft ms/token while the target verifies (pipelined speculations)": med(m["d_pipe"]),
            "verify ms, sequential": med(m["t_seq"]), "verify ms, pipelined": med(m["t_pipe"]),
            "speculation round trip beyond the draft's service ms": med(m["rpc"]),
            "orchestrator turnaround, reply to next speculation ms": med(m["turn"]),
            "pipelined hit round ms": med(m["hit_round"]),
            "decode tok/s pipelined (median request)": med(m["rate_pipe"]),
            "decode tok/s sequential (median request)": med(m["rate_seq"])}


stack = start_stack(cfg, Path(a.log_dir))
try:
    print(json.dumps(asyncio.run(main(stack)), indent=1))
finally:
    stack.stop()
