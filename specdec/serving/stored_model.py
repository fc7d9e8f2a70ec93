"""A model's load manifest: the paged runner's second load of a model without transformers.

Importing transformers and building its module tree is most of a service's start on the CPU
(about 3 of 5 s for the tiny test models; the weights themselves are plain safetensors). The
paged runner only reads tensors, a few config fields, the RoPE tables and the tokenizer's
fingerprint from that tree. So the first load of a model directory (the cold load, through
transformers as before) writes a manifest into the directory's load cache
(`models.load_cache_dir`: $SPECDEC_CACHE_DIR/loads/<hash>/, next to its pickled tokenizer):

- the model's config as a dict, its tokenizer fingerprint and EOS ids;
- for every tensor of the model's state dict, the safetensors file and key it comes from,
  each *checked equal* (torch.equal, after the cast to the load dtype) to what transformers
  loaded; a model whose tensors do not all come straight from its files gets a negative
  manifest, and always loads cold;
- the RoPE cos/sin tables as the model's own rotary module computes them (float32).

A later load (the warm load) finds the manifest, checks its key (the directory's files by
name, size and mtime; the versions of torch, transformers and safetensors; the source of the
modules that shape extraction) and builds a `StoredModel`: the same tensors in a tree of
plain nodes answering the attribute paths `paged_llama.extract_weights` reads. The runner
built from it is the cold runner bit for bit (tests/test_stored_model.py).

Only CPU loads of Hugging Face directories (and converted GGUF files) use it: not random
models, not stored INT4 checkpoints (their codes are read separately), not GPUs.

Next to a valid manifest the runner keeps what it built from the model (`built_file`,
`keep_built`, `open_built`): packing and quantizing the matrices for specdec's kernels was most
of a warm start. One file per set of build options (precision, head, kernels, activation bits),
keyed by the manifest's key and the source of the modules that build and run the packed
weights; its RoPE tables run to the manifest's length, and a load for a shorter context takes
their first rows. At most MAX_BUILT are kept per directory, the least recently used dropped.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch

from specdec import models

log = logging.getLogger(__name__)

VERSION = 1  # the manifest's layout
MANIFEST_FILE = "manifest.json"
MAX_STORED_POSITIONS = 32768  # RoPE rows kept beyond what the cold load needed (up to max_position_embeddings)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the modules whose code decides what a model's tensors become in the runner
_SHAPING_SOURCES = ("stored_model.py", "paged_llama.py", "../hf_compat.py", "../models.py")
PACKAGES = ("torch", "transformers", "safetensors")  # whose versions the manifest depends on
# the modules whose code decides what built (packed, quantized) weights look like, and the kernels reading them
_BUILD_SOURCES = ("cpu_gemm.py", "int4.py", "tensor_tree.py", "csrc")
MAX_BUILT = 3  # built-weight files kept per model directory


@functools.cache
def _code_hash() -> str:
    """sha256 of the modules that shape extraction (they do not change while a process runs)."""
    here = Path(__file__).parent
    code = hashlib.sha256()
    for name in _SHAPING_SOURCES:
        code.update((here / name).read_bytes())
    return code.hexdigest()


@functools.cache
def _build_hash() -> str:
    here = Path(__file__).parent
    code = hashlib.sha256()
    for name in _BUILD_SOURCES:
        for f in sorted((here / name).rglob("*")) if (here / name).is_dir() else [here / name]:
            if f.is_file() and f.suffix in (".py", ".c", ".h"):
                code.update(f.name.encode() + f.read_bytes())
    return code.hexdigest()


def _key(directory: Path) -> dict:
    return {"version": VERSION, **models.directory_key(directory, PACKAGES), "code": _code_hash()}


def _read(directory: Path) -> dict | None:
    """The manifest of `directory` if its key still holds, else None (also when it cannot be read
    or its key cannot be made, e.g. a package without its metadata)."""
    try:
        manifest = json.loads((models.load_cache_dir(directory, create=False) / MANIFEST_FILE).read_text())
        return manifest if manifest.get("key") == _key(directory) else None
    except Exception:  # noqa: BLE001 - a cache: load through transformers
        return None


def _manifest_of(src: models.ModelSource) -> tuple[Path | None, dict | None]:
    """`src`'s Hugging Face directory (None when there is none yet) and its valid manifest, if any."""
    directory = models.ready_hf_directory(src)
    return directory, _read(directory) if directory is not None else None


def config(src: models.ModelSource) -> SimpleNamespace | None:
    """The model's config from a valid manifest (attributes as transformers' config has them)."""
    _, manifest = _manifest_of(src)
    return SimpleNamespace(**manifest["config"]) if manifest else None


def tokenizer_facts(src: models.ModelSource) -> tuple[str, list[int]] | None:
    """(fingerprint, EOS ids of the tokenizer alone) from a valid manifest."""
    _, manifest = _manifest_of(src)
    return (manifest["fingerprint"], manifest["eos_tokenizer"]) if manifest else None


def _safetensors_keys(directory: Path) -> dict[str, str]:
    """tensor key -> file name, over every .safetensors file of the directory."""
    from safetensors import safe_open

    where: dict[str, str] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            where.update({k: f.name for k in st.keys()})
    return where


def record(src: models.ModelSource, model: torch.nn.Module, tokenizer, dtype: str, positions: int) -> None:
    """After a cold load: write (or extend) the manifest of `src`'s directory for `dtype`, with
    RoPE tables for at least `positions` positions. Never raises (a manifest is an optimisation)."""
    directory = models.ready_hf_directory(src)
    if directory is None or dtype not in _DTYPES:
        return
    try:
        _record(directory, model, tokenizer, dtype, positions)
    except Exception:  # noqa: BLE001 - the load itself has succeeded; the next one is cold again
        log.warning("could not write the load manifest of %s", src.spec, exc_info=True)


def _record(directory: Path, model: torch.nn.Module, tokenizer, dtype: str, positions: int) -> None:
    from safetensors import safe_open
    from safetensors.torch import save

    from specdec import hf_compat

    old = _read(directory)
    if old is not None and not old["direct"]:
        return
    if old is not None and dtype in old["dtypes"] and old["rope_positions"] >= positions:
        return
    names = {id(m): n for n, m in model.named_modules()}
    embed = f"{names[id(model.get_input_embeddings())]}.weight"
    head = f"{names[id(model.get_output_embeddings())]}.weight"
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    where = _safetensors_keys(directory)
    tensors: dict[str, str] = {}
    direct = True
    handles: dict[str, object] = {}
    with torch.inference_mode():
        for name, t in model.state_dict().items():
            if name == head and tied:
                continue
            file = where.get(name)
            if file is None:
                direct = False
                break
            st = handles.get(file) or handles.setdefault(file, safe_open(str(directory / file), framework="pt"))
            if not torch.equal(st.get_tensor(name).to(t.dtype), t):
                direct = False
                break
            tensors[name] = file
    handles.clear()
    decoder = names[id(model.get_decoder())]
    manifest = {"key": _key(directory), "direct": direct, "dtypes": sorted({dtype, *(old or {}).get("dtypes", [])}),
                "config": json.loads(json.dumps(model.config.to_dict(), default=str)),
                "decoder": decoder, "embed": embed, "head": head, "tied": tied, "tensors": tensors,
                "fingerprint": models.tokenizer_fingerprint(tokenizer),
                "eos_tokenizer": models.eos_token_ids(tokenizer),
                "eos_model": models.eos_token_ids(tokenizer, model.config)}
    out = models.load_cache_dir(directory)
    if direct:
        max_pos = int(getattr(model.config, "max_position_embeddings", positions) or positions)
        n = max(positions, min(max_pos, MAX_STORED_POSITIONS))
        cos, sin = hf_compat.rope_tables(model, n, torch.float32, "cpu")  # [n, D] each
        rope = f"rope-{n}.safetensors"  # named by its length: a concurrent writer's tables never mix in
        models.write_atomically(out / rope, save({"cos": cos, "sin": sin}))
        manifest.update(rope_positions=n, rope_file=rope)
    models.write_atomically(out / MANIFEST_FILE, json.dumps(manifest))  # last: it marks the entry complete
    if old is None:  # a new key: weights built under the old one are stale
        for f in out.glob("built-*.safetensors"):
            f.unlink(missing_ok=True)
    log.info("wrote the load manifest of %s (%s)", directory, "direct" if direct else "cold loads only")
    for f in out.glob("rope-*.safetensors"):  # tables an earlier manifest named
        if f.name != manifest.get("rope_file"):
            f.unlink(missing_ok=True)


class _Node:
    """A module path of the stored model: attributes are child nodes or tensors, `[i]` a child."""

    def __init__(self) -> None:
        self.__dict__["_children"] = {}

    def __getattr__(self, name: str):
        try:
            return self.__dict__["_children"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        self.__dict__["_children"][name] = value

    def __getitem__(self, i: int):
        return self.__dict__["_children"][str(i)]

    def __setitem__(self, i: int, value) -> None:  # extract_weights(consume=True) drops a layer
        self.__dict__["_children"][str(i)] = value

    def walk(self, path: str) -> "_Node":
        node = self
        for part in path.split(".") if path else ():
            children = node.__dict__["_children"]
            node = children.setdefault(part, _Node())
        return node


class _StoredRotary:
    """`rotary_emb(x, position_ids)` as hf_compat.rope_tables calls it, from the stored tables."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin  # [stored positions, D] float32 each

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = int(position_ids.shape[-1])
        if p > self.cos.shape[0] or not torch.equal(position_ids[0].cpu(), torch.arange(p)):
            raise ValueError(f"the stored RoPE tables hold positions 0..{self.cos.shape[0] - 1}")
        return (self.cos[:p].unsqueeze(0).to(device=x.device, dtype=x.dtype),
                self.sin[:p].unsqueeze(0).to(device=x.device, dtype=x.dtype))  # each [1, P, D]


class StoredModel:
    """The tensors and facts of a model as its manifest lists them (the warm load)."""

    def __init__(self, manifest: dict, root: _Node) -> None:
        self.config = SimpleNamespace(**manifest["config"])
        self.fingerprint: str = manifest["fingerprint"]
        self.eos_token_ids: list[int] = manifest["eos_model"]
        self.rope_positions: int = manifest["rope_positions"]
        self._manifest = manifest
        self._root = root

    def get_decoder(self) -> _Node:
        return self._root.walk(self._manifest["decoder"])

    def get_input_embeddings(self) -> _Node:
        return self._root.walk(self._manifest["embed"].rsplit(".", 1)[0])

    def get_output_embeddings(self) -> _Node:
        return self._root.walk(self._manifest["head"].rsplit(".", 1)[0])

    def parameters(self):
        """Every tensor still in the tree, each once (a tied head is the embedding)."""
        seen: set[int] = set()
        stack = [self._root]
        while stack:
            for child in stack.pop().__dict__["_children"].values():
                if isinstance(child, _Node):
                    stack.append(child)
                elif isinstance(child, torch.Tensor) and id(child) not in seen:
                    seen.add(id(child))
                    yield child

    @property
    def dtype(self) -> torch.dtype:
        return self.get_input_embeddings().weight.dtype


def open_stored(src: models.ModelSource, dtype: str) -> StoredModel | None:
    """The warm load: `src`'s tensors in `dtype` (CPU) from a valid manifest, or None (load cold:
    no manifest, a stale one, or any failure reading it)."""
    if dtype not in _DTYPES:
        return None
    directory, manifest = _manifest_of(src)
    if manifest is None or not manifest["direct"] or dtype not in manifest["dtypes"]:
        return None
    try:
        return _open(directory, manifest, _DTYPES[dtype])
    except Exception:  # noqa: BLE001 - e.g. a file replaced meanwhile: the cold load still works
        log.warning("could not load %s from its manifest; loading it through transformers", src.spec, exc_info=True)
        return None


def _open(directory: Path, manifest: dict, dtype: torch.dtype) -> StoredModel:
    from safetensors import safe_open

    root = _Node()
    by_file: dict[str, list[str]] = {}
    for name, file in manifest["tensors"].items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(directory / file), framework="pt") as st:
            for name in names:
                path, leaf = name.rsplit(".", 1)
                setattr(root.walk(path), leaf, st.get_tensor(name).to(dtype))
    if manifest["tied"]:
        path, leaf = manifest["head"].rsplit(".", 1)
        setattr(root.walk(path), leaf, getattr(root.walk(manifest["embed"].rsplit(".", 1)[0]), "weight"))
    with safe_open(str(models.load_cache_dir(directory, create=False) / manifest["rope_file"]), framework="pt") as st:
        rotary = _StoredRotary(st.get_tensor("cos"), st.get_tensor("sin"))
    setattr(root.walk(manifest["decoder"]), "rotary_emb", rotary)
    return StoredModel(manifest, root)


# -- built weights -----------------------------------------------------------------------------------

def built_file(src: models.ModelSource, options: dict) -> Path | None:
    """Where the weights built from `src` with `options` are kept (the file may not exist yet);
    None without a valid manifest of direct tensors."""
    directory, manifest = _manifest_of(src)
    if manifest is None or not manifest["direct"]:
        return None
    key = json.dumps({"manifest": manifest["key"], "build": _build_hash(), **options}, sort_keys=True, default=str)
    return models.load_cache_dir(directory) / f"built-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"


def open_built(path: Path | None, classes: dict[str, type]):
    """The tree kept in `path` (tensor_tree), or None: no file, or one that cannot be read (then removed)."""
    from specdec.serving import tensor_tree

    if path is None or not path.exists():
        return None
    try:
        tree = tensor_tree.load(path, classes)
    except Exception:  # noqa: BLE001 - a cache: build the weights again
        log.warning("could not read the built weights %s; building them again", path, exc_info=True)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None
    with contextlib.suppress(OSError):  # a read-only cache is still read
        path.touch()  # recently used: kept when others are dropped
    return tree


def _mtime_ns(f: Path) -> int:
    try:
        return f.stat().st_mtime_ns
    except FileNotFoundError:  # dropped meanwhile by another process
        return 0


def keep_built(path: Path | None, tree, classes: dict[str, type]) -> None:
    """Write `tree` to `path` and drop the least recently used files beyond MAX_BUILT. Never raises."""
    from specdec.serving import tensor_tree

    if path is None:
        return
    try:
        models.write_atomically(path, tensor_tree.dumps(tree, classes))
        built = sorted(path.parent.glob("built-*.safetensors"), key=_mtime_ns, reverse=True)
        for old in built[MAX_BUILT:]:
            old.unlink(missing_ok=True)
    except Exception:  # noqa: BLE001 - the load itself has succeeded; the next one builds again
        log.warning("could not keep the built weights in %s", path, exc_info=True)
