"""`specdec bench`, `specdec study` and `specdec tune` end to end on tiny random models through the
real services (slow: each starts three service processes; the study and tune swap the draft),
plus the study's report (Markdown, JSON, plots) on hand-made measurements (fast, no services)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import build_parser, main
from specdec.config import SpecdecConfig
from specdec.lab import live, report, study
from specdec.lab.analysis import ROUND_FIELDS, spread
from specdec.lab.workloads import TokenizedPrompt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("ksweep.png", "acceptance_by_position.png", "round_time_split.png", "ideal.png")


def _png(path: Path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == PNG_MAGIC


def test_the_lab_imports_without_its_optional_extra():
    """matplotlib and tqdm (the extra `lab`) are imported only where a plot is drawn or a bar shown."""
    code = ("import sys; sys.modules.update(matplotlib=None, tqdm=None)\n"
            "import specdec.cli, specdec.lab.bench, specdec.lab.study, specdec.lab.tune, specdec.lab.report\n"
            "specdec.cli.build_parser().parse_args(['study', '--quick'])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr


# -- the report, on hand-made measurements -------------------------------------------------------
def _fake_request(cell: study.Cell, prompt: TokenizedPrompt, length: int, run: int) -> dict:
    rounds, produced = [], 1
    while produced < length:
        k = 0 if cell.mode == "target-only" else min(cell.k, length - produced - 1)
        acc = k // 2
        rounds.append({"k": k, "accepted": acc, "draft_ms": 2.0 * k, "verify_ms": 10.0 + k,
                       "overlap_ms": 1.0 if cell.mode == "pipelined" else 0.0, "wasted_draft_tokens": 0,
                       "rpc_ms": 0.5, "round_ms": 12.0 + 3 * k, "draft_available": True})
        produced += acc + 1
    acc_pos = [sum(1 for r in rounds if r["accepted"] > i) for i in range(cell.k if cell.mode != "target-only" else 0)]
    dr_pos = [sum(1 for r in rounds if r["k"] > i) for i in range(len(acc_pos))]
    total = 5.0 + sum(r["round_ms"] for r in rounds)
    stats = {"prompt_tokens": 10, "completion_tokens": produced, "ttft_ms": 5.0, "total_ms": total,
             "rounds": len(rounds), "draft_tokens": sum(r["k"] for r in rounds),
             "accepted_tokens": sum(r["accepted"] for r in rounds), "accepted_by_position": acc_pos,
             "drafted_by_position": dr_pos, "wasted_draft_tokens": 0, "draft_fallback_rounds": 0,
             "rpc_overhead_ms_per_round": 0.5, "seed": 0, "finish_reason": "length"}
    return {"prompt": prompt.id, "workload": prompt.workload, "tokens": produced,
            "seconds": total / 1e3 * (1 + 0.1 * run), "stats": stats, "rounds": rounds, "cell": cell.id,
            "length": length, "run": run}


def test_study_report_from_hand_made_measurements(tmp_path):
    a = build_parser().parse_args(["study", "--quick", "--ks", "1,2,4", "--k", "2", "--position-k", "4",
                                   "--lengths", "16,32", "--target-temps", "0,1", "--draft-temps", "0.6"])
    study.resolve_args(a)
    variants = live.draft_variants("/models/target", "/models/draft")
    groups = study.plan_cells(a, "tiny-draft", ["tiny-draft", "ngram"])
    assert set(groups) == {"tiny-draft", "ngram"}
    ids = {c.id for c in groups["tiny-draft"]}
    assert {"tiny-draft/target-only", "tiny-draft/pipelined/k1", "tiny-draft/sequential/k4",
            "tiny-draft/pipelined/k2/T1/dT0.6", "tiny-draft/pipelined/k4", "tiny-draft/pipelined/k2/adaptive",
            "tiny-draft/sequential/k2/adaptive", "tiny-draft/pipelined/k2/T1/dT-",
            "tiny-draft/pipelined/k2/adaptive/T1/dT-"} <= ids
    assert "tiny-draft/pipelined/k2/adaptive/T0/dT-" not in ids  # greedy adaptive is the k sweep's row
    assert {c.id for c in groups["ngram"]} == {"ngram/target-only", "ngram/pipelined/k2", "ngram/sequential/k2",
                                               "ngram/sequential/k4"}
    prompts = [TokenizedPrompt("p0", "chat", [1, 2], "p0"), TokenizedPrompt("p1", "code", [3], "p1")]
    lengths = [16, 32]
    records = [_fake_request(c, p, L, run) for cs in groups.values() for c in cs for run in range(a.runs)
               for L in lengths for p in prompts]
    memory = {n: {"rss_bytes": 2**28, "peak_rss_bytes": 2**29, "weight_bytes": 1} for n in groups}
    res = study.analyse(a, groups, records, lengths, prompts, "tiny-draft", variants, memory,
                        {n: 0.0 for n in groups}, {})
    report.write_outputs(tmp_path, res, records)
    for name in PLOTS:
        assert _png(tmp_path / name), name
    doc = json.loads((tmp_path / "study.json").read_text())
    assert len(doc["requests"]) == len(records) and doc["round_fields"] == list(ROUND_FIELDS)
    cell = doc["cells"]["tiny-draft/sequential/k2"]
    assert cell["all"]["acceptance_rate"] == pytest.approx(0.5)
    assert cell["by_length"]["16"]["tok_s"]["n"] == a.runs
    assert {(r["mode"], r["k"], r["adaptive"]) for r in doc["ksweep"]} == {
        (m, k, False) for m in ("pipelined", "sequential") for k in (1, 2, 4)} | {
        (m, 2, True) for m in ("pipelined", "sequential")}
    assert not any("adaptive" in ib["cell"] for ib in doc["ideal"])  # the bound is per fixed k
    assert set(doc["positions"]["by_workload"]) == {"chat", "code"}
    assert len(doc["positions"]["by_workload"]["chat"]["acceptance_by_position"]) == 4
    assert [r["draft"] for r in doc["draft_comparison"]] == ["tiny-draft", "ngram"]
    seq2 = [ib for ib in doc["ideal"] if ib["mode"] == "sequential" and ib["k"] == 2][0]
    assert seq2["expected_tokens"] == pytest.approx(2.0)  # one of two drafts accepted every round
    md = (tmp_path / "study.md").read_text()
    for section in ("## k sweep", "## Ideal bound", "## Time per round", "## Drafts", "## Target × draft",
                    "## Acceptance by draft position"):
        assert section in md
    assert "| pipelined | adaptive (≤ 2) |" in md and "| 1 | = target, adaptive k (≤ 2) |" in md


def test_the_a_a_control_measures_target_only_twice_and_reports_their_ratio(tmp_path):
    """--control adds a second target-only cell (interleaved like the others); the report gives its
    per-run ratio to the first, the noise any speedup of the study must stand out of."""
    a = build_parser().parse_args(["study", "--quick", "--studies", "temps", "--k", "2", "--lengths", "16",
                                   "--target-temps", "1", "--draft-temps", "1", "--runs", "3", "--control"])
    study.resolve_args(a)
    groups = study.plan_cells(a, "tiny-draft", ["tiny-draft"])
    ids = [c.id for c in groups["tiny-draft"]]
    assert "tiny-draft/target-only" in ids and "tiny-draft/target-only/again" in ids
    prompts = [TokenizedPrompt("p0", "chat", [1, 2], "p0")]
    records = [_fake_request(c, p, 16, run) for c in groups["tiny-draft"] for run in range(3) for p in prompts]
    for r in records:  # the second copy ran 25% slower in run 1 only
        if r["cell"].endswith("/again") and r["run"] == 1:
            r["seconds"] *= 1.25
    res = study.analyse(a, groups, records, [16], prompts, "tiny-draft",
                        live.draft_variants("/models/target", "/models/draft"), {}, {}, {})
    assert res["control_cell"] == "tiny-draft/target-only/again"
    md = report.study_markdown(res)
    assert "## Noise: target-only measured twice (A/A control)" in md
    assert "| target-only again | " in md and "| 1.00× (0.80-1.00) |" in md
    plain = build_parser().parse_args(["study", "--quick", "--studies", "temps"])
    study.resolve_args(plain)
    assert not any(c.again for cs in study.plan_cells(plain, "tiny-draft", ["tiny-draft"]).values() for c in cs)


def test_a_study_stopped_in_its_last_run_reports_the_runs_every_cell_completed(tmp_path):
    a = build_parser().parse_args(["study", "--quick", "--studies", "ksweep", "--ks", "1,2", "--k", "2",
                                   "--lengths", "16", "--runs", "3"])
    study.resolve_args(a)
    variants = live.draft_variants("/models/target", "/models/draft")
    groups = study.plan_cells(a, "tiny-draft", ["tiny-draft"])
    cells = groups["tiny-draft"]
    prompts = [TokenizedPrompt("p0", "chat", [1, 2], "p0"), TokenizedPrompt("p1", "code", [3], "p1")]
    # runs 0 and 1 complete; run 2 stopped after the first cell and one prompt of the second
    records = [_fake_request(c, p, 16, run) for run in range(2) for c in cells for p in prompts]
    records += [_fake_request(cells[0], p, 16, 2) for p in prompts] + [_fake_request(cells[1], prompts[0], 16, 2)]
    assert study.complete_runs(groups, records, len(prompts)) == 2
    assert study.complete_runs(groups, records[:-4], len(prompts)) == 1  # run 1's last request missing
    assert study.complete_runs(groups, [], len(prompts)) == 0
    report.write_partial(tmp_path, records)
    res = study.report_complete_runs(a, groups, report.read_partial(tmp_path), [16], prompts, "tiny-draft",
                                     variants, tmp_path)
    assert res["stopped_early"] == {"runs_done": 2, "runs_asked": 3, "requests_left_out": 3}
    doc = json.loads((tmp_path / "study.json").read_text())
    assert {r["run"] for r in doc["requests"]} == {0, 1} and doc["settings"]["runs"] == 2
    assert doc["cells"]["tiny-draft/pipelined/k2"]["by_length"]["16"]["tok_s"]["n"] == 2
    assert "Stopped early: these tables hold the 2 run(s) that every cell completed, of 3 asked" in (
        tmp_path / "study.md").read_text()
    assert a.runs == 3  # the caller's flags are left as they were


# -- end to end, real services on tiny models ----------------------------------------------------
@pytest.mark.slow
def test_study_end_to_end_tiny(tmp_path, monkeypatch):
    real_variants = live.draft_variants

    def with_a_broken_draft(*args, **kw):  # a draft whose model is missing: skipped, the study goes on
        v = real_variants(*args, **kw)
        v["broken"] = live.DraftVariant("broken", "torch", str(tmp_path / "no-such-model"))
        return v

    monkeypatch.setattr(live, "draft_variants", with_a_broken_draft)
    out = tmp_path / "study"
    rc = main(["study", "--tiny", "--quick", "--out", str(out), "--workloads", "code", "--prompts", "1",
               "--lengths", "5,8", "--runs", "2", "--ks", "1,2", "--k", "2", "--position-k", "2",
               "--drafts", "tiny-draft,torch-fp32,broken,ngram", "--target-temps", "0,1.0", "--draft-temps", "0.6",
               "--no-progress"])
    assert rc == 0
    for name in PLOTS:
        assert _png(out / name), name
    doc = json.loads((out / "study.json").read_text())
    md = (out / "study.md").read_text()
    assert "## k sweep" in md and "## Drafts" in md and "## Ideal bound" in md
    # every request generated exactly the asked length (8; 5 is measured as its prefix); the runs are all there
    full = [r for r in doc["requests"] if "prefix_of" not in r]
    prefixes = [r for r in doc["requests"] if "prefix_of" in r]
    assert full and all(r["tokens"] == 8 and r["length"] == 8 for r in full)
    assert len(prefixes) == len(full) and all(r["tokens"] == 5 and r["length"] == 5 for r in prefixes)
    assert all(p["seconds"] <= f["seconds"] for p, f in zip(prefixes, full))
    for cid, c in doc["cells"].items():
        for length in ("5", "8"):
            agg = c["by_length"][length]
            assert agg["tok_s"]["n"] == 2 and agg["tok_s"]["median"] > 0, cid
        assert c["all"]["requests"] == c["by_length"]["8"]["requests"]  # prefixes are not counted twice
        assert 0.0 <= c["all"]["acceptance_rate"] <= 1.0
        assert all(a <= d for a, d in zip(c["all"]["accepted_by_position"], c["all"]["drafted_by_position"]))
        assert c["all"]["draft_fallback_rounds"] == 0, cid  # the draft was attached in every measured request
    # the draft really was swapped: the orchestrator reported each draft engine in its group
    assert {n: i["draft"]["engine"] for n, i in doc["services"].items()} == {
        "tiny-draft": "torch", "torch-fp32": "torch", "ngram": "ngram"}
    assert doc["services"]["torch-fp32"]["draft"]["model"].endswith("tiny-models/target")
    assert list(doc["skipped_drafts"]) == ["broken"] and "could not be loaded" in md
    rows = {r["draft"]: r for r in doc["draft_comparison"]}
    assert set(rows) == {"tiny-draft", "torch-fp32", "ngram"}
    assert all(r["memory"]["rss_bytes"] > 10 * 2**20 for r in rows.values())
    assert rows["torch-fp32"]["memory"]["weight_bytes"] > 0 and rows["ngram"]["memory"]["weight_bytes"] == 0
    # an fp32 copy of the target drafts exactly what the greedy target picks
    assert rows["torch-fp32"]["modes"]["sequential"]["acceptance_rate"] > 0.9
    assert {(ib["mode"], ib["k"]) for ib in doc["ideal"]} >= {("pipelined", 1), ("sequential", 2)}
    assert all(ib["ideal_tok_s"] > 0 and ib["efficiency"] > 0 for ib in doc["ideal"])
    assert {(g["temperature"], g["draft_temperature"], g["adaptive"]) for g in doc["temperature_grid"]} == {
        (0.0, 0.6, False), (1.0, 0.6, False), (1.0, None, False), (1.0, None, True)}


@pytest.mark.slow
def test_bench_end_to_end_tiny(tmp_path):
    out = tmp_path / "bench"
    rc = main(["bench", "--tiny", "--out", str(out), "--workloads", "code,math", "--prompts", "1",
               "--max-tokens", "6,10", "--runs", "2", "--k", "2", "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "compare.json").read_text())
    ours_and_transformers = {"target-only", "sequential", "pipelined", "hf-generate", "hf-assisted"}
    # llama.cpp's example runs the shipped GGUF pair, not tiny models: left out of a --tiny bench
    assert {r["system"] for r in doc["runs"]} == ours_and_transformers
    for r in doc["runs"]:  # every system generated exactly the asked length for both prompts
        assert r["tokens"] == 2 * r["length"] and r["seconds"] > 0, r
    for length in ("6", "10"):
        res = doc["by_length"][length]
        assert set(res["systems"]) == ours_and_transformers
        for name, row in res["systems"].items():
            assert row["tok_s"]["n"] == 2 and row["tok_s"]["min"] <= row["tok_s"]["median"] <= row["tok_s"]["max"]
        assert 0.0 < res["systems"]["pipelined"]["extra"]["acceptance_rate"] <= 1.0
        for mode in ("target-only", "sequential", "pipelined"):  # the decode rate, prefill left out
            d = res["systems"][mode]["decode_tok_s"]
            assert d["n"] == 2 and d["median"] > res["systems"][mode]["tok_s"]["median"]
        ratio = res["ratios"]["pipelined / target-only"]
        runs = {r["system"]: r["tok_s"] for r in doc["runs"] if r["length"] == int(length) and r["run"] == 0}
        assert ratio["n"] == 2 and ratio["min"] <= runs["pipelined"] / runs["target-only"] <= ratio["max"]
    md = (out / "compare.md").read_text()
    assert "### 6 new tokens" in md and "### 10 new tokens" in md and "| pipelined / hf-assisted |" in md


def test_bench_compares_decode_rates_with_llamacpps_best_k_in_each_run():
    from specdec.lab.bench import SystemRun, summarize_length
    from specdec.lab.report import compare_markdown

    def run(system, i, tok_s, decode):  # 100 tokens; decode = tokens after the prefill per second
        return SystemRun(system, i, 100, 100 / tok_s, {"decode_tokens": 90, "decode_s": 90 / decode}, 128)

    systems = ["pipelined", "sequential", "llamacpp-spec-k4", "llamacpp-spec-k12"]
    runs = [run("pipelined", 0, 50, 60), run("llamacpp-spec-k4", 0, 40, 50), run("llamacpp-spec-k12", 0, 45, 75),
            run("pipelined", 1, 52, 66), run("llamacpp-spec-k4", 1, 40, 60), run("llamacpp-spec-k12", 1, 45, 55),
            run("sequential", 0, 48, 90), run("sequential", 1, 48, 30)]
    res = summarize_length(runs, systems)
    best = res["ratios"]["pipelined decode / llamacpp-spec best k decode"]
    # run 0: its best is k = 12 (75), run 1: k = 4 (60); not one k fixed over the runs
    assert best["n"] == 2 and best["min"] == pytest.approx(60 / 75) and best["max"] == pytest.approx(66 / 60)
    seq = res["ratios"]["sequential decode / llamacpp-spec best k decode"]  # the same, for sequential rounds
    assert seq["n"] == 2 and seq["min"] == pytest.approx(30 / 60) and seq["max"] == pytest.approx(90 / 75)
    assert res["ratios"]["pipelined / llamacpp-spec-k12"]["median"] == pytest.approx((50 / 45 + 52 / 45) / 2)
    assert res["systems"]["pipelined"]["decode_tok_s"]["median"] == pytest.approx(63)
    md = compare_markdown({"command": "specdec bench", "by_length": {"128": res}})
    assert "| pipelined decode / llamacpp-spec best k decode | 0.95× | 0.80× | 1.10× |" in md
    assert "| 63.0 (60.0-66.0) |" in md


@pytest.mark.slow
def test_concurrency_sweep_end_to_end_tiny(tmp_path):
    """`specdec bench --concurrency`: every mode at 1 and 2 clients through the real services;
    every request gets all its tokens, ratios are per run, the report has its table and plot."""
    out = tmp_path / "load"
    rc = main(["bench", "--tiny", "--concurrency", "1,2", "--max-tokens", "6", "--runs", "2", "--requests-per-client",
               "2", "--load-prompts", "3", "--load-peers", "", "--target-engines", "torch", "--k", "2",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    doc = json.loads((out / "load.json").read_text())
    systems = {f"{m}/torch" for m in ("target-only", "sequential", "pipelined")}
    assert {p["system"] for p in doc["points"]} == systems
    for p in doc["points"]:
        assert not p["error"] and len(p["requests"]) == 2 * p["clients"], p
        assert all(r["tokens"] == 6 and 0 < r["ttft_s"] <= r["total_s"] for r in p["requests"]), p
        assert p["tok_s"] == pytest.approx(p["tokens"] / p["seconds"])
    for s in systems:
        row = doc["table"][s]["2"]
        assert row["tok_s"]["n"] == 2 and row["requests"] == 8 and row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        r = doc["ratios"][f"{s} @2 / @1"]
        by_run = {(p["clients"], p["run"]): p["tok_s"] for p in doc["points"] if p["system"] == s}
        assert r["n"] == 2 and r["min"] <= by_run[(2, 0)] / by_run[(1, 0)] <= r["max"]
    assert doc["memory"]["torch"]["requests"] == 3 * (2 + 4) * 2 and doc["memory"]["torch"]["pool"]["target"] > 0
    assert "| pipelined/torch | 2 |" in (out / "load.md").read_text()
    assert _png(out / "concurrency.png")


@pytest.mark.slow
def test_tune_end_to_end_tiny_and_rerun_from_cache(tmp_path):
    out = tmp_path / "tune"
    args = ["tune", "--tiny", "--out", str(out), "--workloads", "code", "--prompts", "1", "--max-tokens", "8",
            "--runs", "2", "--ks", "1,2", "--draft-temps", "0,0.6", "--drafts", "tiny-draft,ngram",
            "--budget-s", "240", "--quiet"]
    assert main(args) == 0
    doc = json.loads((out / "tune.json").read_text())
    cfg = SpecdecConfig.load(out / "tuned.toml")
    rec = doc["recommended"]
    assert cfg.orchestrator.default_k == rec["default_k"]
    assert cfg.orchestrator.default_draft_temperature == pytest.approx(rec["default_draft_temperature"])
    assert cfg.draft.engine == rec["engine"] and cfg.draft.dtype == rec["dtype"]
    if rec["engine"] != "ngram":
        assert cfg.draft.model == rec["model"]
    assert Path(cfg.target.model).name == "target"  # the tiny target the measurements ran on
    assert [r["setting"] for r in doc["recommendation"]] == [
        "draft (engine / model / dtype)", "orchestrator.default_k", "orchestrator.default_draft_temperature"]
    assert doc["gain_over_target_only"]["greedy"]["tuned"] > 0
    assert doc["gain_over_target_only"]["greedy"]["defaults"] > 0
    assert any(m["mode"] == "target-only" for m in doc["measurements"])
    assert {m["draft"] for m in doc["measurements"] if m["draft"]} == {"tiny-draft", "ngram"}
    md = (out / "tune.md").read_text()
    assert "| setting | value | default | why |" in md and "Gain over target-only" in md
    assert ("The defaults are best" in md) == doc["defaults_best"]
    cache = json.loads((out / "tune-cache.json").read_text())
    # one entry per setting measured (the log also lists a setting looked up again in the same run,
    # from the cache: which ones are depends on what the search found)
    settings = {(m["draft"], m["mode"], m["k"], m["temperature"], m["draft_temperature"], m["tag"])
                for m in doc["measurements"]}
    assert len(cache["entries"]) == len(settings) == sum(not m["cached"] for m in doc["measurements"])
    # a rerun continues from the cache: nothing measured again, same recommendation
    assert main(args) == 0
    again = json.loads((out / "tune.json").read_text())
    assert again["measurements"] and all(m["cached"] for m in again["measurements"])
    assert again["recommended"] == rec
    assert again["elapsed_s"] < doc["elapsed_s"]


# -- the tuner's decisions, from a pre-filled cache (no services: budget 0 skips what is not cached) --------
def _tuner(tmp_path, *extra):
    from specdec.lab import tune

    # an explicit numeric default draft temperature (the shipped default, -1, means "the target's")
    # and the llama.cpp draft as the default draft, which the cases below are written around
    (tmp_path / "base.toml").write_text("[orchestrator]\ndefault_draft_temperature = 0.1\n"
                                        "[draft]\nengine = \"llamacpp\"\n")
    a = build_parser().parse_args(["tune", "--out", str(tmp_path), "--config", str(tmp_path / "base.toml"),
                                   "--workloads", "code", "--ks", "1,2,4,8",
                                   "--draft-temps", "0,0.6", "--drafts", "llamacpp,ngram", "--budget-s", "0",
                                   "--quiet", *extra])
    return a, tune.Tuner(a, tmp_path)


def _fill(tuner, greedy: dict, sampled: dict) -> None:
    """greedy: {(draft, k): tok/s}; sampled: {(draft, k, draft T): tok/s}; target-only runs at 20 tok/s."""
    def put(v, mode, k, t, dt, tok_s):
        tuner.cache.put(tuner.key(v, mode, k, t, dt, "search"), {
            "draft": v.name if mode != "target-only" else None, "mode": mode, "k": k, "temperature": t,
            "draft_temperature": dt, "tag": "search", "tok_s": tok_s, "tok_s_runs": [tok_s],
            "spread": spread([tok_s]), "acceptance_rate": 0.5, "mean_accepted_tokens": 2.0, "seconds": 1.0})

    put(tuner.default, "target-only", 0, None, None, 20.0)
    for (name, k), v in greedy.items():
        put(tuner.variants[name], "pipelined", k, None, None, v)
    for (name, k, dt), v in sampled.items():
        put(tuner.variants[name], "pipelined", k, tuner.a.temperature, dt, v)


@pytest.mark.parametrize("case", ["defaults-best", "better-k", "draft-within-noise", "better-draft-temperature"])
def test_tune_decisions_from_cache(tmp_path, case):
    a, tuner = _tuner(tmp_path)
    assert (tuner.default.name, tuner.default_k, tuner.default_dt) == ("llamacpp", 8, 0.1)
    greedy = {(d, k): 30.0 for d in ("llamacpp", "ngram") for k in (1, 2, 4)} | {("llamacpp", 8): 40.0,
                                                                                ("ngram", 8): 35.0}
    sampled = {("llamacpp", 8, dt): 30.0 - dt for dt in (0.0, 0.1, 0.6)}
    sampled[("llamacpp", 8, 0.1)] = 31.0
    if case == "better-k":
        greedy[("llamacpp", 4)] = 46.0  # +15%
        sampled |= {("llamacpp", 4, 0.1): 33.5, ("llamacpp", 4, 0.6): 34.0, ("llamacpp", 4, 0.0): 30.0}  # +1.5%
    elif case == "draft-within-noise":
        greedy[("ngram", 8)] = 41.0  # +2.5% < 3%
        sampled |= {("ngram", 8, dt): 30.0 for dt in (0.0, 0.1, 0.6)}
    elif case == "better-draft-temperature":
        sampled[("llamacpp", 8, 0.6)] = 36.0  # +16%
    _fill(tuner, greedy, sampled)
    res = tuner.run()
    assert tuner.live is None  # everything came from the cache: no service was started
    rows = {r["setting"]: r for r in res["recommendation"]}
    cfg = SpecdecConfig.load(tmp_path / "tuned.toml")
    md = (tmp_path / "tune.md").read_text()
    k, dt, engine = cfg.orchestrator.default_k, cfg.orchestrator.default_draft_temperature, cfg.draft.engine
    if case == "defaults-best":
        assert res["defaults_best"] and "The defaults are best" in md
        assert (k, dt, engine) == (8, 0.1, "llamacpp")
        assert "the default was the fastest" in rows["orchestrator.default_k"]["why"]
        assert res["gain_over_target_only"]["greedy"] == {"tuned": 2.0, "defaults": 2.0}
    elif case == "better-k":
        assert (k, dt, engine) == (4, 0.1, "llamacpp") and not res["defaults_best"]
        assert "+15.0%" in rows["orchestrator.default_k"]["why"]
        assert "default kept" in rows["orchestrator.default_draft_temperature"]["why"]
        assert res["gain_over_target_only"]["greedy"]["tuned"] == pytest.approx(46 / 20)
        assert "specdec up --config" in md
    elif case == "draft-within-noise":
        assert res["best_measured"]["draft"] == "ngram"
        assert (k, dt, engine) == (8, 0.1, "llamacpp") and res["defaults_best"]
        assert "within noise" in rows["draft (engine / model / dtype)"]["why"]
    else:
        assert (k, dt, engine) == (8, 0.6, "llamacpp") and not res["defaults_best"]
        assert rows["orchestrator.default_draft_temperature"]["changed"]
        assert res["gain_over_target_only"]["sampled"]["tuned"] == pytest.approx(36 / 20)
    assert res["skipped_for_budget"]  # the confirmation did not fit a zero budget


def test_a_study_that_fails_midway_keeps_what_it_measured():
    """measure_group appends to the caller's list as it goes: the requests measured before a
    failure reach study-partial.json (they were lost with the failing group before)."""
    class FailsOnTheFourth:
        calls = 0

        def request(self, p, length, mode, k, t, dt, seed, adaptive_k=False):
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("the orchestrator went away")
            return {"prompt": p.id, "tokens": length, "seconds": 1.0, "marks": [], "rounds": [], "stats": {}}

    cells = [study.Cell("d", "pipelined", 2), study.Cell("d", "pipelined", 2, adaptive=True)]
    prompts = [TokenizedPrompt("p0", "chat", [1], "p0"), TokenizedPrompt("p1", "code", [2], "p1")]
    kept: list[dict] = []
    with pytest.raises(RuntimeError):
        study.measure_group(FailsOnTheFourth(), cells, prompts, [8], runs=2, seed=0, separate_lengths=True,
                            records=kept)
    assert [(r["cell"], r["prompt"]) for r in kept] == [("d/pipelined/k2", "p0"), ("d/pipelined/k2", "p1"),
                                                         ("d/pipelined/k2/adaptive", "p0")]
