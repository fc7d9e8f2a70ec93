"""How close each 4-bit copy of the default target is to the fp32 target, and what a step costs:
    python scripts/awq_quality.py OUT_DIR [--prompts 8] [--tokens 64]
Writes OUT_DIR/{awq,awq-sym,rtn,rtn-sym} with `specdec quantize` (calibrated on seed-100 prompts), then
teacher-forces the fp32 target's own greedy continuation of `--prompts` held-out prompts (seed 0,
chat and code) through the paged runner at each precision, and prints one JSON line: per variant,
next-token agreement with fp32, mean KL(fp32 || variant), and the median ms of a 9-token verify
step (one core, 200 cached tokens, 7 runs). Variants: torch-int4 (the draft's precision: the GGUF's
Q4_1 grid, asymmetric, requantized at load), then compressed-tensors checkpoints: rtn-sym and awq-sym
(W4A16, no zero points), rtn and awq (W4A16_ASYM, the `specdec quantize` default); rtn is s = 1."""
import argparse, json, statistics, subprocess, sys, time
sys.path.insert(0, ".")
from pathlib import Path

import torch

from specdec import hf_compat, models
from specdec.lab.workloads import mixed_workload
from specdec.serving.batch import SeqChunk
from specdec.serving.paged_llama import PagedLlamaRunner

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--prompts", type=int, default=8)
ap.add_argument("--tokens", type=int, default=64)
a = ap.parse_args()
torch.set_num_threads(1)
out = Path(a.out)
made = {}
for name, flags in (("awq", []), ("awq-sym", ["--symmetric"]), ("rtn", ["--method", "rtn"]),
                    ("rtn-sym", ["--method", "rtn", "--symmetric"])):
    if not (out / name / "config.json").exists():
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-m", "specdec.cli", "quantize", "--out", str(out / name), *flags], check=True)
        made[name] = round(time.monotonic() - t0, 1)

spec = models.DEFAULT_TARGET_MODEL
tok = models.load_tokenizer(models.resolve(spec))
prompts = [hf_compat.chat_token_ids(tok, p.messages) for p in mixed_workload(a.prompts, 0)]
variants = {"fp32": (spec, "float32"), "torch-int4": (spec, "int4"),
            **{name: (str(out / name), "int4") for name in ("rtn-sym", "awq-sym", "rtn", "awq")}}


def logits_of(runner, ids, n_logits):
    seq = runner.blocks.reserve(len(ids) + 8)
    try:
        (lg,) = runner.forward([SeqChunk(seq, ids, 0, n_logits)])
        return lg.float()
    finally:
        runner.blocks.free(seq)


def verify_ms(runner):
    seq = runner.blocks.reserve(256)
    runner.forward([SeqChunk(seq, list(range(100, 300)), 0, 1)])
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        runner.forward([SeqChunk(seq, list(range(300, 309)), 200, 9)])
        times.append((time.perf_counter() - t0) * 1e3)
        runner.truncate(seq, 200)
    runner.blocks.free(seq)
    return statistics.median(times)


result = {"prompts": len(prompts), "tokens": a.tokens, "quantize_s": made, "variants": {}}
reference = {}
for name, (model, dtype) in variants.items():
    runner = PagedLlamaRunner.load(model, dtype, "cpu", pool_tokens=2048, block_size=16, max_seqs=2)
    agree, kl, n = 0, 0.0, 0
    for i, ids in enumerate(prompts):
        if name == "fp32":  # the fp32 target's greedy continuation, then teacher-forced for all
            seq, s = list(ids), runner.blocks.reserve(len(ids) + a.tokens + 8)
            (lg,) = runner.forward([SeqChunk(s, seq, 0, 1)])
            for _ in range(a.tokens):
                seq.append(int(lg[-1].argmax()))
                (lg,) = runner.forward([SeqChunk(s, seq[-1:], len(seq) - 1, 1)])
            runner.blocks.free(s)
            reference[i] = (seq, logits_of(runner, seq, a.tokens + 1)[:-1])
        seq, ref = reference[i]
        lg = logits_of(runner, seq, a.tokens + 1)[:-1]  # [tokens, V]: predictions of the continuation
        agree += int((lg.argmax(-1) == ref.argmax(-1)).sum())
        kl += float(torch.nn.functional.kl_div(lg.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                                               reduction="sum"))
        n += lg.shape[0]
    result["variants"][name] = {"agreement": round(agree / n, 4), "mean_kl": round(kl / n, 5),
                                "weight_mb": round(runner.facts.weight_bytes / 1e6, 1),
                                "verify9_ms": round(verify_ms(runner), 1)}
    print(name, result["variants"][name], file=sys.stderr, flush=True)
    del runner
print(json.dumps(result))
