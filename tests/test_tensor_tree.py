"""tensor_tree: a tree of dataclasses and tensors in one safetensors file, views and identity kept."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from specdec.serving import tensor_tree


@dataclass(frozen=True)
class Leaf:
    codes: torch.Tensor
    n: int
    note: str | None = None


@dataclass
class Root:
    head: torch.Tensor
    embed: torch.Tensor
    parts: list
    shape: tuple


CLASSES = {"Leaf": Leaf, "Root": Root}


def roundtrip(tree, tmp_path, classes=CLASSES):
    path = tmp_path / "t.safetensors"
    path.write_bytes(tensor_tree.dumps(tree, classes))
    return tensor_tree.load(path, classes), path


def test_views_identity_and_values_come_back(tmp_path):
    base = torch.randn(8, 16)  # [V, hidden]
    leaf = Leaf(torch.arange(24, dtype=torch.uint8).view(2, 3, 4), 7, "x")
    tree = Root(head=base.t(), embed=base, parts=[leaf, leaf, Leaf(torch.ones(3, dtype=torch.bfloat16), 2)],
                shape=(1, None, 2.5))
    back, _ = roundtrip(tree, tmp_path)
    assert torch.equal(back.embed, base) and torch.equal(back.head, base.t())
    assert back.head.stride() == (1, 16)  # still a transposed view ...
    assert back.head.untyped_storage().data_ptr() == back.embed.untyped_storage().data_ptr()  # ... of one copy
    assert back.parts[0] is back.parts[1]  # the same object stays one object
    assert back.parts[0].n == 7 and back.parts[0].note == "x" and back.shape == (1, None, 2.5)
    assert torch.equal(back.parts[0].codes, leaf.codes) and back.parts[2].codes.dtype == torch.bfloat16


def test_a_small_view_of_a_large_storage_keeps_only_its_span(tmp_path):
    big = torch.randn(1_000_000)  # 4 MB
    tree = Leaf(big[500_000:500_064].view(8, 8), 1)
    back, path = roundtrip(tree, tmp_path)
    assert torch.equal(back.codes, tree.codes) and back.codes.storage_offset() == 0
    assert path.stat().st_size < 10_000


def test_only_allowed_classes_are_kept_or_built(tmp_path):
    @dataclass
    class Other:
        x: int

    with pytest.raises(ValueError, match="not among the classes"):
        tensor_tree.dumps(Root(torch.zeros(1), torch.zeros(1), [Other(1)], ()), CLASSES)
    with pytest.raises(ValueError, match="no way to keep"):
        tensor_tree.dumps(Leaf(torch.zeros(1), 1, note={"a": 1}), CLASSES)
    _, path = roundtrip(Leaf(torch.zeros(2), 1), tmp_path)
    with pytest.raises(ValueError, match="not allowed"):
        tensor_tree.load(path, {"Root": Root})  # a file naming a class the reader does not allow


def test_a_tree_whose_views_pass_their_storage_is_refused(tmp_path):
    from safetensors.torch import save

    path = tmp_path / "bad.safetensors"
    tree = {"class": "Leaf", "id": 0, "fields": {"codes": {"tensor": 0, "dtype": "float32", "offset": 0,
                                                             "size": [100], "stride": [1]}, "n": 1, "note": None}}
    path.write_bytes(save({"s0": torch.zeros(10)}, metadata={"format": tensor_tree.FORMAT, "tree": json.dumps(tree)}))
    with pytest.raises(RuntimeError):
        tensor_tree.load(path, CLASSES)
