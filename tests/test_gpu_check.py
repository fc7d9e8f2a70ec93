"""The device check of issue 12 (`scripts/gpu_check.sh`, specdec/lab/gpu.py) run as CI runs it:
`--tiny` on the CPU, in a subprocess, so that it cannot rot; and the `random:<shape>` model specs
it loads (specdec/models.py)."""
from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_random_tiny_loads_and_a_paged_runner_steps():
    import torch

    from specdec import models
    from specdec.serving.batch import SeqChunk
    from specdec.serving.paged_llama import PagedLlamaRunner

    src = models.resolve("random:tiny")
    assert src.random_init and (src.directory / "config.json").exists()
    assert models.hf_directory(src) == src.directory
    tok = models.load_tokenizer(src)
    assert len(tok) == 49152
    r = PagedLlamaRunner.load("random:tiny", "float32", "cpu", pool_tokens=256, block_size=16, max_seqs=2)
    assert (r.arch.hidden, r.arch.num_layers, r.arch.num_heads, r.arch.num_kv_heads, r.arch.intermediate,
            r.arch.vocab) == (64, 2, 4, 2, 128, 49152)
    assert r.facts.fingerprint == models.tokenizer_fingerprint(tok)
    seq = r.blocks.reserve(64)
    (logits,) = r.forward([SeqChunk(seq, [5, 6, 7, 8], 0, 2)])
    assert logits.shape == (2, 49152) and torch.isfinite(logits).all() and logits.std() > 0
    # the same weights every load (a fixed seed)
    r2 = PagedLlamaRunner.load("random:tiny", "float32", "cpu", pool_tokens=256, block_size=16, max_seqs=2)
    (again,) = r2.forward([SeqChunk(r2.blocks.reserve(64), [5, 6, 7, 8], 0, 2)])
    torch.testing.assert_close(again, logits)


def test_random_shapes_are_the_real_ones_and_unknown_shapes_are_refused(tmp_path, monkeypatch):
    from transformers import AutoConfig

    from specdec import models
    from specdec.errors import InvalidArgument

    tiny = models.resolve("random:tiny").directory  # made once in the default cache
    # a machine without the packaged model: the tokenizer files brought along suffice
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    for shape in ("qwen2.5-7b", "qwen2.5-0.5b"):
        dest = tmp_path / "random" / shape
        dest.mkdir(parents=True)
        for f in tiny.iterdir():
            if f.name != "config.json":
                shutil.copy(f, dest / f.name)
    c7 = AutoConfig.from_pretrained(models.resolve("random:qwen2.5-7b").directory)
    assert (c7.model_type, c7.hidden_size, c7.num_hidden_layers, c7.num_attention_heads, c7.num_key_value_heads,
            c7.intermediate_size, c7.vocab_size, c7.tie_word_embeddings, c7.max_position_embeddings) == \
        ("qwen2", 3584, 28, 28, 4, 18944, 152064, False, 4096)
    c05 = AutoConfig.from_pretrained(models.resolve("random:qwen2.5-0.5b").directory)
    assert (c05.hidden_size, c05.num_hidden_layers, c05.num_attention_heads, c05.num_key_value_heads,
            c05.intermediate_size, c05.vocab_size, c05.tie_word_embeddings) == (896, 24, 14, 2, 4864, 151936, True)
    with pytest.raises(InvalidArgument, match="qwen2.5-7b"):
        models.resolve("random:gpt-5")


def _cells(section: str) -> list[list[str]]:
    """The body rows of every Markdown table in a section (header and rule rows dropped)."""
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("|")]
    return [[c.strip() for c in r] for r in rows if not set("".join(r)) <= set("-: ")][0:]


def _number(cell: str) -> float:
    return float(re.sub(r"(x| ms| GB/s| GB)$", "", cell).replace(",", ""))


def test_gpu_check_tiny_on_the_cpu_writes_every_section_with_finite_numbers(tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--device", "cpu", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert re.search(r"\[\s*\d+\.\d+s\] done in", r.stderr)  # progress lines with elapsed seconds
    text = out.read_text()
    assert "FAILED" not in text and "Skipped" not in text
    sections = dict(re.findall(r"^## ([a-h])\. .*?\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M))
    assert sorted(sections) == list("abcdefgh")
    for letter in "abcdegh":  # each table with the command that made it on top
        assert "Command: `python -m specdec.lab.gpu --tiny" in sections[letter]

    def table(letter: str) -> list[list[str]]:
        rows = _cells(sections[letter])
        assert rows, letter
        return rows

    header_rows = {"what", "k", "step", "mode", "service"}
    a = {row[0]: row[1] for row in table("a") if row[0] not in header_rows}
    assert len(a) == 4 and all(math.isfinite(_number(v)) and _number(v) > 0 for v in a.values())
    b = [row for row in table("b") if row[0] != "k"]
    assert [int(row[0]) for row in b] == list(range(17))
    for row in b:
        assert all(math.isfinite(_number(c)) and _number(c) > 0 for c in row[1:3] + row[4:6]), row
        assert row[3] in ("yes", "eager")
    c = [row for row in table("c") if row[0] != "step"]
    assert len(c) == 3 and all(math.isfinite(_number(x)) for row in c for x in row[1:])
    d_rows = [row for row in table("d") if row[0] not in header_rows]
    modes = {row[0]: row for row in d_rows if row[0] in ("target-only", "sequential", "pipelined")}
    assert sorted(modes) == ["pipelined", "sequential", "target-only"]
    for row in modes.values():
        assert int(row[1]) > 0 and all(math.isfinite(_number(x)) for x in row[2:]), row
    memory = {row[0]: row for row in d_rows if row[0] in ("target", "draft", "orchestrator")}
    assert sorted(memory) == ["draft", "orchestrator", "target"]
    assert all(_number(row[1]) > 0 for row in memory.values())  # peak RSS of each service
    e = {row[0]: row for row in table("e") if row[0] != "mode"}
    assert sorted(e) == ["pipelined (ideal)", "pipelined (with misses)", "sequential", "target-only"]
    for mode, row in e.items():
        assert int(row[1]) == 0 if mode == "target-only" else 1 <= int(row[1]) <= 16, row  # best k
        assert all(math.isfinite(_number(x)) and _number(x) > 0 for x in row[2:]), row
    g = [row for row in table("g") if row[0] != "check"]  # isolated pools: every check passes on the CPU too
    assert len(g) == 6 and all(row[1] == "PASS" for row in g), g
    assert "MPS could not be started: nvidia-cuda-mps-control not found" in sections["h"]  # no MPS on the CPU
    assert "expandable_segments: n/a on CPU" in sections["h"]
    assert sections["f"].count("n/a on CPU") == 3 and "FAIL" not in sections["f"]
    assert "isolation (g), every check: PASS" in sections["f"]


def test_projection_reuses_the_expected_tokens_formula():
    from specdec.kchoice import expected_tokens
    from specdec.lab.gpu import ACCEPT_BY_POSITION, projection

    verify = {k: 10.0 + 0.5 * k for k in range(17)}
    p = projection(verify, 1.0)
    assert p["target-only"] == (0, 1.0, 10.0, 100.0)
    k, e, ms, tps = p["sequential"]
    assert e == expected_tokens(ACCEPT_BY_POSITION, k) and ms == k * 1.0 + verify[k]
    assert tps == max(1e3 * expected_tokens(ACCEPT_BY_POSITION, j) / (j + verify[j]) for j in range(1, 17))
    k, e, ms, _ = p["pipelined (ideal)"]
    assert ms == max(verify[k], (k + 1) * 1.0)
    assert p["pipelined (with misses)"][3] <= p["pipelined (ideal)"][3]


# The GPU image has no grpcio-health-checking or grpcio-reflection (README, "The device check"):
# a sitecustomize that hides the installed copies stands in for it, and gpu_check.sh must install
# the carried wheels (scripts/gpu_wheels.sh) for its run, the services it starts included.
HIDE_INSTALLED = '''
import importlib.machinery, sys

class HideInstalled:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in ("grpc_health", "grpc_reflection"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, [p for p in sys.path if "-packages" not in p])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden: the GPU image lacks it)", name=name)
        return spec

sys.meta_path.insert(0, HideInstalled())
'''


def _image_like_env(tmp_path: Path, wheels: Path) -> dict[str, str]:
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_INSTALLED)
    return dict(os.environ, PYTHONPATH=str(hide), SPECDEC_GPU_WHEELS=str(wheels), TMPDIR=str(tmp_path),
                PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def _wheel_of_installed(packages: list[str], out: Path, tmp_path: Path) -> None:
    """A wheel of the installed copies of `packages` (as gpu_wheels.sh's would hold), built offline."""
    import importlib

    src = tmp_path / "wheel-src"
    for name in packages:
        shutil.copytree(Path(importlib.import_module(name).__file__).parent, src / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "image-lacks"\nversion = "0"\n'
        f'[tool.setuptools]\npackages = {{find = {{include = {[p + "*" for p in packages]!r}}}}}\n'.replace("'", '"'))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)


def test_gpu_check_without_grpc_health_and_no_wheels_says_what_to_carry(tmp_path):
    empty = tmp_path / "wheels"
    empty.mkdir()
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--device", "cpu", "--out",
                        str(tmp_path / "gpu.md")], cwd=ROOT, env=_image_like_env(tmp_path, empty),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "scripts/gpu_wheels.sh" in r.stderr and not (tmp_path / "gpu.md").exists()


def test_gpu_check_installs_the_carried_wheels_for_its_run(tmp_path):
    wheels = tmp_path / "wheels"
    _wheel_of_installed(["grpc_health", "grpc_reflection"], wheels, tmp_path)
    out = tmp_path / "gpu.md"
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--device", "cpu", "--skip", "a,b,c,d,e",
                        "--out", str(out)], cwd=ROOT, env=_image_like_env(tmp_path, wheels),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "specdec-gpu-site" / "grpc_health").is_dir()
    g = re.search(r"^## g\. .*?\n(.*?)(?=^## |\Z)", out.read_text(), flags=re.S | re.M).group(1)
    checks = [row for row in _cells(g) if row[0] != "check"]  # the three services ran, isolation held
    assert len(checks) == 6 and all(row[1] == "PASS" for row in checks), checks


FAKE_MPS_CONTROL = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: -d starts the daemon, commands come on stdin
[ "$1" = "-d" ] && { touch "$CUDA_MPS_PIPE_DIRECTORY/daemon"; exit 0; }
read cmd
case "$cmd" in
  get_server_list) [ -f "$CUDA_MPS_PIPE_DIRECTORY/daemon" ] && echo 4242; exit 0;;
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/daemon"; touch "$CUDA_MPS_LOG_DIRECTORY/quit"; exit 0;;
esac
exit 1
"""


def test_gpu_check_runs_the_services_again_under_an_mps_daemon_and_stops_it(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(FAKE_MPS_CONTROL)
    fake.chmod(0o755)
    out = tmp_path / "gpu.md"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--device", "cpu", "--skip", "a,b,c,e,g",
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    h = re.search(r"^## h\. .*?\n(.*?)(?=^## |\Z)", out.read_text(), flags=re.S | re.M).group(1)
    assert "started (`nvidia-cuda-mps-control -d`)" in h and "MPS servers while the services ran: 4242" in h
    rows = {row[0]: row for row in _cells(h) if row[0] in ("target-only", "sequential", "pipelined")}
    assert sorted(rows) == ["pipelined", "sequential", "target-only"]
    for row in rows.values():  # d's and MPS's ms per token, and their ratio
        assert all(math.isfinite(_number(x)) and _number(x) > 0 for x in row[1:4]), row
    assert "- MPS: pipelined is" in h and "- d: pipelined is" in h
    assert len(list(tmp_path.glob("specdec-mps-*/log/quit"))) == 1  # the daemon was stopped


def test_the_mps_and_allocator_runs_are_left_out_when_they_would_end_past_the_budget():
    from specdec.lab.gpu import SERVICE_VARIANTS, Plan, Progress, run_variants

    plan = Plan.make(tiny=True, device="cpu", budget_s=60)
    runs = run_variants(plan, Progress(), d_seconds=1000)  # d took longer than the whole budget: nothing starts
    assert runs["mps_start"] == "not tried"
    assert all(runs[v]["error"].startswith("not run: it would end past the 60 s budget") for v in SERVICE_VARIANTS)
