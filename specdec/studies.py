"""`specdec study`: the benchmark studies of issue 4, through the real services.

    specdec study --quick                          # a short pass: few prompts, short outputs, k in 1,4,8,16
    specdec study --out study-results              # everything, on the default pair (hours on 2 CPU cores)
    specdec study --tiny --quick                   # tiny random models: checks the machinery in seconds
    specdec study --studies ksweep,positions --ks 1-16 --lengths 128,256 --runs 5

Every number comes from our three services started by this command on free loopback ports
(`specdec.launcher.Stack`, the `specdec up` layout), on prompts from `specdec.bench.load_prompts`
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
  acceptance rate, mean accepted tokens per round (1 + accepted / rounds with drafts).
- drafts: each draft the system can load here (`--drafts`): llamacpp (the shipped Q4_1 GGUF,
  the default), llamacpp-q8_0 and llamacpp-f16 (the same weights re-quantized by llama.cpp's
  own tool, when the llama.cpp peer is built), torch-fp32 and torch-bf16 (torch copies of the
  target), ngram (prompt lookup). The only other real model here, Gemma-3 270M, has another
  tokenizer, so it cannot draft for this target.
  Swapping the draft restarts the draft service alone with a new [draft] section and waits
  for the orchestrator to re-attach it. Per draft: the draft service's RSS (and peak) from its
  /metrics, draft ms per token (draft_ms / k over the rounds with k > 0, sequential mode),
  acceptance, tok/s and the speedup over target-only measured in the same group.
- temps: target temperature in {0, 0.6, 1.0} x draft temperature in {0, 0.1, 0.6, 0.8}
  (pipelined, k = `--k`, a fixed seed per prompt and run): acceptance and tok/s.
- positions: acceptance by draft position (accepted_by_position / drafted_by_position summed
  over requests) at k = `--position-k` (16), per workload and per draft.
- ideal (computed from the ksweep cells, no extra requests): with d = measured draft ms per
  token, T(k) = mean verify_ms of the rounds that verified k drafts, and E(k) = 1 + sum_i
  P(first i drafts all accepted) from the per-position counts, the ideal decode rate is
  E / (k d + T(k)) sequential and E / max(T(k), (k+1) d) pipelined (every round a hit).
  Efficiency = measured decode tok/s (tokens after the first / time after the first) / ideal.
  Below 0.9 the report names the biggest loss with numbers (see `loss_breakdown`).

Outputs in `--out`: study.md (tables), study.json (settings, every cell's statistics and every
request's raw numbers, rounds included), ksweep.png, acceptance_by_position.png,
round_time_split.png, ideal.png, and the service logs (logs/). A study that stops early leaves
the requests measured so far in study-partial.json. A draft that cannot be loaded here is
skipped and named in the report.

`--quick`: 1 prompt per workload, outputs of 64 tokens, 2 runs, k in 1,4,8,16, a 2 x 2
temperature grid. `--tiny`: tiny random Llama models carrying the SmolLM2 tokenizer, made in
`<out>/tiny-models` (a target; a noisy copy of it as the default torch draft, "tiny-draft";
torch-fp32/bf16 are copies of the tiny target; llamacpp stays the shipped GGUF, which shares
the tokenizer): the numbers mean nothing, the machinery is exercised in seconds. Explicit
flags override what --quick sets.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.devices import parse_int_ranges
from specdec.stats import RoundRecord, position_counts

STUDIES = ("ksweep", "drafts", "temps", "positions")
ROUND_FIELDS = ("k", "accepted", "draft_ms", "verify_ms", "overlap_ms", "wasted_draft_tokens", "rpc_ms", "round_ms",
                "draft_available")
STAT_FIELDS = ("prompt_tokens", "completion_tokens", "ttft_ms", "total_ms", "rounds", "draft_tokens",
               "accepted_tokens", "accepted_by_position", "drafted_by_position", "wasted_draft_tokens",
               "draft_fallback_rounds", "rpc_overhead_ms_per_round", "seed", "finish_reason")
EFFICIENCY_TARGET = 0.9


# ----------------------------------------------------------------------------------------------
# Pure arithmetic (tested on hand-made numbers in tests/test_stats.py)
# ----------------------------------------------------------------------------------------------
def spread(values: list[float]) -> dict:
    """median / min / max / spread % = (max - min) / median, over runs."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0, "spread_pct": 0.0, "n": 0}
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0, "n": len(values)}


def expected_tokens_per_round(accepted_by_position: list[int], drafted_by_position: list[int], k: int) -> float:
    """E(k) = 1 + sum_{i=1..k} P(the first i drafts are all accepted).

    accepted_by_position[j] counts rounds that accepted more than j drafts (the accepted drafts
    are a prefix), so accepted[j] / drafted[j] estimates P(first j+1 accepted). Positions never
    drafted count as 0.
    """
    e = 1.0
    for j in range(k):
        d = drafted_by_position[j] if j < len(drafted_by_position) else 0
        a = accepted_by_position[j] if j < len(accepted_by_position) else 0
        e += a / d if d else 0.0
    return e


def ideal_tok_s(mode: str, k: int, draft_ms_per_token: float, verify_ms: float, expected_tokens: float) -> float:
    """Ideal decode rate (tok/s): sequential E / (k d + T); pipelined E / max(T, (k+1) d)."""
    if mode == "sequential":
        round_ms = k * draft_ms_per_token + verify_ms
    elif mode == "pipelined":
        round_ms = max(verify_ms, (k + 1) * draft_ms_per_token)
    elif mode == "target-only":
        round_ms, expected_tokens = verify_ms, 1.0
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return 1e3 * expected_tokens / round_ms if round_ms > 0 else 0.0


def ideal_round_ms(mode: str, k: int, d: float, t: float) -> float:
    if mode == "sequential":
        return k * d + t
    if mode == "pipelined":
        return max(t, (k + 1) * d)
    return t


def prefix_record(rec: dict, length: int) -> dict:
    """The first `length` tokens of a measured request, as if it had asked for `length` tokens.

    `rec["marks"]` holds one [seconds since the request was sent, tokens so far, rounds so far]
    per streamed chunk. The prefix ends with the chunk that delivered token `length`: seconds =
    that chunk's arrival (what a client asking for `length` tokens would have waited, give or
    take the last round, which is not shortened to fit), rounds = the rounds up to it, and the
    summary fields the study reads are recomputed from those rounds. The record is marked
    `prefix_of` (the full request's length), so that it is never counted twice.
    """
    marks = rec["marks"]
    end = next((m for m in marks if m[1] >= length), None)
    if end is None:
        raise ValueError(f"request produced {rec['tokens']} tokens, fewer than the prefix {length}")
    first = next(m for m in marks if m[1] >= 1)
    rounds = rec["rounds"][: end[2]]
    accepted, drafted = position_counts([RoundRecord(k=int(r["k"]), accepted=int(r["accepted"])) for r in rounds])
    stats = dict(rec["stats"])
    stats.update(completion_tokens=length, total_ms=float(stats["ttft_ms"]) + 1e3 * (end[0] - first[0]),
                 rounds=len(rounds), draft_tokens=sum(drafted), accepted_tokens=sum(accepted),
                 accepted_by_position=accepted, drafted_by_position=drafted,
                 wasted_draft_tokens=sum(int(r["wasted_draft_tokens"]) for r in rounds),
                 draft_fallback_rounds=sum(1 for r in rounds if not r.get("draft_available", True)))
    return dict(rec, tokens=length, seconds=end[0], stats=stats, rounds=rounds, marks=marks[: marks.index(end) + 1],
                prefix_of=rec["tokens"])


def full_requests(records: list[dict]) -> list[dict]:
    """The requests as measured (prefix records left out)."""
    return [r for r in records if "prefix_of" not in r]


def compact_rounds(rounds: list[dict]) -> list[list]:
    return [[_num(r.get(f, 0)) for f in ROUND_FIELDS] for r in rounds]


def expand_rounds(rows: list[list]) -> list[dict]:
    return [dict(zip(ROUND_FIELDS, row)) for row in rows]


def _num(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, float):
        return round(v, 4)
    return v


def _is_hit(prev: dict | None, r: dict, mode: str) -> bool:
    """Pipelined: round r used the drafts prepared during prev (prev accepted all, kept its spec)."""
    return (mode == "pipelined" and prev is not None and r["k"] > 0 and prev["k"] > 0
            and prev["accepted"] == prev["k"] and prev["wasted_draft_tokens"] == 0)


def round_time_split(requests: list[dict], mode: str, draft_ms_per_token: float = 0.0) -> dict:
    """Mean ms per round: draft (on the critical path), verify, RPC, idle; and the miss analysis.

    Per request (rounds in order):
    - sequential: the draft is on the critical path: draft_ms;
    - pipelined: a round that reuses the drafts made during the previous verify (a *hit*)
      exposes only draft_ms - (previous round's overlap_ms); any other round with drafts (a
      *miss*: redraft after a rejection or a wrong bonus guess, or the first round) waits
      for its whole draft_ms;
    - a miss also waits for the thrown-away speculative draft to finish; estimated as
      max(0, wasted * d - verify_ms - rpc_ms) per round with wasted tokens;
    - idle = decode time per round - draft - verify - RPC (draft round trips, orchestrator work,
      streaming the chunk between rounds).
    `requests` carry `stats` (ttft_ms, total_ms) and `rounds` (dicts).
    """
    n = 0
    verify = rpc = exposed = miss_draft = hit_draft = wasted_tail = round_ms = 0.0
    misses = hits = drafting = wasted = 0
    decode_ms = 0.0
    for req in requests:
        rounds = req["rounds"]
        decode_ms += max(0.0, float(req["stats"]["total_ms"]) - float(req["stats"]["ttft_ms"]))
        prev = None
        for r in rounds:
            n += 1
            verify += r["verify_ms"]
            rpc += r["rpc_ms"]
            round_ms += r["round_ms"]
            wasted += r["wasted_draft_tokens"]
            if r["k"] > 0:
                drafting += 1
                if mode == "pipelined" and _is_hit(prev, r, mode):
                    hits += 1
                    e = max(0.0, r["draft_ms"] - prev["overlap_ms"])
                    hit_draft += e
                else:
                    misses += 1 if mode == "pipelined" else 0
                    e = r["draft_ms"]
                    miss_draft += e if mode == "pipelined" else 0.0
                exposed += e
            if r["wasted_draft_tokens"] and draft_ms_per_token:
                wasted_tail += max(0.0, r["wasted_draft_tokens"] * draft_ms_per_token - r["verify_ms"] - r["rpc_ms"])
            prev = r
    if n == 0:
        return {"rounds": 0}
    per = decode_ms / n
    out = {
        "rounds": n, "drafting_rounds": drafting, "hits": hits, "misses": misses,
        "decode_ms_per_round": per, "round_ms": round_ms / n, "between_rounds_ms": per - round_ms / n,
        "verify_ms": verify / n, "rpc_ms": rpc / n, "draft_ms": exposed / n,
        "miss_draft_ms": miss_draft / n, "hit_draft_ms": hit_draft / n, "wasted_tail_ms": wasted_tail / n,
        "wasted_draft_tokens_per_round": wasted / n,
    }
    out["idle_ms"] = per - out["verify_ms"] - out["rpc_ms"] - out["draft_ms"]
    return out


def aggregate(requests: list[dict], mode: str, k: int) -> dict:
    """Statistics of one cell (one output length, or all): tok/s per run, acceptance, timings."""
    by_run: dict[int, list[dict]] = {}
    for r in requests:
        by_run.setdefault(r["run"], []).append(r)
    tok_s_runs = [sum(x["tokens"] for x in rs) / sum(x["seconds"] for x in rs)
                  for _, rs in sorted(by_run.items()) if sum(x["seconds"] for x in rs) > 0]
    stats = [r["stats"] for r in requests]
    rounds = [rd for r in requests for rd in r["rounds"]]
    drafting = [rd for rd in rounds if rd["k"] > 0]
    drafted = sum(rd["k"] for rd in rounds)
    accepted = sum(rd["accepted"] for rd in rounds)
    width = max([len(s.get("drafted_by_position") or []) for s in stats] + [0])
    acc_pos, dr_pos = [0] * width, [0] * width
    for s in stats:
        for i, v in enumerate(s.get("accepted_by_position") or []):
            acc_pos[i] += int(v)
        for i, v in enumerate(s.get("drafted_by_position") or []):
            dr_pos[i] += int(v)
    d = sum(rd["draft_ms"] for rd in drafting) / drafted if drafted else 0.0
    at_k = [rd["verify_ms"] for rd in rounds if rd["k"] == (k if mode != "target-only" else 0)]
    verify_at_k = statistics.fmean(at_k) if at_k else (statistics.fmean([rd["verify_ms"] for rd in rounds])
                                                        if rounds else 0.0)
    decode_tokens = sum(max(0, int(s["completion_tokens"]) - 1) for s in stats)
    decode_ms = sum(max(0.0, float(s["total_ms"]) - float(s["ttft_ms"])) for s in stats)
    tokens = sum(r["tokens"] for r in requests)
    seconds = sum(r["seconds"] for r in requests)
    return {
        "requests": len(requests),
        "tok_s": spread(tok_s_runs),
        "tok_s_runs": tok_s_runs,
        "tok_s_all": tokens / seconds if seconds else 0.0,
        "decode_tok_s": 1e3 * decode_tokens / decode_ms if decode_ms else 0.0,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_tokens": 1.0 + accepted / len(drafting) if drafting else 1.0,
        "accepted_by_position": acc_pos,
        "drafted_by_position": dr_pos,
        "acceptance_by_position": [a / b if b else 0.0 for a, b in zip(acc_pos, dr_pos)],
        "draft_ms_per_token": d,
        "verify_ms_at_k": verify_at_k,
        "ttft_ms_median": statistics.median(float(s["ttft_ms"]) for s in stats) if stats else 0.0,
        "wasted_draft_tokens": sum(int(s.get("wasted_draft_tokens", 0)) for s in stats),
        "draft_fallback_rounds": sum(int(s.get("draft_fallback_rounds", 0)) for s in stats),
        "time_split": round_time_split(requests, mode, d),
    }


def ideal_bound(agg: dict, mode: str, k: int, draft_ms_per_token: float | None = None) -> dict:
    """The ideal decode rate of a cell and its efficiency; below 0.9, the losses by size."""
    d = agg["draft_ms_per_token"] if draft_ms_per_token is None else draft_ms_per_token
    t = agg["verify_ms_at_k"]
    e = expected_tokens_per_round(agg["accepted_by_position"], agg["drafted_by_position"], k)
    ideal = ideal_tok_s(mode, k, d, t, e)
    measured = agg["decode_tok_s"]
    out = {"mode": mode, "k": k, "draft_ms_per_token": d, "verify_ms": t, "expected_tokens": e,
           "measured_tokens_per_round": agg["mean_accepted_tokens"], "ideal_round_ms": ideal_round_ms(mode, k, d, t),
           "ideal_tok_s": ideal, "measured_tok_s": measured,
           "efficiency": measured / ideal if ideal else 0.0,
           "draft_bound": mode == "pipelined" and (k + 1) * d > t}
    out["losses"] = loss_breakdown(agg["time_split"], mode, k, d, t)
    out["biggest_loss"] = describe_loss(out) if out["efficiency"] < EFFICIENCY_TARGET else ""
    return out


def loss_breakdown(split: dict, mode: str, k: int, d: float, t: float) -> list[dict]:
    """Where the measured round time goes beyond the ideal round, ms per round, largest first."""
    if not split.get("rounds"):
        return []
    losses = [{"name": "rpc", "ms": split["rpc_ms"], "what": "verify round trip minus verify compute"},
              {"name": "between_rounds", "ms": split["between_rounds_ms"],
               "what": "time between rounds (streaming the chunk, starting the next round)"}]
    if mode == "pipelined":
        ideal_exposed = max(0.0, (k + 1) * d - t)
        losses += [
            {"name": "misses", "ms": split["miss_draft_ms"],
             "what": f"target waits for a redraft: {split['misses']} of {split['drafting_rounds']} drafting rounds "
                     f"were misses"},
            {"name": "hit_draft_exposed", "ms": max(0.0, split["hit_draft_ms"] - ideal_exposed),
             "what": "draft time on hit rounds not hidden behind the verify, beyond the ideal"},
            {"name": "wasted_spec_tail", "ms": split["wasted_tail_ms"],
             "what": f"waiting for thrown-away speculative drafts to finish (estimated; "
                     f"{split['wasted_draft_tokens_per_round']:.2f} wasted draft tokens per round)"},
        ]
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"] - split["draft_ms"] - split["wasted_tail_ms"]
    elif mode == "sequential":
        losses.append({"name": "draft_beyond_kd", "ms": max(0.0, split["draft_ms"] - k * d),
                       "what": "draft time beyond k x d"})
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"] - split["draft_ms"]
    else:
        inside = split["round_ms"] - split["verify_ms"] - split["rpc_ms"]
    losses.append({"name": "in_round_overhead", "ms": max(0.0, inside),
                   "what": "inside the round beyond draft, verify and RPC (draft round trips, orchestrator work)"})
    return sorted(losses, key=lambda x: -x["ms"])


def describe_loss(ib: dict) -> str:
    if not ib["losses"]:
        return ""
    top = ib["losses"][0]
    measured_round = ib["measured_tokens_per_round"] / ib["measured_tok_s"] * 1e3 if ib["measured_tok_s"] else 0.0
    return (f"{top['name']}: {top['ms']:.2f} ms/round ({top['what']}); measured {measured_round:.2f} ms/round "
            f"at {ib['measured_tokens_per_round']:.2f} tokens/round vs ideal {ib['ideal_round_ms']:.2f} ms/round "
            f"at E={ib['expected_tokens']:.2f}")


def position_curve(requests: list[dict]) -> dict:
    width = max([len(r["stats"].get("drafted_by_position") or []) for r in requests] + [0])
    acc, dr = [0] * width, [0] * width
    for r in requests:
        for i, v in enumerate(r["stats"].get("accepted_by_position") or []):
            acc[i] += int(v)
        for i, v in enumerate(r["stats"].get("drafted_by_position") or []):
            dr[i] += int(v)
    return {"accepted_by_position": acc, "drafted_by_position": dr,
            "acceptance_by_position": [a / b if b else 0.0 for a, b in zip(acc, dr)]}


# ----------------------------------------------------------------------------------------------
# Models, draft variants and the live stack
# ----------------------------------------------------------------------------------------------
def make_tiny_models(root: Path, noise: float = 0.04) -> dict[str, Path]:
    """Tiny random Llama models with the SmolLM2 tokenizer (as tests/conftest.py makes them):
    a target (weights drawn with std 0.2, so that greedy output does not collapse onto one
    repeated token as it does at the usual 0.02), and a draft that is the target plus Gaussian
    noise (noise x each matrix's std): greedy agreement ~0.7. Made once per folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec import models

    root = Path(root)
    target, draft = root / "target", root / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return {"target": target, "draft": draft}
    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(target)
    tok.save_pretrained(target)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:  # perturb the matrices, leave the norms alone
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    model.save_pretrained(draft)
    tok.save_pretrained(draft)
    return {"target": target, "draft": draft}


@dataclass(frozen=True)
class DraftVariant:
    name: str
    engine: str
    model: str
    dtype: str = "float32"
    note: str = ""

    def settings(self) -> dict:
        return {"engine": self.engine, "model": self.model, "dtype": self.dtype}

    def matches(self, draft_cfg) -> bool:
        return (draft_cfg.engine == self.engine and (self.engine == "ngram" or draft_cfg.model == self.model)
                and (self.engine != "torch" or draft_cfg.dtype == self.dtype))


def draft_variants(target_model: str, tiny_draft: str | None = None) -> dict[str, DraftVariant]:
    from specdec.models import DEFAULT_DRAFT_MODEL

    out = {}
    if tiny_draft:
        out["tiny-draft"] = DraftVariant("tiny-draft", "torch", tiny_draft, "float32", "noisy copy of the tiny target")
    out["llamacpp"] = DraftVariant("llamacpp", "llamacpp", DEFAULT_DRAFT_MODEL, "float32", "shipped Q4_1 GGUF")
    if not tiny_draft:
        out.update(requantized_draft_variants())
    out["torch-fp32"] = DraftVariant("torch-fp32", "torch", target_model, "float32", "fp32 copy of the target")
    out["torch-bf16"] = DraftVariant("torch-bf16", "torch", target_model, "bfloat16", "bf16 copy of the target")
    out["ngram"] = DraftVariant("ngram", "ngram", "ngram", "float32", "prompt lookup, no model")
    return out


REQUANTIZED_DRAFTS = ("Q8_0", "F16")


def requantized_draft_variants() -> dict[str, DraftVariant]:
    """The shipped GGUF re-quantized by llama.cpp's own tool (when the llama.cpp peer is built:
    scripts/build_llamacpp_peer.sh), as llama.cpp drafts in other precisions. The shipped file
    is Q4_1, so these hold the same (dequantized Q4_1) weights as the fp32 target, rounded to
    the type: Q8_0 and F16 differ from the target far less than Q4_1 does at inference, since
    llama.cpp also quantizes the activations to the weights' dot-product type."""
    import os

    from specdec import peers

    if not os.access(peers.llamacpp_binary("llama-quantize"), os.X_OK):
        return {}
    out = {}
    for ftype in REQUANTIZED_DRAFTS:
        name = f"llamacpp-{ftype.lower()}"
        try:
            out[name] = DraftVariant(name, "llamacpp", str(peers.requantized_gguf(ftype)), "float32",
                                     f"shipped GGUF re-quantized to {ftype} by llama-quantize")
        except Exception as e:  # noqa: BLE001 - this draft is then not offered
            print(f"draft {name}: could not be made ({e}); left out", file=sys.stderr)
    return out


NO_DRAFT = DraftVariant("none", "", "", "", "no draft service running")


def variant_of(cfg_draft, variants: dict[str, DraftVariant]) -> DraftVariant:
    for v in variants.values():
        if v.matches(cfg_draft):
            return v
    return DraftVariant("config", cfg_draft.engine, cfg_draft.model, cfg_draft.dtype, "from the config file")


def scrape_metrics(host: str, port: int, timeout_s: float = 5.0) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value} (comments skipped)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            pass
    return out


class LiveStack:
    """Our three services on free ports, started on first use; the draft can be swapped."""

    def __init__(self, cfg, log_dir: Path, variants: dict[str, DraftVariant], retry_interval_s: float = 0.3):
        from specdec.launcher import free_port, local_config

        self.cfg = local_config(cfg)
        self.cfg.draft.metrics_port = free_port()
        self.cfg.orchestrator.probe_interval_s = retry_interval_s
        self.log_dir = Path(log_dir)
        self.variants = variants
        self.current = variant_of(self.cfg.draft, variants)
        self.stack = None
        self.client = None
        self.swap_seconds: list[float] = []

    def start(self) -> "LiveStack":
        if self.stack is None:
            from specdec.client import Client
            from specdec.launcher import Stack

            self.stack = Stack(self.cfg, self.log_dir).start()
            try:
                self.stack.wait_ready(900)
                self.client = Client(self.stack.address("orchestrator"))
                self._wait_draft(True, 120)
            except BaseException:
                self.stop()
                raise
        return self

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.stack is not None:
            self.stack.stop()
            self.stack = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def _draft_info(self) -> dict:
        info = self.client.info()
        return {"available": bool(info.get("draft_available")), "engine": info.get("draft", {}).get("engine", ""),
                "model": info.get("draft", {}).get("model", "")}

    def _poke(self) -> None:
        """A tiny request, so that the orchestrator notices a draft that went away."""
        try:
            self.client.complete(token_ids=[1, 2, 3], max_tokens=2, ignore_eos=True, mode="sequential", k=1)
        except Exception:  # noqa: BLE001 - only a probe
            pass

    def _wait_draft(self, available: bool, timeout_s: float, engine: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            st = self._draft_info()
            if st["available"] == available and (engine is None or st["engine"] == engine):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator reports draft {st}, waited for available={available} "
                                   f"engine={engine}; draft log:\n{self.stack.log('draft')[-2000:]}")
            if not available:
                self._poke()
            time.sleep(0.1)

    def swap(self, variant: DraftVariant) -> float:
        """Restart the draft service with another draft; returns the seconds it took."""
        self.start()
        if variant == self.current:
            return 0.0
        t0 = time.perf_counter()
        self.stack.stop_service("draft")
        self._wait_draft(False, 60)  # the orchestrator has noticed (and will re-read the draft's info)
        self.current = NO_DRAFT
        d = self.cfg.draft
        d.engine, d.model, d.dtype = variant.engine, variant.model, variant.dtype
        self.stack.config_path.write_text(self.cfg.to_toml())
        self.stack.start_service("draft")
        try:
            self.stack.wait_ready(900, ["draft"])
            self._wait_draft(True, 120, variant.engine)
        except BaseException:
            self.stack.stop_service("draft")
            raise
        self.current = variant
        dt = time.perf_counter() - t0
        self.swap_seconds.append(dt)
        return dt

    def draft_memory(self) -> dict:
        m = scrape_metrics(self.cfg.draft.host, self.cfg.draft.metrics_port)
        get = lambda n: m.get(f'specdec:memory_{n}{{service="draft"}}', 0.0)  # noqa: E731
        return {"rss_bytes": get("rss_bytes"), "peak_rss_bytes": get("peak_rss_bytes"),
                "weight_bytes": get("weight_bytes")}

    def info(self) -> dict:
        return self.client.info()

    def request(self, prompt: dict, length: int, mode: str, k: int, temperature: float | None = None,
                draft_temperature: float | None = None, seed: int | None = None) -> dict:
        kw = dict(token_ids=prompt["ids"], max_tokens=length, ignore_eos=True, mode=mode, k=k)
        if temperature is not None:
            kw["temperature"] = temperature
        if draft_temperature is not None:
            kw["draft_temperature"] = draft_temperature
        if seed is not None:
            kw["seed"] = seed
        from specdec.client import ResultCollector

        collector, marks = ResultCollector(), []
        t0 = time.perf_counter()
        for chunk in self.client.generate(**kw):
            collector.add(chunk)
            marks.append([round(time.perf_counter() - t0, 6), len(collector.tokens), len(collector.rounds)])
        seconds = time.perf_counter() - t0
        res = collector.result()
        stats = {f: res.stats.get(f) for f in STAT_FIELDS}
        return {"prompt": prompt["id"], "workload": prompt["workload"], "tokens": len(res.token_ids),
                "seconds": seconds, "stats": stats, "rounds": res.rounds, "marks": marks}

    def warm_up(self, prompt: dict, modes, k: int) -> None:
        for mode in modes:
            self.request(prompt, 8, mode, k)


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
    studies: set = field(default_factory=set)

    @property
    def id(self) -> str:
        s = f"{self.draft}/{self.mode}"
        if self.mode != "target-only":
            s += f"/k{self.k}"
        if self.temperature is not None or self.draft_temperature is not None:
            s += f"/T{_t(self.temperature)}/dT{_t(self.draft_temperature)}"
        return s

    def to_json(self) -> dict:
        return {"id": self.id, "draft": self.draft, "mode": self.mode, "k": self.k, "temperature": self.temperature,
                "draft_temperature": self.draft_temperature, "studies": sorted(self.studies)}


def _t(v) -> str:
    return "-" if v is None else f"{v:g}"


def request_seed(base: int, prompt_index: int, run: int) -> int:
    return base + 1000 * run + prompt_index


def request_lengths(lengths: list[int], separate: bool) -> list[int]:
    """The output lengths actually requested: all of them, or only the longest (the others are its prefixes)."""
    return sorted(lengths) if separate else [max(lengths)]


def measure_group(live: LiveStack, cells: list[Cell], prompts: list[dict], lengths: list[int], runs: int,
                  seed: int, bar=None, separate_lengths: bool = False) -> list[dict]:
    """Every cell x length x run x prompt, runs interleaved over the cells (order rotating).

    Unless `separate_lengths`, one request of the longest length is made and the shorter
    lengths are measured as its prefixes (`prefix_record`).
    """
    records = []
    for run in range(runs):
        for length in request_lengths(lengths, separate_lengths):
            order = cells[run % len(cells):] + cells[: run % len(cells)]
            for cell in order:
                if bar is not None:
                    bar.set_postfix_str(f"{cell.id} L{length} run {run + 1}", refresh=False)
                for i, p in enumerate(prompts):
                    sampled = cell.temperature is not None or cell.draft_temperature is not None
                    rec = live.request(p, length, cell.mode, max(cell.k, 1), cell.temperature, cell.draft_temperature,
                                       request_seed(seed, i, run) if sampled else None)
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
def parse_ints(spec: str) -> list[int]:
    return parse_int_ranges(spec)


def parse_floats(spec: str) -> list[float]:
    return [float(x) for x in spec.split(",") if x.strip()]


QUICK = {"prompts": 1, "lengths": "64", "runs": 2, "ks": "1,4,8,16", "target_temps": "0,1.0", "draft_temps": "0,0.6"}
FULL = {"prompts": 2, "lengths": "128,256", "runs": 3, "ks": "1-16", "target_temps": "0,0.6,1.0",
        "draft_temps": "0,0.1,0.6,0.8"}


def resolve_args(a) -> None:
    preset = QUICK if a.quick else FULL
    for key, value in preset.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def base_config(a, out: Path):
    """The configuration the study measures (and tune starts from), with its draft variants."""
    from specdec.config import SpecdecConfig

    cfg = SpecdecConfig.load(a.config)
    tiny_draft = None
    if a.tiny:
        tiny = make_tiny_models(out / "tiny-models")
        cfg.target.model = str(tiny["target"])
        cfg.draft.engine, cfg.draft.model, cfg.draft.dtype = "torch", str(tiny["draft"]), "float32"
        cfg.target.cpu_cores = cfg.draft.cpu_cores = ""
        tiny_draft = str(tiny["draft"])
    variants = draft_variants(cfg.target.model, tiny_draft)
    return cfg, variants


def load_study_prompts(a) -> list[dict]:
    from specdec import models
    from specdec.bench import load_prompts

    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    return load_prompts(tok, [w for w in a.workloads.split(",") if w], a.prompts, seed=a.seed)


def plan_cells(a, default: str, drafts: list[str]) -> dict[str, list[Cell]]:
    """Cells per draft group (each group measured in one stretch, target-only included)."""
    studies = set(a.studies.split(","))
    modes = [m for m in a.modes.split(",") if m]
    ks = parse_ints(a.ks)
    cells: dict[str, dict[str, Cell]] = {}

    def add(draft, mode, k, study, t=None, dt=None):
        c = Cell(draft, mode, k, t, dt)
        group = cells.setdefault(draft, {})
        group.setdefault(c.id, c).studies.add(study)

    base_k = a.k
    for draft in [default] + [d for d in drafts if d != default]:
        if draft != default and "drafts" not in studies:
            continue
        add(draft, "target-only", base_k, "baseline")
    if "ksweep" in studies:
        for mode in modes:
            for k in ks:
                add(default, mode, k, "ksweep")
    if "drafts" in studies:
        for draft in drafts:
            for mode in modes:
                add(draft, mode, base_k, "drafts")
    if "temps" in studies:
        for t in parse_floats(a.target_temps):
            for dt in parse_floats(a.draft_temps):
                add(default, "pipelined", base_k, "temps", t, dt)
    if "positions" in studies:
        for mode in modes:
            add(default, mode, a.position_k, "positions")
        if "drafts" in studies:
            for draft in drafts:
                add(draft, "sequential" if "sequential" in modes else modes[0], a.position_k, "positions")
    return {g: list(c.values()) for g, c in cells.items()}


def run_study(a) -> dict:
    from tqdm import tqdm

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
    prompts = load_study_prompts(a)
    lengths = parse_ints(a.lengths)
    groups = plan_cells(a, default.name, drafts)
    total = sum(len(cs) for cs in groups.values()) * len(prompts) * len(request_lengths(lengths, a.separate_lengths)) * a.runs
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
                bar.update(len(cells) * len(prompts) * len(request_lengths(lengths, a.separate_lengths)) * a.runs)
                del groups[name]
                continue
            info = live.info()
            infos[name] = {"target": info.get("target", {}), "draft": info.get("draft", {})}
            live.warm_up(prompts[0], sorted({c.mode for c in cells}), a.k)
            records += measure_group(live, cells, prompts, lengths, a.runs, a.seed, bar, a.separate_lengths)
            memory[name] = live.draft_memory()
    except BaseException:
        if records:  # keep what was measured (the full study takes hours)
            (out / "study-partial.json").write_text(json.dumps(
                {"round_fields": list(ROUND_FIELDS), "requests": [dict(r, rounds=compact_rounds(r["rounds"]))
                                                                  for r in records]}, default=_json_default))
            print(f"study: interrupted; {len(records)} requests saved in {out}/study-partial.json", file=sys.stderr)
        raise
    finally:
        bar.close()
        live.stop()
    result = analyse(a, groups, records, lengths, prompts, default.name, variants, memory, swaps, infos)
    result["skipped_drafts"] = failed
    result["wall_s"] = time.time() - t_start
    write_outputs(out, result, records)
    print(f"study: wrote {out}/study.md, study.json and plots in {result['wall_s']:.0f}s", file=sys.stderr)
    return result


def analyse(a, groups, records, lengths, prompts, default, variants, memory, swaps, infos) -> dict:
    cells = {c.id: cell_results(c, records, lengths) for cs in groups.values() for c in cs}
    modes = [m for m in a.modes.split(",") if m]
    res: dict = {
        "command": "specdec " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["study"] else "specdec study",
        "settings": {"tiny": a.tiny, "quick": a.quick, "workloads": a.workloads, "prompts_per_workload": a.prompts,
                     "lengths": lengths, "separate_lengths": a.separate_lengths, "runs": a.runs, "ks": parse_ints(a.ks), "modes": modes, "k": a.k,
                     "position_k": a.position_k, "seed": a.seed, "studies": a.studies,
                     "target_temps": parse_floats(a.target_temps), "draft_temps": parse_floats(a.draft_temps)},
        "prompts": [{"id": p["id"], "workload": p["workload"], "tokens": len(p["ids"])} for p in prompts],
        "default_draft": default,
        "drafts": {n: {**variants[n].settings(), "note": variants[n].note} for n in groups},
        "services": infos,
        "cells": cells,
    }
    studies = set(a.studies.split(","))
    base = f"{default}/target-only"
    if "ksweep" in studies:
        res["ksweep"] = [{"mode": c["mode"], "k": c["k"], "cell": cid} for cid, c in cells.items()
                         if "ksweep" in c["studies"]]
        res["ideal"] = []
        for cid, c in cells.items():
            if "ksweep" in c["studies"] or (c["draft"] == default and c["mode"] in ("pipelined", "sequential")
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
                                          "speedup": _speedups(c, cells.get(f"{name}/target-only"))}
            res["draft_comparison"].append(row)
    if "temps" in studies:
        res["temperature_grid"] = [{"temperature": c["temperature"], "draft_temperature": c["draft_temperature"],
                                    "cell": cid} for cid, c in cells.items() if "temps" in c["studies"]]
    if "positions" in studies:
        pk = a.position_k
        res["positions"] = {"k": pk, "by_workload": {}, "by_draft": {}}
        for w in dict.fromkeys(p["workload"] for p in prompts):
            reqs = [r for r in full_requests(records) if r["workload"] == w and _cell_is(cells[r["cell"]], default, pk)]
            res["positions"]["by_workload"][w] = position_curve(reqs)
        for name in groups:
            reqs = [r for r in full_requests(records) if _cell_is(cells[r["cell"]], name, pk)]
            if reqs:
                res["positions"]["by_draft"][name] = position_curve(reqs)
    res["baseline_cell"] = base
    return res


def _cell_is(c: dict, draft: str, k: int) -> bool:
    return (c["draft"] == draft and c["k"] == k and c["mode"] in ("pipelined", "sequential")
            and c["temperature"] is None and c["draft_temperature"] is None)


def _speedups(c: dict, base: dict | None) -> dict:
    if not base:
        return {}
    out = {}
    for L, agg in c["by_length"].items():
        b = base["by_length"].get(L)
        runs = [x / y for x, y in zip(agg["tok_s_runs"], b["tok_s_runs"]) if y] if b else []
        out[L] = spread(runs)
    return out


# ----------------------------------------------------------------------------------------------
# Report: Markdown, JSON, plots
# ----------------------------------------------------------------------------------------------
def _fmt_ratio(s: dict) -> str:
    return f"{s['median']:.2f}× ({s['min']:.2f}-{s['max']:.2f})" if s.get("n") else ""


def _fmt_spread(s: dict) -> str:
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f}, ±{s['spread_pct']:.0f}%)" if s.get("n") else ""


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
    fallback = [cid for cid, c in cells.items() if c["all"]["draft_fallback_rounds"]]
    if fallback:
        L += [f"Warning: the draft was unavailable for some rounds of {', '.join(fallback)} (served target-only).", ""]
    base = cells.get(res["baseline_cell"])
    if "ksweep" in res:
        L += ["## k sweep (greedy)", "",
              "Speedup: median (min-max) of the per-run ratios to target-only in the same run.", "",
              "| mode | k | " + " | ".join(f"tok/s L={x}" for x in lengths) + " | "
              + " | ".join(f"speedup L={x}" for x in lengths) + " | acceptance | mean accepted tokens/round |",
              "|---|---|" + "---|" * (2 * len(lengths)) + "---|---|"]
        if base:
            L.append("| target-only | | " + " | ".join(_fmt_spread(base["by_length"][x]["tok_s"]) for x in lengths)
                     + " | " + " | ".join(["1.00×"] * len(lengths)) + " | | |")
        for row in sorted(res["ksweep"], key=lambda r: (r["mode"], r["k"])):
            c = cells[row["cell"]]
            sp = _speedups(c, base)
            L.append(f"| {c['mode']} | {c['k']} | " + " | ".join(_fmt_spread(c["by_length"][x]["tok_s"])
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
                L.append(f"| {row['draft']} | {row['engine']} | {_short(row['model'])} | {row['dtype']} | "
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
            sp = _speedups(c, base)
            L.append(f"| {c['temperature']:g} | {c['draft_temperature']:g} | {c['all']['acceptance_rate']:.3f} | "
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


def _short(model: str) -> str:
    return model if len(model) < 40 else "…" + model[-36:]


def time_split_rows(res: dict) -> dict:
    cells, st = res["cells"], res["settings"]
    out = {}
    d = res["default_draft"]
    for mode in ["target-only"] + st["modes"]:
        cid = f"{d}/target-only" if mode == "target-only" else f"{d}/{mode}/k{st['k']}"
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
            rows = sorted((cells[r["cell"]] for r in res["ksweep"] if r["mode"] == mode), key=lambda c: c["k"])
            ks = [c["k"] for c in rows]
            for j, L in enumerate(lengths):
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
    records = [dict(r, rounds=expand_rounds(r["rounds"])) for r in doc.pop("requests")]
    doc.pop("round_fields", None)
    doc.pop("plots", None)
    write_outputs(Path(out), doc, records)
    return doc


def write_outputs(out: Path, res: dict, records: list[dict]) -> None:
    res["plots"] = write_plots(out, res)
    raw = dict(res, round_fields=list(ROUND_FIELDS),
               requests=[dict(r, rounds=compact_rounds(r["rounds"])) for r in records])
    (out / "study.json").write_text(json.dumps(raw, indent=1, default=_json_default))
    md = study_markdown(res)
    (out / "study.md").write_text(md)
    print(md)


def _json_default(o):
    if isinstance(o, set):
        return sorted(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(type(o))


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config of the services started (default: the embedded default pair)")
    p.add_argument("--tiny", action="store_true", help="tiny random models (checks the machinery in seconds)")
    p.add_argument("--workloads", default="chat,summarization,code,math")
    p.add_argument("--seed", type=int, default=0, help="prompt selection and request seeds")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub) -> None:
    p = sub.add_parser("study", help="benchmark studies: k sweep, drafts, temperatures, acceptance by position, "
                                     "ideal bound (see specdec/studies.py)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p)
    p.add_argument("--out", default="study-results")
    p.add_argument("--quick", action="store_true", help="few prompts, short outputs, k in 1,4,8,16")
    p.add_argument("--studies", default=",".join(STUDIES), help=f"comma list of {', '.join(STUDIES)}")
    p.add_argument("--prompts", type=int, help="prompts per workload (2; quick 1)")
    p.add_argument("--lengths", help="output lengths (128,256; quick 64)")
    p.add_argument("--runs", type=int, help="runs per cell (3; quick 2)")
    p.add_argument("--separate-lengths", action="store_true",
                   help="one request per output length (default: request the longest, measure the shorter "
                        "lengths as its prefixes: time to the L-th token)")
    p.add_argument("--ks", help="k values of the sweep, e.g. 1-16 or 1,2,4 (1-16; quick 1,4,8,16)")
    p.add_argument("--modes", default="pipelined,sequential")
    p.add_argument("--k", type=int, default=8, help="k of the draft and temperature studies")
    p.add_argument("--position-k", type=int, default=16, help="k of the acceptance-by-position curves")
    p.add_argument("--drafts", help="comma list of drafts to compare (default: all loadable here)")
    p.add_argument("--target-temps", help="target temperatures of the grid (0,0.6,1.0; quick 0,1.0)")
    p.add_argument("--draft-temps", help="draft temperatures of the grid (0,0.1,0.6,0.8; quick 0,0.6)")
    p.add_argument("--render", action="store_true",
                   help="only rewrite study.md and the plots in --out from its study.json (no measurement)")
    p.set_defaults(fn=lambda a: 0 if (render(Path(a.out)) if a.render else run_study(a)) else 1)
