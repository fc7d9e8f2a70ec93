"""A tree of dataclasses, tuples, lists, plain values and tensors, kept in one safetensors file.

The paged runner keeps the weights it builds this way (`PagedLlamaRunner.load`, built weights):
packing and quantizing a model's matrices for specdec's kernels is most of a warm start, and
the result depends only on the model's files and the load options. Here:

- every distinct CPU storage is kept once, as the span of it that the tree's tensors use, so a
  view stays a view of the same storage (a tied embedding is its output head; a transposed
  head is its [V, hidden] copy read the other way), and a tensor that is a small view of a
  large storage does not carry the rest of it;
- the tree itself goes into the file's metadata as JSON: dataclasses by name, from the
  allowlist the caller passes (nothing else is ever constructed from a file), tensors as
  (storage, dtype, offset, size, stride).

`dumps` raises on anything it cannot keep (the caller then keeps nothing); `load` raises on a
file it cannot read back into exactly that tree.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

FORMAT = "specdec-tensor-tree-1"

_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.bool)}


class _Spans:
    """The storages of a tree's tensors, each with the element span its views use."""

    def __init__(self) -> None:
        self.index: dict[int, int] = {}  # storage address -> its number
        self.dtypes: list[torch.dtype] = []
        self.first: list[torch.Tensor] = []  # a view of each storage
        self.low: list[int] = []
        self.high: list[int] = []
        self.nodes: list[dict] = []  # the encoded tensors (their offsets are rebased to the kept spans)

    def add(self, t: torch.Tensor) -> int:
        if t.device.type != "cpu":
            raise ValueError(f"only CPU tensors are kept, got one on {t.device}")
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ValueError(f"no way to keep a {t.dtype} tensor")
        i = self.index.setdefault(t.untyped_storage().data_ptr(), len(self.first))
        if i < len(self.first) and self.dtypes[i] != t.dtype:
            raise ValueError("one storage viewed in two dtypes")
        lo = t.storage_offset()
        hi = lo + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) if t.numel() else lo
        if i == len(self.first):
            self.first.append(t)
            self.dtypes.append(t.dtype)
            self.low.append(lo)
            self.high.append(hi)
        else:
            self.low[i], self.high[i] = min(self.low[i], lo), max(self.high[i], hi)
        return i

    def flat(self, i: int) -> torch.Tensor:
        """The used span of storage i, as a contiguous 1-D tensor (a copy)."""
        t = self.first[i]
        whole = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())  # [storage elements]
        return whole[self.low[i]:self.high[i]].clone()


def _encode(obj: Any, spans: _Spans, classes: dict[str, type], seen: dict[int, int]) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        node = {"tensor": spans.add(obj), "dtype": str(obj.dtype).removeprefix("torch."),
                "offset": obj.storage_offset(), "size": list(obj.shape), "stride": list(obj.stride())}
        spans.nodes.append(node)
        return node
    if isinstance(obj, (list, tuple)):
        return {"list" if isinstance(obj, list) else "tuple": [_encode(x, spans, classes, seen) for x in obj]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if id(obj) in seen:  # the same object again (a tied embedding that is its packed head)
            return {"ref": seen[id(obj)]}
        name = type(obj).__name__
        if classes.get(name) is not type(obj):
            raise ValueError(f"{type(obj).__qualname__} is not among the classes this tree may hold")
        seen[id(obj)] = len(seen)
        return {"class": name, "id": seen[id(obj)],
                "fields": {f.name: _encode(getattr(obj, f.name), spans, classes, seen)
                           for f in dataclasses.fields(obj) if f.init}}
    raise ValueError(f"no way to keep a {type(obj).__qualname__}")


def dumps(tree: Any, classes: dict[str, type]) -> bytes:
    """The file's bytes for `tree` (the caller writes them, e.g. models.write_atomically)."""
    from safetensors.torch import save as st_save

    spans = _Spans()
    encoded = _encode(tree, spans, classes, {})
    tensors = {f"s{i}": spans.flat(i) for i in range(len(spans.first))}
    for node in spans.nodes:  # offsets count from the start of each kept span
        node["offset"] -= spans.low[node["tensor"]]
    return st_save(tensors, metadata={"format": FORMAT, "tree": json.dumps(encoded)})


def load(path: Path, classes: dict[str, type]) -> Any:
    """The tree kept in `path`; raises ValueError (or the reader's error) on anything else."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file")
        storages = {k: f.get_tensor(k) for k in f.keys()}  # each [span] 1-D
    objects: dict[int, Any] = {}

    def decode(node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if "tensor" in node:
            flat = storages[f"s{node['tensor']}"]
            if str(flat.dtype).removeprefix("torch.") != node["dtype"]:
                raise ValueError(f"{path}: storage s{node['tensor']} is {flat.dtype}, not {node['dtype']}")
            return flat.as_strided(node["size"], node["stride"], node["offset"])  # checks the span itself
        if "list" in node:
            return [decode(x) for x in node["list"]]
        if "tuple" in node:
            return tuple(decode(x) for x in node["tuple"])
        if "ref" in node:
            return objects[node["ref"]]
        cls = classes.get(node["class"])
        if cls is None:
            raise ValueError(f"{path}: class {node['class']!r} is not allowed here")
        obj = objects[node["id"]] = cls(**{k: decode(v) for k, v in node["fields"].items()})
        return obj

    return decode(json.loads(meta["tree"]))
