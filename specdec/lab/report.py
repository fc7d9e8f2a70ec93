"""The lab's reports: Markdown tables, plots and the JSON files of `specdec study`, `bench` and
`tune` (formats unchanged from before the lab was split out).

- study: `write_outputs` writes study.md, study.json (the settings, every cell's statistics and
  every request, rounds compacted to rows of `analysis.ROUND_FIELDS`) and the plots
  (ksweep.png, acceptance_by_position.png, round_time_split.png, ideal.png); `render` rewrites
  them from a study.json; `write_partial` keeps what an interrupted study measured;
- bench: `compare_markdown` (compare.md); tune: `tune_markdown` (tune.md).

matplotlib is imported inside the plotting functions only (the optional extra `lab`).
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from specdec.lab.analysis import EFFICIENCY_TARGET, ROUND_FIELDS, compact_rounds, expand_rounds, speedups
from specdec.modes import Mode


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------
def _fmt_ratio(s: dict) -> str:
    return f"{s['median']:.2f}× ({s['min']:.2f}-{s['max']:.2f})" if s.get("n") else ""


def _fmt_spread(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}, ±{s['spread_pct']:.0f}%)" if s.get("n") else ""


def short_model(model: str) -> str:
    """A model path cut to its last 36 characters when long (for table cells)."""
    return model if len(model) < 40 else "…" + model[-36:]


def fmt_gain(v) -> str:
    """A gain as '2.46×' ('n/a' when unknown)."""
    return f"{v:.2f}×" if v else "n/a"


def fmt_opt(v) -> str:
    """An optional number as '%g' ('' for None)."""
    return "" if v is None else f"{v:g}"


# ----------------------------------------------------------------------------------------------
# The study
# ----------------------------------------------------------------------------------------------
def study_markdown(res: dict) -> str:
    cells = res["cells"]
    st = res["settings"]
    lengths = [str(L) for L in st["lengths"]]
    L = ["# specdec study", "", f"Command: `{res['command']}`", "",
         f"Prompts: {len(res['prompts'])} ({st['workloads']}, {st['prompts_per_workload']} per workload); "
         f"output lengths {', '.join(lengths)} tokens (EOS ignored"
         + ("" if st.get("separate_lengths", True) or len(lengths) < 2 else
            f"; one request of {lengths[-1]} tokens per prompt, the shorter lengths measured as its prefixes: "
            "time to the L-th token") + f"); {st['runs']} runs per cell, interleaved; "
         f"default draft: {res['default_draft']}. tok/s cells: median (min-max, ±spread %) over runs, "
         f"tokens / wall time seen by the client, prefill included." + (" Tiny random models: the numbers "
                                                                        "mean nothing." if st["tiny"] else ""), ""]
    for name, err in res.get("skipped_drafts", {}).items():
        L += [f"Draft {name} could not be loaded here and was skipped: `{err.splitlines()[0][:200]}`", ""]
    if res.get("stopped_early"):
        e = res["stopped_early"]
        L += [f"Stopped early: these tables hold the {e['runs_done']} run(s) that every cell completed, of "
              f"{e['runs_asked']} asked; the {e['requests_left_out']} request(s) of the unfinished run are in "
              "study-partial.json only.", ""]
    fallback = [cid for cid, c in cells.items() if c["all"]["draft_fallback_rounds"]]
    if fallback:
        L += [f"Warning: the draft was unavailable for some rounds of {', '.join(fallback)} (served target-only).", ""]
    base = cells.get(res["baseline_cell"])
    again = cells.get(res.get("control_cell", ""))
    if base and again:
        sp = speedups(again, base)
        L += ["## Noise: target-only measured twice (A/A control)", "",
              "The same setting in two interleaved cells; a speedup in the tables below is told apart from "
              "noise only where it lies outside this ratio's min-max.", "",
              "| cell | " + " | ".join(f"tok/s L={x}" for x in lengths) + " | "
              + " | ".join(f"ratio L={x}" for x in lengths) + " |", "|---|" + "---|" * (2 * len(lengths)),
              "| target-only | " + " | ".join(_fmt_spread(base["by_length"][x]["tok_s"]) for x in lengths) + " | "
              + " | ".join(["1.00×"] * len(lengths)) + " |",
              "| target-only again | " + " | ".join(_fmt_spread(again["by_length"][x]["tok_s"]) for x in lengths)
              + " | " + " | ".join(_fmt_ratio(sp.get(x, {})) for x in lengths) + " |", ""]
    if "ksweep" in res:
        L += ["## k sweep (greedy)", "",
              "Speedup: median (min-max) of the per-run ratios to target-only in the same run.", "",
              "| mode | k | " + " | ".join(f"tok/s L={x}" for x in lengths) + " | "
              + " | ".join(f"speedup L={x}" for x in lengths) + " | acceptance | mean accepted tokens/round |",
              "|---|---|" + "---|" * (2 * len(lengths)) + "---|---|"]
        if base:
            L.append("| target-only | | " + " | ".join(_fmt_spread(base["by_length"][x]["tok_s"]) for x in lengths)
                     + " | " + " | ".join(["1.00×"] * len(lengths)) + " | | |")
        for row in sorted(res["ksweep"], key=lambda r: (r["mode"], r.get("adaptive", False), r["k"])):
            c = cells[row["cell"]]
            sp = speedups(c, base)
            k = f"adaptive (≤ {c['k']})" if c.get("adaptive") else c["k"]
            L.append(f"| {c['mode']} | {k} | " + " | ".join(_fmt_spread(c["by_length"][x]["tok_s"])
                                                                 for x in lengths)
                     + " | " + " | ".join(_fmt_ratio(sp.get(x, {})) for x in lengths)
                     + f" | {c['all']['acceptance_rate']:.3f} | {c['all']['mean_accepted_tokens']:.2f} |")
        L.append("")
    if res.get("ideal"):
        L += ["## Ideal bound and pipeline efficiency", "",
              "d = draft ms per token (from the sequential cell at the same k), T(k) = mean verify ms of rounds "
              "with k drafts, E(k) = 1 + Σ P(first i accepted). Ideal: sequential E/(k·d + T), pipelined "
              "E/max(T, (k+1)·d). Measured: decode tok/s (after the first token).", "",
              "| mode | k | d ms | T(k) ms | E(k) | ideal tok/s | measured tok/s | efficiency | biggest loss "
              "(efficiency < 0.9) |", "|---|---|---|---|---|---|---|---|---|"]
        for ib in res["ideal"]:
            L.append(f"| {ib['mode']} | {ib['k']} | {ib['draft_ms_per_token']:.2f} | {ib['verify_ms']:.2f} | "
                     f"{ib['expected_tokens']:.2f} | {ib['ideal_tok_s']:.1f} | {ib['measured_tok_s']:.1f} | "
                     f"{ib['efficiency']:.2f} | {ib['biggest_loss']} |")
        L.append("")
    splits = time_split_rows(res)
    if splits:
        L += [f"## Time per round (ms), k={st['k']}, default draft", "",
              "| mode | draft (critical path) | verify | RPC | idle | decode ms/round | misses | hits | "
              "wasted draft tokens/round |", "|---|---|---|---|---|---|---|---|---|"]
        for mode, s in splits.items():
            L.append(f"| {mode} | {s['draft_ms']:.2f} | {s['verify_ms']:.2f} | {s['rpc_ms']:.2f} | "
                     f"{s['idle_ms']:.2f} | {s['decode_ms_per_round']:.2f} | {s['misses']} | {s['hits']} | "
                     f"{s['wasted_draft_tokens_per_round']:.2f} |")
        L.append("")
    if "draft_comparison" in res:
        L += [f"## Drafts (k={st['k']}, greedy)", "",
              "| draft | engine | model | dtype | draft RSS MiB | peak RSS MiB | draft ms/token | mode | acceptance | "
              + " | ".join(f"tok/s L={x}" for x in lengths) + " | " + " | ".join(f"speedup L={x}" for x in lengths)
              + " |", "|---|---|---|---|---|---|---|---|---|" + "---|" * (2 * len(lengths))]
        for row in res["draft_comparison"]:
            mem = row["memory"]
            dms = row["draft_ms_per_token"]
            for mode, m in row["modes"].items():
                L.append(f"| {row['draft']} | {row['engine']} | {short_model(row['model'])} | {row['dtype']} | "
                         f"{mem.get('rss_bytes', 0) / 2**20:.0f} | {mem.get('peak_rss_bytes', 0) / 2**20:.0f} | "
                         f"{'' if dms is None else f'{dms:.2f}'} | {mode} | {m['acceptance_rate']:.3f} | "
                         + " | ".join(_fmt_spread(m["tok_s"][x]) for x in lengths)
                         + " | " + " | ".join(_fmt_ratio(m["speedup"].get(x, {})) for x in lengths) + " |")
        L.append("")
    if "temperature_grid" in res:
        L += [f"## Target × draft temperature (pipelined, k={st['k']}, default draft)", "",
              "Speedup: against greedy target-only in the same run (a sampled target step costs about "
              "the same as a greedy one).", "",
              "| target T | draft T | acceptance | mean accepted tokens | " +
              " | ".join(f"tok/s L={x}" for x in lengths) + " | " + " | ".join(f"speedup L={x}" for x in lengths)
              + " |", "|---|---|---|---|" + "---|" * (2 * len(lengths))]
        for row in res["temperature_grid"]:
            c = cells[row["cell"]]
            sp = speedups(c, base)
            dt = "= target" if c["draft_temperature"] is None else f"{c['draft_temperature']:g}"
            dt += f", adaptive k (≤ {c['k']})" if c.get("adaptive") else ""
            L.append(f"| {c['temperature']:g} | {dt} | {c['all']['acceptance_rate']:.3f} | "
                     f"{c['all']['mean_accepted_tokens']:.2f} | "
                     + " | ".join(_fmt_spread(c["by_length"][x]["tok_s"]) for x in lengths) + " | "
                     + " | ".join(_fmt_ratio(sp.get(x, {})) for x in lengths) + " |")
        L.append("")
    if "positions" in res:
        pk = res["positions"]["k"]
        L += [f"## Acceptance by draft position (k={pk}, greedy)", "",
              "P(draft i accepted | drafted at i) = accepted_by_position / drafted_by_position, summed over requests.",
              "", "| curve | " + " | ".join(str(i + 1) for i in range(pk)) + " |", "|---|" + "---|" * pk]
        for kind in ("by_workload", "by_draft"):
            for name, c in res["positions"][kind].items():
                vals = c["acceptance_by_position"] + [None] * (pk - len(c["acceptance_by_position"]))
                L.append(f"| {kind[3:]}: {name} | " + " | ".join("" if v is None else f"{v:.2f}" for v in vals[:pk])
                         + " |")
        L.append("")
    return "\n".join(L) + "\n"


def time_split_rows(res: dict) -> dict:
    cells, st = res["cells"], res["settings"]
    out = {}
    d = res["default_draft"]
    for mode in [Mode.TARGET_ONLY.label] + st["modes"]:
        cid = f"{d}/{mode}" if mode == Mode.TARGET_ONLY.label else f"{d}/{mode}/k{st['k']}"
        if cid in cells and cells[cid]["all"]["time_split"].get("rounds"):
            out[mode] = cells[cid]["all"]["time_split"]
    return out


def _save_plot(fig, axes, path: Path) -> str:
    """Legend and grid on every axis, then save and close; returns the file name."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_plots(out: Path, res: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    made = []
    cells, st = res["cells"], res["settings"]
    lengths = [str(x) for x in st["lengths"]]
    if res.get("ksweep"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        base = cells.get(res["baseline_cell"])
        styles = ["-", "--", "-.", ":"]
        for n, mode in enumerate(st["modes"]):
            rows = sorted((cells[r["cell"]] for r in res["ksweep"] if r["mode"] == mode and not r.get("adaptive")),
                          key=lambda c: c["k"])
            auto = [cells[r["cell"]] for r in res["ksweep"] if r["mode"] == mode and r.get("adaptive")]
            ks = [c["k"] for c in rows]
            for j, L in enumerate(lengths):
                for c in auto:  # adaptive k: one star at its cap
                    axes[0].plot([c["k"]], [c["by_length"][L]["tok_s"]["median"]], marker="*", markersize=12,
                                 color=f"C{n}", linestyle="none", label=f"{mode} adaptive k (≤ {c['k']}) L={L}")
                med = [c["by_length"][L]["tok_s"]["median"] for c in rows]
                lo = [m - c["by_length"][L]["tok_s"]["min"] for m, c in zip(med, rows)]
                hi = [c["by_length"][L]["tok_s"]["max"] - m for m, c in zip(med, rows)]
                axes[0].errorbar(ks, med, yerr=[lo, hi], marker="o", capsize=3, color=f"C{n}",
                                 linestyle=styles[j % 4], label=f"{mode} L={L}")
            axes[1].plot(ks, [c["all"]["acceptance_rate"] for c in rows], marker="o", color=f"C{n}",
                         label=f"{mode} acceptance rate")
            axes[1].plot(ks, [c["all"]["mean_accepted_tokens"] / max(1, c["k"] + 1) for c in rows], marker="x",
                         linestyle="--", color=f"C{n}", label=f"{mode} mean accepted tokens / (k+1)")
        if base:
            for j, L in enumerate(lengths):
                axes[0].axhline(base["by_length"][L]["tok_s"]["median"], color="grey", linestyle=styles[j % 4],
                                label=f"target-only L={L}")
        axes[0].set(xlabel="k", ylabel="tok/s", title="throughput vs k (median, min-max)")
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[1].set(xlabel="k", ylabel="rate", title="acceptance vs k", ylim=(0, 1.05))
        made.append(_save_plot(fig, axes, out / "ksweep.png"))
    if res.get("positions"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, kind in zip(axes, ("by_workload", "by_draft")):
            for name, c in res["positions"][kind].items():
                vals = c["acceptance_by_position"]
                ax.plot(range(1, len(vals) + 1), vals, marker="o", label=name)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set(xlabel="draft position", ylabel="P(accepted | drafted)", ylim=(0, 1.05),
                   title=f"acceptance by position, k={res['positions']['k']}, {kind[3:]}")
        made.append(_save_plot(fig, axes, out / "acceptance_by_position.png"))
    splits = time_split_rows(res)
    if splits:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = list(splits)
        bottom = [0.0] * len(names)
        for part, color in (("draft_ms", "tab:orange"), ("verify_ms", "tab:blue"), ("rpc_ms", "tab:green"),
                            ("idle_ms", "tab:grey")):
            vals = [max(0.0, splits[n][part]) for n in names]
            ax.bar(names, vals, bottom=bottom, label=part.replace("_ms", ""), color=color)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(ylabel="ms per round", title=f"time per round, k={st['k']} ({res['default_draft']})")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "round_time_split.png", dpi=110)
        plt.close(fig)
        made.append("round_time_split.png")
    if res.get("ideal"):
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for n, mode in enumerate(sorted({ib["mode"] for ib in res["ideal"]})):
            rows = [ib for ib in res["ideal"] if ib["mode"] == mode]
            ks = [ib["k"] for ib in rows]
            axes[0].plot(ks, [ib["ideal_tok_s"] for ib in rows], linestyle="--", marker="x", color=f"C{n}",
                         label=f"{mode} ideal")
            axes[0].plot(ks, [ib["measured_tok_s"] for ib in rows], marker="o", color=f"C{n}", label=f"{mode} measured")
            axes[1].plot(ks, [ib["efficiency"] for ib in rows], marker="o", color=f"C{n}", label=mode)
        axes[1].axhline(EFFICIENCY_TARGET, color="grey", linestyle=":")
        axes[0].set(xlabel="k", ylabel="decode tok/s", title="ideal vs measured")
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[1].set(xlabel="k", ylabel="measured / ideal", title="efficiency")
        made.append(_save_plot(fig, axes, out / "ideal.png"))
    return made


def render(out: Path) -> dict:
    """Rewrite study.md and the plots of `out` from its study.json (no new measurements)."""
    doc = json.loads((Path(out) / "study.json").read_text())
    fields = doc.pop("round_fields", ROUND_FIELDS)
    if "pipeline_hit" not in fields:
        print(f"{out}/study.json predates the rounds' pipeline_hit: every pipelined round counts as a miss "
              "in the time split", file=sys.stderr)
    records = _expand_requests(doc.pop("requests"), fields)
    doc.pop("plots", None)
    write_outputs(Path(out), doc, records)
    return doc


def write_outputs(out: Path, res: dict, records: list[dict]) -> None:
    res["plots"] = write_plots(out, res)
    raw = dict(res, round_fields=list(ROUND_FIELDS), requests=_compact_requests(records))
    (out / "study.json").write_text(json.dumps(raw, indent=1, default=_json_default))
    md = study_markdown(res)
    (out / "study.md").write_text(md)
    print(md)


def write_partial(out: Path, records: list[dict]) -> Path:
    """The requests measured so far, when a study stops early (study-partial.json)."""
    path = out / "study-partial.json"
    path.write_text(json.dumps({"round_fields": list(ROUND_FIELDS), "requests": _compact_requests(records)},
                               default=_json_default))
    return path


def read_partial(out: Path) -> list[dict]:
    """The requests of study-partial.json, rounds expanded (as measured)."""
    doc = json.loads((Path(out) / "study-partial.json").read_text())
    return _expand_requests(doc["requests"], doc["round_fields"])


def _compact_requests(records: list[dict]) -> list[dict]:
    return [dict(r, rounds=compact_rounds(r["rounds"])) for r in records]


def _expand_requests(requests: list[dict], fields) -> list[dict]:
    return [dict(r, rounds=expand_rounds(r["rounds"], fields)) for r in requests]


def _json_default(o):
    if isinstance(o, set):
        return sorted(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(type(o))


# ----------------------------------------------------------------------------------------------
# The bench and the tuner
# ----------------------------------------------------------------------------------------------
def compare_markdown(result: dict) -> str:
    lines = [f"Command: `{result['command']}`", ""]
    for length, res in result["by_length"].items():
        lines += [f"### {length} new tokens", "",
                  "| system | tok/s median | min | max | spread % | decode tok/s median (min-max) | acceptance | "
                  "TTFT ms (median) | RPC ms/round |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for s, row in res["systems"].items():
            t, e = row["tok_s"], row["extra"]
            acc = e.get("acceptance_rate")
            if acc is None and e.get("acceptance"):
                vals = [x for x in e["acceptance"] if x is not None]
                acc = sum(vals) / len(vals) if vals else None
            ours = "ttft_ms_median" in e
            d = row.get("decode_tok_s")
            decode = f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f})" if d else ""
            lines.append(f"| {s} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {t['spread_pct']:.0f} | "
                         f"{decode} | {'' if acc is None or (ours and s == 'target-only') else f'{acc:.3f}'} | "
                         + (f"{e['ttft_ms_median']:.0f} | {e['rpc_overhead_ms_per_round']:.2f} |" if ours else " | |"))
        lines += ["", "| ratio (per run, side by side) | median | min | max |", "|---|---|---|---|"]
        for name, r in res["ratios"].items():
            lines.append(f"| {name} | {r['median']:.2f}× | {r['min']:.2f}× | {r['max']:.2f}× |")
        lines.append("")
    return "\n".join(lines)


def tune_markdown(res: dict) -> str:
    s = res["settings"]
    L = ["# specdec tune", "", f"Command: `{res['command']}` ({res['elapsed_s']:.0f}s of a {s['budget_s']:g}s budget; "
         f"{len(res['measurements'])} measurements, {sum(1 for m in res['measurements'] if m.get('cached'))} from the "
         f"cache, {len(res['skipped_for_budget'])} skipped for the budget)", "",
         "| setting | value | default | why |", "|---|---|---|---|"]
    for r in res["recommendation"]:
        L.append(f"| {r['setting']} | {r['value']} | {r['default']} | {r['why']} |")
    g = res["gain_over_target_only"]
    L += ["", f"Gain over target-only (measured in this run, {s['max_tokens']} tokens, {s['workloads']}): "
              f"greedy {fmt_gain(g['greedy']['tuned'])} tuned vs {fmt_gain(g['greedy']['defaults'])} defaults; "
              f"sampled (T={s['temperature']:g}) {fmt_gain(g['sampled']['tuned'])} tuned vs "
              f"{fmt_gain(g['sampled']['defaults'])} defaults.", ""]
    for name, err in res.get("unavailable_drafts", {}).items():
        L += [f"Draft {name} could not be loaded here and was left out: `{err.splitlines()[0][:200]}`", ""]
    if res["skipped_for_budget"]:
        L += [f"Skipped for the budget ({len(res['skipped_for_budget'])}): "
              + "; ".join(res["skipped_for_budget"][:12]) + ("…" if len(res["skipped_for_budget"]) > 12 else ""), ""]
    if res["defaults_best"]:
        L.append("The defaults are best: no setting beat them by more than "
                 f"{s['min_gain_pct']:g}% here; {res['config']} repeats them.")
    else:
        L.append(f"Serve with: `specdec up --config {res['config']}`")
    L += ["", "| draft | mode | k | T | draft T | tok/s (median) | spread % | acceptance | tag | cached |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for m in res["measurements"]:
        L.append(f"| {m['draft'] or '-'} | {m['mode']} | {m['k'] or ''} | {fmt_opt(m['temperature'])} | "
                 f"{fmt_opt(m['draft_temperature'])} | {m['tok_s']:.1f} | {m['spread']['spread_pct']:.0f} | "
                 f"{m['acceptance_rate']:.2f} | {m['tag']} | {'yes' if m.get('cached') else ''} |")
    return "\n".join(L) + "\n"


def load_markdown(result: dict) -> str:
    """The concurrency sweep: one row per system and number of clients, the ratios, and memory."""
    s = result["settings"]
    lines = [f"Command: `{result['command']}`", "",
             f"{s['max_tokens']} new tokens per request (greedy, EOS ignored), {s['requests_per_client']} requests "
             f"per client, k = {s['k']}, {s['runs']} runs; tok/s = all tokens / wall time (median, min-max over "
             f"runs); TTFT and TPOT percentiles over all requests of all runs.", "",
             "| system | clients | tok/s | min | max | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for system, by_c in result["table"].items():
        for c, row in by_c.items():
            t = row["tok_s"]
            if t is None:
                lines.append(f"| {system} | {c} | failed: {'; '.join(row['errors'])[:120]} | | | | | | |")
                continue
            lat = "| | | | |" if not row["requests"] else (
                f"| {row['ttft_p50_ms']:.0f} | {row['ttft_p99_ms']:.0f} | {row['tpot_p50_ms']:.1f} | "
                f"{row['tpot_p99_ms']:.1f} |")
            lines.append(f"| {system} | {c} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} {lat}")
    lines += ["", "| ratio (per run, side by side) | median | min | max |", "|---|---|---|---|"]
    for name, r in result["ratios"].items():
        lines.append(f"| {name} | {r['median']:.2f}× | {r['min']:.2f}× | {r['max']:.2f}× |")
    mem = result.get("memory", {})
    if mem:
        lines += ["", "| engine | service | RSS at start MiB | RSS after the sweep MiB | requests served | "
                      "KV pool tokens |", "|---|---|---|---|---|---|"]
        for engine, m in mem.items():
            for svc in ("target", "draft", "orchestrator"):
                lines.append(f"| {engine} | {svc} | {m['start'][svc] / 2**20:.0f} | {m['end'][svc] / 2**20:.0f} | "
                             f"{m['requests']} | {m['pool'].get(svc, '')} |")
    return "\n".join(lines) + "\n"


def load_plot(out: Path, result: dict) -> str:
    """Aggregate tok/s against the number of clients, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, by_c in result["table"].items():
        pts = [(int(c), row["tok_s"]["median"]) for c, row in by_c.items() if row["tok_s"]]
        if pts:
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=system, linestyle="--" if "/" not in system else "-")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tok/s")
    ax.set_title(f"Aggregate throughput, {result['settings']['max_tokens']} new tokens per request")
    return _save_plot(fig, [ax], out / "concurrency.png")
