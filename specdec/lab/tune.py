"""`specdec tune`: find the best k, draft temperature and draft on this machine, within a time budget.

    specdec tune                                  # 900 s budget, writes tune-results/tuned.toml
    specdec up --config tune-results/tuned.toml   # serve with what it found
    specdec tune --budget-s 300 --drafts llamacpp,ngram --out tune-results   # rerun: continues

Every measurement goes through our real services (started by this command on free loopback
ports, `specdec up` layout) on the same prompts (`--workloads`, `--prompts` per workload, from
specdec.lab.workloads), `--max-tokens` tokens each (EOS ignored), `--runs` runs; its value
is the median over runs of tok/s (tokens / wall time, seen by the client). Each measurement is
stored in `<out>/tune-cache.json` under its setting and protocol, so a rerun (or a larger
budget) reuses it and only measures what is missing; `--fresh` ignores the cache.

Search (the budget, `--budget-s`, covers everything: starts, draft swaps, measurements; a
measurement whose estimated cost does not fit its phase is skipped):
1. baselines: target-only, the configured defaults greedy and sampled;
2. draft and k, greedy, pipelined (to 65% of the budget): every draft of `--drafts` (the
   configured one first) at the powers of two of `--ks`, then the k values between the
   neighbours of the best (draft, k);
3. draft temperature, sampled (target temperature `--temperature`), at the best draft and k
   (to 85% of the budget): each of `--draft-temps`;
4. confirmation (the rest): the best and the default settings re-measured side by side with
   target-only in the same draft group, interleaved. The gain of a setting is its tok/s over
   target-only of its own group, so a draft swap's drift cancels out.
A setting is recommended over its default only when it gains more than `--min-gain-pct` (3%);
otherwise the default stays and the table says so.

Outputs in `--out`: tuned.toml (`SpecdecConfig.to_toml()` of `--config` with
orchestrator.default_k, orchestrator.default_draft_temperature and draft.engine/model/dtype
set to what was found), tune.md / printed table (setting, value, default, why; the gain over
target-only), tune.json (every measurement and decision), tune-cache.json, logs/.
`--tiny` runs on tiny random models (see specdec/lab/study.py), for tests.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from specdec.devices import parse_int_ranges
from specdec.lab.analysis import aggregate
from specdec.lab.live import DraftVariant, LiveStack, base_config, parse_floats, request_seed, variant_of
from specdec.lab.report import fmt_gain, fmt_opt, short_model, tune_markdown
from specdec.lab.workloads import default_prompts
from specdec.modes import Mode

CACHE_VERSION = 1


class Cache:
    def __init__(self, path: Path, fresh: bool = False):
        self.path = path
        self.entries: dict[str, dict] = {}
        if path.exists() and not fresh:
            data = json.loads(path.read_text())
            if data.get("version") == CACHE_VERSION:
                self.entries = data.get("entries", {})

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, value: dict) -> None:
        self.entries[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": self.entries}, indent=1))
        os.replace(tmp, self.path)


class Tuner:
    def __init__(self, a, out: Path):
        self.a = a
        self.out = out
        self.t0 = time.monotonic()
        self.cfg, self.variants = base_config(a, out)
        self.default = variant_of(self.cfg.draft, self.variants)
        self.variants.setdefault(self.default.name, self.default)
        self.default_k = self.cfg.orchestrator.default_k
        # a negative default means "the target's own temperature": the sampled requests' one here
        dt = self.cfg.orchestrator.default_draft_temperature
        self.default_dt = dt if dt >= 0 else a.temperature
        self.prompts = default_prompts(a.workloads, a.prompts, a.seed)
        self.cache = Cache(out / "tune-cache.json", a.fresh)
        self.live: LiveStack | None = None
        self.log: list[dict] = []
        self.skipped: list[str] = []
        self.unavailable: dict[str, str] = {}  # drafts that failed to load
        self.rates: dict[str, float] = {}  # last tok/s per draft, for cost estimates
        self.swap_cost = 15.0

    # -- time ----------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def estimate(self, variant: DraftVariant, mode: str) -> float:
        """Seconds one measurement should take, from the last rate seen (0 when unknown)."""
        tokens = len(self.prompts) * self.a.max_tokens * self.a.runs
        rate = self.rates.get("target-only" if mode == "target-only" else variant.name) or \
            (min(self.rates.values()) if self.rates else 0.0)
        return tokens / rate if rate else 0.0

    # -- measurements --------------------------------------------------------------------------
    def key(self, variant: DraftVariant, mode: str, k: int, t: float | None, dt: float | None, tag: str) -> str:
        a = self.a
        return json.dumps({"target": self.cfg.target.model, "target_dtype": self.cfg.target.dtype,
                           "draft": variant.settings() if mode != "target-only" else None,
                           "mode": mode, "k": k if mode != "target-only" else 0, "temperature": t,
                           "draft_temperature": dt if mode != "target-only" else None,
                           "workloads": a.workloads, "prompts": a.prompts, "max_tokens": a.max_tokens,
                           "runs": a.runs, "seed": a.seed, "tag": tag}, sort_keys=True)

    def measure(self, variant: DraftVariant, mode: str, k: int, t: float | None = None, dt: float | None = None,
                tag: str = "search", deadline: float | None = None) -> dict | None:
        return self.measure_many(variant, [(mode, k, t, dt)], tag, deadline)[0]

    def measure_many(self, variant: DraftVariant, settings: list[tuple], tag: str = "search",
                     deadline: float | None = None) -> list[dict | None]:
        """(mode, k, temperature, draft temperature) settings on one draft; the uncached ones are
        measured with their runs interleaved. None for a setting skipped for the budget."""
        out: list[dict | None] = [None] * len(settings)
        todo = []
        for i, (mode, k, t, dt) in enumerate(settings):
            key = self.key(variant, mode, k, t, dt, tag)
            hit = self.cache.get(key)
            if hit is not None:
                out[i] = dict(hit, cached=True)
                self._note(variant, mode, hit)
                self.log.append(out[i])
            else:
                todo.append((i, key, mode, k, t, dt))
        if not todo:
            return out
        cost = sum(self.estimate(variant, m) for _, _, m, *_ in todo)
        if self.live is not None and self.live.current != variant and any(m != "target-only" for _, _, m, *_ in todo):
            cost += self.swap_cost
        if deadline is not None and self.elapsed() + cost > deadline:
            self.skipped += [self._label(variant, m, k, t, dt, tag) for _, _, m, k, t, dt in todo]
            return out
        if self.live is None:
            self.live = LiveStack(self.cfg, self.out / "logs", self.variants).start()
        if any(m != "target-only" for _, _, m, *_ in todo):
            if variant.name in self.unavailable:
                return out
            try:
                swapped = self.live.swap(variant)
            except Exception as e:  # noqa: BLE001 - a draft that cannot be loaded here is left out
                self.unavailable[variant.name] = f"{type(e).__name__}: {e}"[:3000]
                print(f"  draft {variant.name} could not be loaded, left out: {self.unavailable[variant.name][:300]}",
                      file=sys.stderr)
                return out
            if swapped:
                self.swap_cost = swapped
                self.live.warm_up(self.prompts[0], ("pipelined",), max(1, todo[0][3]))
        records: dict[int, list[dict]] = {i: [] for i, *_ in todo}  # the requests of each setting
        for run in range(self.a.runs):
            order = todo[run % len(todo):] + todo[: run % len(todo)]
            for i, _, mode, k, t, dt in order:
                for j, p in enumerate(self.prompts):
                    seed = request_seed(self.a.seed, j, run) if t is not None else None
                    rec = self.live.request(p, self.a.max_tokens, mode, max(1, k), t, dt, seed)
                    records[i].append(dict(rec, run=run))
        for i, key, mode, k, t, dt in todo:
            agg = aggregate(records[i], mode, k)
            target_only = mode == Mode.TARGET_ONLY.label
            fallback = 0 if target_only else agg["draft_fallback_rounds"]
            value = {"draft": None if target_only else variant.name, "mode": mode,
                     "k": 0 if target_only else k, "temperature": t,
                     "draft_temperature": None if target_only else dt, "tag": tag,
                     "tok_s": agg["tok_s"]["median"], "tok_s_runs": agg["tok_s_runs"], "spread": agg["tok_s"],
                     "acceptance_rate": agg["acceptance_rate"], "mean_accepted_tokens": agg["mean_accepted_tokens"],
                     "seconds": sum(r["seconds"] for r in records[i]), "draft_fallback_rounds": fallback,
                     "measured_at": time.time()}
            if fallback:
                print(f"  warning: {self._label(variant, mode, k, t, dt, tag)} ran {fallback} rounds without "
                      f"the draft (it was unavailable)", file=sys.stderr)
            self.cache.put(key, value)
            self._note(variant, mode, value)
            out[i] = dict(value, cached=False)
            self.log.append(out[i])
            if not self.a.quiet:
                print(f"  [{self.elapsed():5.0f}s] {self._label(variant, mode, k, t, dt, tag)}: "
                      f"{value['tok_s']:.1f} tok/s, acceptance {value['acceptance_rate']:.2f}",
                      file=sys.stderr, flush=True)
        return out

    @staticmethod
    def _label(variant, mode, k, t, dt, tag) -> str:
        if mode == "target-only":
            return f"target-only T={fmt_opt(t) or 0} [{tag}]"
        return f"{variant.name} {mode} k={k} T={fmt_opt(t) or 0} draft T={fmt_opt(dt) or '-'} [{tag}]"

    def _note(self, variant, mode, value) -> None:
        self.rates["target-only" if mode == "target-only" else variant.name] = value["tok_s"]

    # -- the search ----------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.a
        budget = a.budget_s
        temp = a.temperature
        drafts = [self.variants[n] for n in self._draft_names()]
        ks = sorted({k for k in parse_int_ranges(a.ks) if 1 <= k <= self.cfg.orchestrator.max_k})
        dts = sorted(set(parse_floats(a.draft_temps)) | {self.default_dt})
        default, dk, ddt = self.default, self.default_k, self.default_dt
        try:
            # 1. baselines
            self.measure_many(default, [("target-only", 0, None, None), ("pipelined", dk, None, None),
                                        ("pipelined", dk, temp, ddt)])
            # 2. draft and k, greedy: coarse grid over every draft, then refine around the best
            coarse = [k for k in ks if k & (k - 1) == 0] or ks
            coarse.sort(key=lambda k: abs(k - dk))
            for v in drafts:
                for k in coarse:
                    self.measure(v, "pipelined", k, deadline=0.65 * budget)
            best_v, best_k = self._best_greedy(drafts, ks)
            known = sorted(k for k in coarse if self._search(best_v, k) is not None)
            lo = max([k for k in known if k < best_k], default=ks[0] - 1)
            hi = min([k for k in known if k > best_k], default=ks[-1] + 1)
            for k in sorted((k for k in ks if lo < k < hi and k != best_k), key=lambda k: abs(k - best_k)):
                self.measure(best_v, "pipelined", k, deadline=0.65 * budget)
            best_v, best_k = self._best_greedy(drafts, ks)
            # 3. draft temperature, sampled, at the best draft and k
            for dt in sorted(dts, key=lambda x: abs(x - ddt)):
                self.measure(best_v, "pipelined", best_k, temp, dt, deadline=0.85 * budget)
            best_dt = self._best_sampled(best_v, best_k, dts)
            # 4. confirmation, side by side per draft group
            confirm = self._confirm(best_v, best_k, best_dt, budget)
        finally:
            if self.live is not None:
                self.live.stop()
        return self._decide(best_v, best_k, best_dt, confirm)

    def _draft_names(self) -> list[str]:
        names = [n for n in (self.a.drafts or ",".join(self.variants)).split(",") if n]
        unknown = [n for n in names if n not in self.variants]
        if unknown:
            raise SystemExit(f"unknown draft(s) {unknown}; known here: {sorted(self.variants)}")
        return [self.default.name] + [n for n in names if n != self.default.name]

    def _search(self, v: DraftVariant, k: int, t: float | None = None, dt: float | None = None) -> dict | None:
        return self.cache.get(self.key(v, "pipelined", k, t, dt, "search"))

    def _best_greedy(self, drafts, ks) -> tuple[DraftVariant, int]:
        best = (self.default, self.default_k, -1.0)
        for v in drafts:
            for k in ks + [self.default_k]:
                m = self._search(v, k)
                if m is not None and m["tok_s"] > best[2]:
                    best = (v, k, m["tok_s"])
        return best[0], best[1]

    def _best_sampled(self, v, k, dts) -> float:
        best = (self.default_dt, -1.0)
        for dt in dts:
            m = self._search(v, k, self.a.temperature, dt)
            if m is not None and m["tok_s"] > best[1]:
                best = (dt, m["tok_s"])
        return best[0]

    def _confirm(self, best_v, best_k, best_dt, budget) -> dict:
        """Per draft group: target-only (greedy and sampled) and the candidate settings, runs interleaved.
        -> {draft: {setting label: measurement}} with labels "target-only", "target-only T=..",
        "k=.." (greedy) and "k=.. draft T=.." (sampled)."""
        t = self.a.temperature
        wanted: dict[str, list] = {best_v.name: [(best_k, None), (best_k, best_dt)]}
        wanted.setdefault(self.default.name, []).extend([(self.default_k, None), (self.default_k, self.default_dt)])
        out = {}
        for name, pairs in wanted.items():
            pairs = list(dict.fromkeys(pairs))
            settings = [("target-only", 0, None, None), ("target-only", 0, t, None)] + \
                [("pipelined", k, None if dt is None else t, dt) for k, dt in pairs]
            res = self.measure_many(self.variants[name], settings, f"confirm:{name}", deadline=budget)
            out[name] = {_slabel(m, k, tt, dt): r for (m, k, tt, dt), r in zip(settings, res) if r is not None}
        return out

    # -- the decision --------------------------------------------------------------------------
    def _gain(self, confirm: dict, v: DraftVariant, k: int, dt: float | None) -> tuple[float | None, str]:
        """tok/s over target-only: from the confirmation group when measured there, else from the search."""
        t = None if dt is None else self.a.temperature
        group = confirm.get(v.name, {})
        m, ref = group.get(_slabel("pipelined", k, t, dt)), group.get(_slabel("target-only", 0, t, None))
        if m and ref and ref["tok_s"]:
            return m["tok_s"] / ref["tok_s"], "confirmation"
        m = self._search(v, k, t, dt)
        base = self.cache.get(self.key(self.default, "target-only", 0, None, None, "search"))
        if m and base and base["tok_s"]:
            return m["tok_s"] / base["tok_s"], "search"
        return None, "not measured"

    def _decide(self, best_v, best_k, best_dt, confirm) -> dict:
        a = self.a
        t = a.temperature
        d_v, d_k, d_dt = self.default, self.default_k, self.default_dt
        g_best, src_best = self._gain(confirm, best_v, best_k, None)
        g_def, src_def = self._gain(confirm, d_v, d_k, None)
        pct = (g_best / g_def - 1) * 100 if g_best and g_def else 0.0
        change_dk = (best_v, best_k) != (d_v, d_k) and pct > a.min_gain_pct
        rec_v, rec_k = (best_v, best_k) if change_dk else (d_v, d_k)
        if change_dk:
            why = (f"greedy pipelined {fmt_gain(g_best)} target-only vs {fmt_gain(g_def)} with the defaults "
                   f"({pct:+.1f}%, {src_best}); acceptance {self._acc(best_v, best_k, None)}")
        elif (best_v, best_k) == (d_v, d_k):
            why = f"the default was the fastest measured (greedy pipelined {fmt_gain(g_def)} target-only, {src_def})"
        else:
            why = (f"best measured, {best_v.name} k={best_k}, is {pct:+.1f}% over the defaults "
                   f"({fmt_gain(g_best)} vs {fmt_gain(g_def)} target-only; < {a.min_gain_pct:g}%: within noise)")
        rows = [{"setting": "draft (engine / model / dtype)", "value": _vdesc(rec_v), "default": _vdesc(d_v),
                 "changed": rec_v != d_v, "why": why},
                {"setting": "orchestrator.default_k", "value": rec_k, "default": d_k, "changed": rec_k != d_k,
                 "why": why}]
        # the draft temperature was searched at (best_v, best_k): it applies when that is what is recommended
        s_best, s_def = self._search(best_v, best_k, t, best_dt), self._search(best_v, best_k, t, d_dt)
        at_rec = (rec_v, rec_k) == (best_v, best_k)
        change_dt = False
        if s_best and s_def and s_def["tok_s"] and best_dt != d_dt:
            dpct = (s_best["tok_s"] / s_def["tok_s"] - 1) * 100
            change_dt = dpct > a.min_gain_pct and at_rec
            why_dt = (f"sampled (T={t:g}) {s_best['tok_s']:.1f} vs {s_def['tok_s']:.1f} tok/s with draft T {d_dt:g} "
                      f"({dpct:+.1f}%), acceptance {s_best['acceptance_rate']:.2f} vs {s_def['acceptance_rate']:.2f}")
            if not change_dt:
                why_dt += (f"; < {a.min_gain_pct:g}%: default kept" if at_rec else
                           f"; measured at {best_v.name} k={best_k}, not the recommended draft/k: default kept")
        elif s_def:
            why_dt = (f"the default was the fastest measured draft temperature (sampled T={t:g}: "
                      f"{s_def['tok_s']:.1f} tok/s, acceptance {s_def['acceptance_rate']:.2f})")
        else:
            why_dt = "not measured within the budget: default kept"
        rec_dt = best_dt if change_dt else d_dt
        rows.append({"setting": "orchestrator.default_draft_temperature", "value": rec_dt, "default": d_dt,
                     "changed": change_dt, "why": why_dt})
        gains = {"greedy": {"tuned": self._gain(confirm, rec_v, rec_k, None)[0], "defaults": g_def},
                 "sampled": {"tuned": self._gain(confirm, rec_v, rec_k, rec_dt)[0],
                             "defaults": self._gain(confirm, d_v, d_k, d_dt)[0]}}
        toml_path = self._write_config(rec_v, rec_k, rec_dt)
        result = {
            "command": "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["tune"] else "specdec tune",
            "settings": {"budget_s": a.budget_s, "workloads": a.workloads, "prompts_per_workload": a.prompts,
                         "max_tokens": a.max_tokens, "runs": a.runs, "temperature": t, "ks": a.ks,
                         "draft_temps": a.draft_temps, "drafts": self._draft_names(), "min_gain_pct": a.min_gain_pct,
                         "tiny": a.tiny},
            "elapsed_s": self.elapsed(),
            "defaults_best": not any(r["changed"] for r in rows),
            "recommendation": rows,
            "recommended": {"draft": rec_v.name, **rec_v.settings(), "default_k": rec_k,
                            "default_draft_temperature": rec_dt},
            "best_measured": {"draft": best_v.name, "k": best_k, "draft_temperature": best_dt},
            "gain_over_target_only": gains,
            "confirmation": confirm,
            "measurements": self.log,
            "skipped_for_budget": self.skipped,
            "unavailable_drafts": self.unavailable,
            "config": str(toml_path),
        }
        md = tune_markdown(result)
        (self.out / "tune.md").write_text(md)
        (self.out / "tune.json").write_text(json.dumps(result, indent=1))
        print(md)
        return result

    def _acc(self, v, k, dt) -> str:
        m = self._search(v, k, None if dt is None else self.a.temperature, dt)
        return f"{m['acceptance_rate']:.2f}" if m else "n/a"

    def _write_config(self, v: DraftVariant, k: int, dt: float) -> Path:
        from specdec.config import SpecdecConfig

        cfg = SpecdecConfig.load(self.a.config)
        if self.a.tiny:
            cfg.target.model = self.cfg.target.model
            cfg.target.cpu_cores = cfg.draft.cpu_cores = ""
        cfg.draft.engine, cfg.draft.dtype = v.engine, v.dtype
        if v.engine != "ngram":  # the n-gram drafter has no model: the file keeps the configured one
            cfg.draft.model = v.model
        cfg.orchestrator.default_k = int(k)
        cfg.orchestrator.default_draft_temperature = float(dt)
        path = self.out / "tuned.toml"
        path.write_text(cfg.to_toml())
        return path


def _slabel(mode: str, k: int, t: float | None, dt: float | None) -> str:
    if mode == "target-only":
        return "target-only" if t is None else f"target-only T={t:g}"
    return f"k={k}" if dt is None else f"k={k} draft T={dt:g}"


def _vdesc(v: DraftVariant) -> str:
    if v.engine == "ngram":
        return "ngram"
    return f"{v.engine} / {short_model(v.model)}" + (f" / {v.dtype}" if v.engine == "torch" else "")


def run_tune(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return Tuner(a, out).run()
