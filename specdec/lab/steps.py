"""`specdec bench --steps`: what one batched forward costs, per runner and batch shape.

For each runner (engine and precision) and each shape B x n (B sequences, each feeding n
tokens after CONTEXT cached ones: n = 1 is a decode or draft step, n = k+1 a verify), the
median wall time of `runner.forward` over `--runs` repetitions, in one process pinned to one
core with one thread (as the services run). This is what the engine defaults are chosen
from (README, "Choosing the defaults"); the serving numbers are in the concurrency sweep.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from specdec.config import DraftConfig

CONTEXT = 300
SHAPES = ((1, 1), (4, 1), (8, 1), (16, 1), (1, 9), (4, 9), (8, 9), (16, 9))


def median_ms(f, reps: int = 15, warmup: int = 3) -> float:
    """Median wall ms of `reps` calls of f(), after `warmup` calls (the probes in scripts/)."""
    for _ in range(warmup):
        f()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(times), 2)


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # torch | llamacpp
    precision: str  # torch dtype, or a GGUF type ("" = as shipped)
    int4_head: str = DraftConfig.int4_head  # torch int4: the output head (by default as the draft service builds it)
    cpu_kernels: str = "specdec"  # torch float32 and int4: specdec's kernels (as the services build them) or torch's
    int4_activations: int = DraftConfig.int4_activations  # torch int4 in specdec's kernels: 8 | 16 bits


VARIANTS = {
    "torch-fp32": Variant("torch-fp32", "torch", "float32"),
    # every float32 matrix in float32 panels, none read from its GGUF codes (the same logits, 5x the bytes)
    "torch-fp32-panels": Variant("torch-fp32-panels", "torch", "float32", cpu_kernels="specdec-f32"),
    "torch-fp32-mkl": Variant("torch-fp32-mkl", "torch", "float32", cpu_kernels="torch"),
    "torch-bf16": Variant("torch-bf16", "torch", "bfloat16"),
    "torch-int4": Variant("torch-int4", "torch", "int4"),
    "torch-int4-torch": Variant("torch-int4-torch", "torch", "int4", cpu_kernels="torch"),
    "torch-int4-bf16-head": Variant("torch-int4-bf16-head", "torch", "int4", "bfloat16"),
    "torch-int4-x8": Variant("torch-int4-x8", "torch", "int4", "int8", int4_activations=8),  # 8-bit activations, int8 head
    "torch-int4-x16": Variant("torch-int4-x16", "torch", "int4", "q8_0", int4_activations=16),  # 16-bit, Q8_0 head
    "llamacpp-f32": Variant("llamacpp-f32", "llamacpp", "f32"),
    "llamacpp-f16": Variant("llamacpp-f16", "llamacpp", "f16"),
    "llamacpp-q8_0": Variant("llamacpp-q8_0", "llamacpp", "q8_0"),
    "llamacpp-q4_1": Variant("llamacpp-q4_1", "llamacpp", ""),
}


def load(v: Variant, model: str, seqs: int):
    """The runner as the services build it (specdec.serving.runners), with room for `seqs` sequences."""
    from specdec.config import ModelServiceConfig
    from specdec.serving.runners import load_runner

    cfg = ModelServiceConfig(engine=v.engine, model=model, dtype=v.precision if v.engine == "torch" else "float32",
                             gguf_type=v.precision if v.engine == "llamacpp" else "", int4_head=v.int4_head,
                             cpu_kernels=v.cpu_kernels, int4_activations=v.int4_activations,
                             kv_pool_tokens=seqs * 512, max_sessions=seqs)
    return load_runner(cfg, "cpu")


def argmax_per_position(runner, ids: list[int], step: int = 4):
    """[len(ids)] the runner's argmax after each position of `ids` (a fresh sequence, fed `step`
    tokens a step with logits for all of them): what a draft would propose there, to compare
    with a target's (the agreement probes, BENCHMARKS §6f, §6q)."""
    import torch

    from specdec.serving.batch import SeqChunk

    s = runner.blocks.reserve(len(ids) + step)
    out = [runner.forward([SeqChunk(s, ids[i:i + step], i, len(ids[i:i + step]))])[0].float().argmax(-1)
           for i in range(0, len(ids), step)]
    runner.free(s)
    return torch.cat(out)


def time_shape(runner, batch: int, n: int, runs: int) -> float:
    """Median ms of one forward of `batch` sequences x `n` new tokens after CONTEXT cached tokens."""
    from specdec.serving.batch import SeqChunk

    seqs = [runner.blocks.reserve(CONTEXT + max(64, n)) for _ in range(batch)]
    try:
        for b, s in enumerate(seqs):  # the context, fed in chunks
            toks = [(100 + 13 * i + 7 * b) % 20000 + 50 for i in range(CONTEXT)]
            for i in range(0, CONTEXT, 128):
                runner.forward([SeqChunk(s, toks[i:i + 128], i, 1 if i + 128 >= CONTEXT else 0)])
        times = []
        for r in range(runs + 1):  # the first is a warm-up
            chunks = [SeqChunk(s, [(300 + 7 * r + j) % 20000 + 50 for j in range(n)], CONTEXT, n) for s in seqs]
            t0 = time.perf_counter()
            runner.forward(chunks)
            times.append((time.perf_counter() - t0) * 1e3)
            for s in seqs:
                runner.truncate(s, CONTEXT)
        return statistics.median(times[1:])
    finally:
        for s in seqs:
            runner.free(s)


def measure(variant: str, model: str, runs: int) -> dict[str, float]:
    """One variant's table, in this process: {'BxN': ms}."""
    import torch

    torch.set_num_threads(1)
    runner = load(VARIANTS[variant], model, max(b for b, _ in SHAPES))
    return {f"{b}x{n}": round(time_shape(runner, b, n, runs), 1) for b, n in SHAPES}


def run_steps(a) -> dict:
    """Each variant in a fresh process pinned to core 0 (one at a time, so they do not compete)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from specdec import models

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = {}
    for variant in [v for v in a.step_variants.split(",") if v]:
        code = (f"import json; from specdec.lab.steps import measure; "
                f"print(json.dumps(measure({variant!r}, {models.DEFAULT_TARGET_MODEL!r}, {a.runs})))")
        r = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], capture_output=True, text=True)
        table[variant] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}
        print(variant, table[variant], file=sys.stderr, flush=True)
    result = {"command": "specdec bench " + " ".join(sys.argv[2:]), "context": CONTEXT, "runs": a.runs,
              "table": table}
    (out / "steps.json").write_text(json.dumps(result, indent=2))
    shapes = [f"{b}x{n}" for b, n in SHAPES]
    md = [f"Command: `{result['command']}` (ms per forward, median of {a.runs}; each sequence holds {CONTEXT} "
          f"tokens; 1 thread on core 0)", "", "| runner | " + " | ".join(shapes) + " |",
          "|---|" + "---|" * len(shapes)]
    for v, row in table.items():
        md.append(f"| {v} | " + " | ".join(f"{row.get(s, '')}" for s in shapes) + " |")
    (out / "steps.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return result
