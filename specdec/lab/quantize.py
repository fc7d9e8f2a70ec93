"""`specdec quantize`: an INT4 AWQ checkpoint (compressed-tensors W4A16) from a model spec,
calibrated on shipped prompts (specdec/awq.py does the work; this is its command line).

    specdec quantize smollm2-135m-instruct --out ~/models/smollm2-awq
    specdec up --target-model ~/models/smollm2-awq --target-dtype int4

Calibration: `--calibration-prompts` ShareGPT chat and HumanEval code prompts (alternating),
rendered with the model's chat template, chosen with `--seed` (100 by default, away from the
seed-0 prompts the tests and benchmarks send). `--method rtn` writes the same format with
s = 1 everywhere (round-to-nearest), the baseline AWQ is measured against.
"""
from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)


def add_quantize_parser(sub) -> None:
    p = sub.add_parser("quantize", help="write an INT4 AWQ checkpoint (compressed-tensors W4A16) of a model",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct", help="model spec (packaged name, .gguf, HF dir)")
    p.add_argument("--out", required=True, help="the checkpoint directory to write")
    p.add_argument("--method", choices=("awq", "rtn"), default="awq")
    p.add_argument("--calibration-prompts", type=int, default=16)
    p.add_argument("--max-calibration-tokens", type=int, default=4096)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--symmetric", action="store_true",
                   help="no zero points (W4A16); default: a zero point per group (W4A16_ASYM)")
    p.add_argument("--grid", type=int, default=20, help="AWQ: alpha values searched in [0, 1)")
    p.add_argument("--seed", type=int, default=100, help="calibration prompt selection")
    p.set_defaults(fn=lambda a: run_quantize(a))


def calibration_ids(tokenizer, n: int, seed: int) -> list[list[int]]:
    from specdec import hf_compat
    from specdec.lab.workloads import mixed_workload

    return [hf_compat.chat_token_ids(tokenizer, p.messages) for p in mixed_workload(n, seed)]


def run_quantize(a) -> int:
    from specdec import awq, models

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    src = models.resolve(a.model)
    tok = models.load_tokenizer(src)
    model = models.load_model(src, "float32")
    settings = awq.AwqSettings(group_size=a.group_size, symmetric=a.symmetric,
                               grid=a.grid if a.method == "awq" else 1,
                               max_calibration_tokens=a.max_calibration_tokens)
    report = awq.awq_quantize(model, calibration_ids(tok, a.calibration_prompts, a.seed), settings)
    out = awq.save_checkpoint(model, tok, Path(a.out).expanduser(), settings, report)
    print(f"{a.method}: {out} ({sum(f.stat().st_size for f in out.iterdir()) / 2**20:.0f} MiB) in "
          f"{time.monotonic() - t0:.0f}s; calibration {report.calibration_tokens} tokens; output error "
          f"{report.awq_loss:.4g} (round-to-nearest {report.rtn_loss:.4g})")
    return 0
