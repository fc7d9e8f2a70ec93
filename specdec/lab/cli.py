"""The lab's subcommands of `specdec`: bench, study, tune and quantize (registered by specdec/cli.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from specdec.lab import bench, quantize, report, steps, study, tune
from specdec.lab.analysis import SPECULATIVE


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config of the services started (default: the embedded default pair)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (checks the machinery in seconds)")
    p.add_argument("--workloads", default="chat,summarization,code,math")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and request seeds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parsers(sub) -> None:
    """`specdec bench`, `specdec study`, `specdec tune` and `specdec quantize`."""
    add_bench_parser(sub)
    add_study_parser(sub)
    add_tune_parser(sub)
    quantize.add_quantize_parser(sub)


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark our modes against the peers, side by side")
    add_common_args(b)  # --config, --tiny, --workloads, --seed, --no-progress
    b.set_defaults(workloads="chat,code")
    b.add_argument("--address", help="use a running orchestrator instead of starting one")
    b.add_argument("--prompts", type=int, default=2, help="prompts per workload")
    b.add_argument("--max-tokens", default="128,256", help="output lengths, one table each (e.g. 128 or 128,256)")
    b.add_argument("--runs", type=int, default=3)
    b.add_argument("--k", type=int, default=8)
    b.add_argument("--systems", default=",".join(bench.OURS + bench.PEERS))
    b.add_argument("--peer-threads", type=int, default=2)
    b.add_argument("--llamacpp-ks", default="4,8,12",
                   help="draft lengths llama.cpp's speculative example runs at, one system each (its best k)")
    b.add_argument("--out", default="bench-results")
    g = b.add_argument_group("many clients at once (specdec/lab/load.py)")
    g.add_argument("--concurrency", help="run the concurrency sweep instead: numbers of clients, e.g. 1,2,4,8,16 "
                                         "(--max-tokens is then one length, the first given)")
    g.add_argument("--load-peers", default="llama-server,hf-continuous-batching", help="the sweep's peers")
    g.add_argument("--target-engines", default="torch,llamacpp", help="the sweep's target engines (one stack each)")
    g.add_argument("--requests-per-client", type=int, default=2)
    g.add_argument("--load-prompts", type=int, default=32, help="ShareGPT chat prompts the clients cycle through")
    s = b.add_argument_group("the cost of one batched forward (specdec/lab/steps.py)")
    s.add_argument("--steps", action="store_true", help="measure step costs per runner and batch shape instead")
    s.add_argument("--step-variants", default="torch-fp32,torch-bf16,torch-int4,llamacpp-f32,llamacpp-f16,"
                                              "llamacpp-q8_0,llamacpp-q4_1")
    b.set_defaults(fn=lambda a: (steps.run_steps(a) if a.steps else bench.run_load(a) if a.concurrency
                                 else bench.run_compare(a)) and 0)


def add_study_parser(sub) -> None:
    p = sub.add_parser("study", help="benchmark studies: k sweep, drafts, temperatures, acceptance by position, "
                                     "ideal bound (see specdec/lab/study.py)",
                       description=study.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--out", default="study-results")
    p.add_argument("--quick", action="store_true", help="few prompts, short outputs, k in 1,4,8,16")
    p.add_argument("--studies", default=",".join(study.STUDIES), help=f"comma list of {', '.join(study.STUDIES)}")
    p.add_argument("--prompts", type=int, help="prompts per workload (2; quick 1)")
    p.add_argument("--lengths", help="output lengths (128,256; quick 64)")
    p.add_argument("--runs", type=int, help="runs per cell (3; quick 2)")
    p.add_argument("--separate-lengths", action="store_true",
                   help="one request per output length (default: request the longest, measure the shorter "
                        "lengths as its prefixes: time to the L-th token)")
    p.add_argument("--ks", help="k values of the sweep, e.g. 1-16 or 1,2,4 (1-16; quick 1,4,8,16)")
    p.add_argument("--modes", default=",".join(SPECULATIVE))
    p.add_argument("--k", type=int, default=8, help="k of the draft and temperature studies")
    p.add_argument("--position-k", type=int, default=16, help="k of the acceptance-by-position curves")
    p.add_argument("--control", action="store_true",
                   help="also measure target-only a second time (the A/A control: its ratio to the first sizes "
                        "the machine's noise)")
    p.add_argument("--drafts", help="comma list of drafts to compare (default: all loadable here)")
    p.add_argument("--target-temps", help="target temperatures of the grid (0,0.6,1.0; quick 0,1.0)")
    p.add_argument("--draft-temps", help="draft temperatures of the grid (0,0.1,0.6,0.8; quick 0,0.6)")
    p.add_argument("--render", action="store_true",
                   help="only rewrite study.md and the plots in --out from its study.json (no measurement)")
    p.add_argument("--from-partial", action="store_true",
                   help="only write study.md and study.json from the complete runs in --out's study-partial.json "
                        "(a study that stopped early; give the flags it ran with)")
    p.set_defaults(fn=lambda a: 0 if (report.render(Path(a.out)) if a.render else study.report_from_partial(a)
                                      if a.from_partial else study.run_study(a)) else 1)


def add_tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="search k, draft temperature and draft within a time budget; writes a config",
                       description=tune.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.set_defaults(workloads="chat,code")
    p.add_argument("--out", default="tune-results")
    p.add_argument("--budget-s", type=float, default=900.0)
    p.add_argument("--prompts", type=int, default=1, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--ks", default="1,2,3,4,5,6,8,10,12,16")
    p.add_argument("--draft-temps", default="0,0.1,0.3,0.6,0.8,1.0")
    p.add_argument("--temperature", type=float, default=0.7, help="target temperature of the sampled requests")
    p.add_argument("--drafts", help="comma list of drafts to try (default: all loadable here)")
    p.add_argument("--min-gain-pct", type=float, default=3.0, help="smaller gains keep the default")
    p.add_argument("--fresh", action="store_true", help="ignore the cache of earlier measurements")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=lambda a: 0 if tune.run_tune(a) else 1)
