"""`specdec study`: the benchmark studies of issue 4, through the real services.

    specdec study --quick                          # a short pass: few prompts, short outputs, k in 1,4,8,16
    specdec study --out study-results              # everything, on the default pair (hours on 2 CPU cores)
    specdec study --tiny --quick                   # tiny random models: checks the machinery in seconds
    specdec study --studies ksweep,positions --ks 1-16 --lengths 128,256 --runs 5

Every number comes from our three services started by this command on free loopback ports
(`specdec.lab.live.LiveStack`, the `specdec up` layout), on prompts from `specdec.lab.workloads`
(workloads chat, summarization, code and math), generating a fixed number of tokens (EOS
ignored) per output length (`--lengths`, default 128 and 256), greedy unless stated. Only the
longest length is requested; a shorter length L is measured on the same request as the time
its L-th token reached the client (`prefix_record`; `--separate-lengths` makes one request per
length instead). One *cell*
is one setting (draft, mode, k, target and draft temperature); one *run* of a cell generates
every prompt once, and its tok/s is tokens / wall time of the run (prefill included), seen by
the client. The runs of all cells of one draft are interleaved (their order rotates), so
comparisons are side by side under the same machine noise; each table gives the median, min
and max over the runs and the spread % = (max - min) / median.

Studies (`--studies`, default all):
- ksweep: k in `--ks` (default 1..16), pipelined and sequential, plus target-only: tok/s,
  acceptance rate, mean accepted tokens per round (1 + accepted / rounds with drafts); adaptive
  k (each round's k chosen by the orchestrator, at most `--k`) is its own row in both modes.
- drafts: each draft the system can load here (`--drafts`): torch-int4 (the default: the
  paged torch runner with 4-bit weights), llamacpp (the shipped Q4_1 GGUF), llamacpp-q8_0 and llamacpp-f16 (the same weights re-quantized by llama.cpp's
  own tool, when the llama.cpp peer is built), torch-fp32 and torch-bf16 (torch copies of the
  target), ngram (prompt lookup). The only other real model here, Gemma-3 270M, has another
  tokenizer, so it cannot draft for this target.
  Swapping the draft restarts the draft service alone with a new [draft] section and waits
  for the orchestrator to re-attach it. Per draft: the draft service's RSS (and peak) from its
  /metrics, draft ms per token (draft_ms / k over the rounds with k > 0, sequential mode),
  acceptance, tok/s and the speedup over target-only measured in the same group.
- temps: target temperature in {0, 0.6, 1.0} x draft temperature in {0, 0.1, 0.6, 0.8}
  (pipelined, k = `--k`, a fixed seed per prompt and run): acceptance and tok/s; at each
  sampled target temperature also fixed against adaptive k, the draft at the target's sampling.
- positions: acceptance by draft position (accepted_by_position / drafted_by_position summed
  over requests) at k = `--position-k` (16), per workload and per draft.
- control (`--control`, with any study): target-only measured a second time, interleaved like
  every cell: the A/A ratio (its per-run ratios to the first target-only) sizes the machine's
  noise, which no speedup of that study can be told apart from.
- ideal (computed from the ksweep cells, no extra requests): with d = measured draft ms per
  token, T(k) = mean verify_ms of the rounds that verified k drafts, and E(k) = 1 + sum_i
  P(first i drafts all accepted) from the per-position counts, the ideal decode rate is
  E / (k d + T(k)) sequential and E / max(T(k), (k+1) d) pipelined (every round a hit).
  Efficiency = measured decode tok/s (tokens after the first / time after the first) / ideal.
  Below 0.9 the report names the biggest loss with numbers (see `loss_breakdown`).

Outputs in `--out`: study.md (tables), study.json (settings, every cell's statistics and every
request's raw numbers, rounds included), ksweep.png, acceptance_by_position.png,
round_time_split.png, ideal.png, and the service logs (logs/). A study that stops early leaves
the requests measured so far in study-partial.json, and study.md / study.json from the runs that
every cell completed, if any (`--from-partial`, with the flags the study ran with, writes them
again from study-partial.json). A draft that cannot be loaded here is skipped and named in the
report.

`--quick`: 1 prompt per workload, outputs of 64 tokens, 2 runs, k in 1,4,8,16, a 2 x 2
temperature grid. `--tiny`: tiny random Llama models carrying the SmolLM2 tokenizer, made in
`<out>/tiny-models` (a target; a noisy copy of it as the default torch draft, "tiny-draft";
torch-fp32/bf16 are copies of the tiny target; llamacpp stays the shipped GGUF, which shares
the tokenizer): the numbers mean nothing, the machinery is exercised in seconds. Explicit
flags override what --quick sets.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.devices import parse_int_ranges
from specdec.lab import report
from specdec.lab.analysis import (SPECULATIVE, aggregate, full_requests, ideal_bound, position_curve, prefix_record,
                                  speedups)
from specdec.lab.live import LiveStack, base_config, parse_floats, request_seed, variant_of
from specdec.lab.workloads import TokenizedPrompt, default_prompts
from specdec.modes import Mode

STUDIES = ("ksweep", "drafts", "temps", "positions")


# ----------------------------------------------------------------------------------------------
# Cells and their interleaved measurement
# ----------------------------------------------------------------------------------------------
@dataclass
class Cell:
    draft: str
    mode: str
    k: int
    temperature: float | None = None  # None = greedy
    draft_temperature: float | None = None  # None = the server's default
    adaptive: bool = False  # adaptive k: each round's k chosen (at most k) by the orchestrator
    studies: set = field(default_factory=set)
    again: bool = False  # a second copy of the same setting (the A/A control: target-only twice)

    @property
    def id(self) -> str:
        s = f"{self.draft}/{self.mode}"
        if self.mode != Mode.TARGET_ONLY.label:
            s += f"/k{self.k}" + ("/adaptive" if self.adaptive else "")
        if self.again:
            s += "/again"
        if self.temperature is not None or self.draft_temperature is not None:
            s += f"/T{_t(self.temperature)}/dT{_t(self.draft_temperature)}"
        return s

    def to_json(self) -> dict:
        return {"id": self.id, "draft": self.draft, "mode": self.mode, "k": self.k, "temperature": self.temperature,
                "draft_temperature": self.draft_temperature, "adaptive": self.adaptive, "again": self.again,
                "studies": sorted(self.studies)}


def _t(v) -> str:
    return "-" if v is None else f"{v:g}"


def request_lengths(lengths: list[int], separate: bool) -> list[int]:
    """The output lengths actually requested: all of them, or only the longest (the others are its prefixes)."""
    return sorted(lengths) if separate else [max(lengths)]


def measure_group(live: LiveStack, cells: list[Cell], prompts: list[TokenizedPrompt], lengths: list[int],
                  runs: int, seed: int, bar=None, separate_lengths: bool = False,
                  records: list[dict] | None = None) -> list[dict]:
    """Every cell x length x run x prompt, runs interleaved over the cells (order rotating),
    appended to `records` as they are measured (so a study that fails midway keeps them).

    Unless `separate_lengths`, one request of the longest length is made and the shorter
    lengths are measured as its prefixes (`prefix_record`).
    """
    records = [] if records is None else records
    for run in range(runs):
        for length in request_lengths(lengths, separate_lengths):
            order = cells[run % len(cells):] + cells[: run % len(cells)]
            for cell in order:
                if bar is not None:
                    bar.set_postfix_str(f"{cell.id} L{length} run {run + 1}", refresh=False)
                for i, p in enumerate(prompts):
                    sampled = cell.temperature is not None or cell.draft_temperature is not None
                    rec = live.request(p, length, cell.mode, max(cell.k, 1), cell.temperature, cell.draft_temperature,
                                       request_seed(seed, i, run) if sampled else None, adaptive_k=cell.adaptive)
                    rec.update(cell=cell.id, length=length, run=run)
                    records.append(rec)
                    if not separate_lengths:
                        records += [dict(prefix_record(rec, L), length=L) for L in lengths if L < length]
                    if bar is not None:
                        bar.update(1)
    return records


def cell_results(cell: Cell, records: list[dict], lengths: list[int]) -> dict:
    mine = [r for r in records if r["cell"] == cell.id]
    out = cell.to_json()
    out["by_length"] = {str(L): aggregate([r for r in mine if r["length"] == L], cell.mode, cell.k)
                        for L in lengths}
    out["all"] = aggregate(full_requests(mine), cell.mode, cell.k)
    return out


# ----------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------
QUICK = {"prompts": 1, "lengths": "64", "runs": 2, "ks": "1,4,8,16", "target_temps": "0,1.0", "draft_temps": "0,0.6"}
FULL = {"prompts": 2, "lengths": "128,256", "runs": 3, "ks": "1-16", "target_temps": "0,0.6,1.0",
        "draft_temps": "0,0.1,0.6,0.8"}


def resolve_args(a) -> None:
    preset = QUICK if a.quick else FULL
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def plan_cells(a, default: str, drafts: list[str]) -> dict[str, list[Cell]]:
    """Cells per draft group (each group measured in one stretch, target-only included)."""
    studies = set(a.studies.split(","))
    modes = [m for m in a.modes.split(",") if m]
    ks = parse_int_ranges(a.ks)
    cells: dict[str, dict[str, Cell]] = {}

    def add(draft, mode, k, study, t=None, dt=None, adaptive=False, again=False):
        c = Cell(draft, mode, k, t, dt, adaptive, again=again)
        group = cells.setdefault(draft, {})
        group.setdefault(c.id, c).studies.add(study)

    base_k = a.k
    for draft in [default] + [d for d in drafts if d != default]:
        if draft != default and "drafts" not in studies:
            continue
        add(draft, "target-only", base_k, "baseline")
    if a.control:  # the A/A control: the baseline measured a second time, interleaved like every cell
        add(default, "target-only", base_k, "control", again=True)
    if "ksweep" in studies:
        for mode in modes:
            for k in ks:
                add(default, mode, k, "ksweep")
            add(default, mode, base_k, "ksweep", adaptive=True)  # its own row: k chosen per round, <= --k
    if "drafts" in studies:
        for draft in drafts:
            for mode in modes:
                add(draft, mode, base_k, "drafts")
    if "temps" in studies:
        for t in parse_floats(a.target_temps):
            for dt in parse_floats(a.draft_temps):
                add(default, "pipelined", base_k, "temps", t, dt)
            if t > 0:  # fixed against adaptive k, the draft at its default (the target's sampling)
                add(default, "pipelined", base_k, "temps", t, None)
                add(default, "pipelined", base_k, "temps", t, None, adaptive=True)
    if "positions" in studies:
        for mode in modes:
            add(default, mode, a.position_k, "positions")
        if "drafts" in studies:
            for draft in drafts:
                add(draft, "sequential" if "sequential" in modes else modes[0], a.position_k, "positions")
    return {g: list(c.values()) for g, c in cells.items()}


def plan_study(a):
    """What a study's flags ask for: out, cfg, variants, the default draft, prompts, lengths and
    the cells per draft group (`run_study`, and `report_from_partial` for a study that stopped)."""
    resolve_args(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, variants = base_config(a, out)
    default = variant_of(cfg.draft, variants)
    if default.name not in variants:
        variants[default.name] = default
    drafts = [d for d in (a.drafts or ",".join(variants)).split(",") if d]
    unknown = [d for d in drafts if d not in variants]
    if unknown:
        raise SystemExit(f"unknown draft(s) {unknown}; known here: {sorted(variants)}")
    prompts = default_prompts(a.workloads, a.prompts, a.seed)
    lengths = parse_int_ranges(a.lengths)
    return out, cfg, variants, default, prompts, lengths, plan_cells(a, default.name, drafts)


def run_study(a) -> dict:
    from tqdm import tqdm

    out, cfg, variants, default, prompts, lengths, groups = plan_study(a)
    per_cell = len(prompts) * len(request_lengths(lengths, a.separate_lengths)) * a.runs  # requests
    total = sum(len(cs) for cs in groups.values()) * per_cell
    print(f"study: {sum(len(c) for c in groups.values())} cells in {len(groups)} draft group(s), "
          f"{len(prompts)} prompts, lengths {lengths}, {a.runs} runs: {total} requests", file=sys.stderr)
    t_start = time.time()
    records: list[dict] = []
    memory: dict[str, dict] = {}
    swaps: dict[str, float] = {}
    infos: dict[str, dict] = {}
    failed: dict[str, str] = {}
    bar = tqdm(total=total, desc="study", unit="req", disable=a.no_progress, file=sys.stderr)
    live = LiveStack(cfg, out / "logs", variants)
    try:
        live.start()
        for name, cells in list(groups.items()):
            try:
                swaps[name] = live.swap(variants[name])
            except Exception as e:  # noqa: BLE001 - a draft that cannot be loaded here is skipped
                failed[name] = f"{type(e).__name__}: {e}"[:3000]
                print(f"study: draft {name} could not be loaded, skipped ({failed[name][:300]})", file=sys.stderr)
                bar.update(len(cells) * per_cell)
                del groups[name]
                continue
            info = live.info()
            infos[name] = {"target": info.get("target", {}), "draft": info.get("draft", {})}
            live.warm_up(prompts[0], sorted({c.mode for c in cells}), a.k)
            measure_group(live, cells, prompts, lengths, a.runs, a.seed, bar, a.separate_lengths, records)
            memory[name] = live.draft_memory()
    except BaseException:
        if records:  # keep what was measured (the full study takes hours)
            path = report.write_partial(out, records)
            print(f"study: interrupted; {len(records)} requests saved in {path}", file=sys.stderr)
            report_complete_runs(a, groups, records, lengths, prompts, default.name, variants, out)
        raise
    finally:
        bar.close()
        live.stop()
    result = analyse(a, groups, records, lengths, prompts, default.name, variants, memory, swaps, infos)
    result["skipped_drafts"] = failed
    result["wall_s"] = time.time() - t_start
    report.write_outputs(out, result, records)
    print(f"study: wrote {out}/study.md, study.json and plots in {result['wall_s']:.0f}s", file=sys.stderr)
    return result


def complete_runs(groups: dict[str, list[Cell]], records: list[dict], requests_per_run: int) -> int:
    """How many runs, counted from the first, every cell of `groups` finished (all its requests)."""
    done: dict[tuple[str, int], int] = {}
    for r in full_requests(records):
        done[r["cell"], r["run"]] = done.get((r["cell"], r["run"]), 0) + 1
    cells = [c.id for cs in groups.values() for c in cs]
    n = 0
    while cells and all(done.get((c, n), 0) >= requests_per_run for c in cells):
        n += 1
    return n


def report_complete_runs(a, groups, records, lengths, prompts, default: str, variants, out: Path) -> dict | None:
    """study.md and study.json from the runs that every cell completed, when a study stopped
    before its last run (its other requests stay in study-partial.json only)."""
    measured = {r["cell"] for r in records}
    groups = {g: cs for g, cs in groups.items() if any(c.id in measured for c in cs)}  # drafts never reached
    per_run = len(prompts) * len(request_lengths(lengths, a.separate_lengths))
    runs = complete_runs(groups, records, per_run)
    if not runs:
        return None
    kept = [r for r in records if r["run"] < runs]
    asked, a.runs = a.runs, runs
    try:
        result = analyse(a, groups, kept, lengths, prompts, default, variants, {}, {}, {})
    finally:
        a.runs = asked
    result["stopped_early"] = {"runs_done": runs, "runs_asked": asked, "requests_left_out": len(full_requests(records))
                               - len(full_requests(kept))}
    report.write_outputs(out, result, kept)
    print(f"study: wrote {out}/study.md and study.json from the {runs} complete run(s) of {asked}", file=sys.stderr)
    return result


def report_from_partial(a) -> bool:
    """`specdec study --from-partial` (the flags of the study that stopped): the report of its
    complete runs, from the study-partial.json it left in --out."""
    out, _, variants, default, prompts, lengths, groups = plan_study(a)
    records = report.read_partial(out)
    if report_complete_runs(a, groups, records, lengths, prompts, default.name, variants, out) is None:
        print(f"study: no run of {out}/study-partial.json is complete for every cell", file=sys.stderr)
        return False
    return True


def analyse(a, groups, records, lengths, prompts, default, variants, memory, swaps, infos) -> dict:
    cells = {c.id: cell_results(c, records, lengths) for cs in groups.values() for c in cs}
    modes = [m for m in a.modes.split(",") if m]
    res: dict = {
        "command": "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["study"] else "specdec study",
        "settings": {"tiny": a.tiny, "quick": a.quick, "workloads": a.workloads, "prompts_per_workload": a.prompts,
                     "lengths": lengths, "separate_lengths": a.separate_lengths, "runs": a.runs,
                     "ks": parse_int_ranges(a.ks), "modes": modes, "k": a.k,
                     "position_k": a.position_k, "seed": a.seed, "studies": a.studies, "control": a.control,
                     "target_temps": parse_floats(a.target_temps), "draft_temps": parse_floats(a.draft_temps)},
        "prompts": [{"id": p.id, "workload": p.workload, "tokens": len(p.ids)} for p in prompts],
        "default_draft": default,
        "drafts": {n: {**variants[n].settings(), "note": variants[n].note} for n in groups},
        "services": infos,
        "cells": cells,
    }
    studies = set(a.studies.split(","))
    base = f"{default}/target-only"
    if "ksweep" in studies:
        res["ksweep"] = [{"mode": c["mode"], "k": c["k"], "adaptive": c["adaptive"], "cell": cid}
                         for cid, c in cells.items() if "ksweep" in c["studies"]]
        res["ideal"] = []
        for cid, c in cells.items():
            if c["adaptive"]:  # the bound is per fixed k
                continue
            if "ksweep" in c["studies"] or (c["draft"] == default and c["mode"] in SPECULATIVE
                                            and c["temperature"] is None and c["draft_temperature"] is None):
                seq = cells.get(f"{default}/sequential/k{c['k']}")
                d = seq["all"]["draft_ms_per_token"] if seq else None
                ib = ideal_bound(c["all"], c["mode"], c["k"], d)
                ib["cell"] = cid
                res["ideal"].append(ib)
        res["ideal"].sort(key=lambda x: (x["mode"], x["k"]))
    if "drafts" in studies:
        res["draft_comparison"] = []
        for name in groups:
            row = {"draft": name, **variants[name].settings(), "memory": memory.get(name, {}),
                   "swap_s": swaps.get(name, 0.0)}
            seq = cells.get(f"{name}/sequential/k{a.k}")
            row["draft_ms_per_token"] = seq["all"]["draft_ms_per_token"] if seq else None
            row["modes"] = {}
            for mode in modes:
                c = cells.get(f"{name}/{mode}/k{a.k}")
                if c:
                    if row["draft_ms_per_token"] is None:
                        row["draft_ms_per_token"] = c["all"]["draft_ms_per_token"]
                    row["modes"][mode] = {"cell": c["id"], "acceptance_rate": c["all"]["acceptance_rate"],
                                          "mean_accepted_tokens": c["all"]["mean_accepted_tokens"],
                                          "tok_s": {L: c["by_length"][L]["tok_s"] for L in c["by_length"]},
                                          "speedup": speedups(c, cells.get(f"{name}/target-only"))}
            res["draft_comparison"].append(row)
    if "temps" in studies:
        res["temperature_grid"] = [{"temperature": c["temperature"], "draft_temperature": c["draft_temperature"],
                                    "adaptive": c["adaptive"], "cell": cid} for cid, c in cells.items() if "temps" in c["studies"]]
    if "positions" in studies:
        pk = a.position_k
        res["positions"] = {"k": pk, "by_workload": {}, "by_draft": {}}
        for w in dict.fromkeys(p.workload for p in prompts):
            reqs = [r for r in full_requests(records) if r["workload"] == w and _cell_is(cells[r["cell"]], default, pk)]
            res["positions"]["by_workload"][w] = position_curve(reqs)
        for name in groups:
            reqs = [r for r in full_requests(records) if _cell_is(cells[r["cell"]], name, pk)]
            if reqs:
                res["positions"]["by_draft"][name] = position_curve(reqs)
    res["baseline_cell"] = base
    if f"{base}/again" in cells:
        res["control_cell"] = f"{base}/again"
    return res


def _cell_is(c: dict, draft: str, k: int) -> bool:
    return (c["draft"] == draft and c["k"] == k and c["mode"] in SPECULATIVE and not c["adaptive"]
            and c["temperature"] is None and c["draft_temperature"] is None)
