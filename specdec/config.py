"""One typed configuration for the three services, loadable from a TOML file.

    [target]                 # target_service
    model = "smollm2-135m-instruct"
    [draft]                  # draft_service
    engine = "llamacpp"
    [orchestrator]           # the public server
    default_k = 8

Every field has a default that runs the embedded default pair on this machine; the
CLI flags of `specdec up` and of each service override the file. `specdec tune` writes
such a file.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from specdec.errors import InvalidArgument
from specdec.models import DEFAULT_DRAFT_MODEL, DEFAULT_TARGET_MODEL


@dataclass
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0  # Prometheus /metrics over HTTP; 0 = off
    device: str = "cpu"  # cpu | cuda | auto
    cpu_cores: str = ""  # e.g. "0" or "0-1"; "" = no pinning
    num_threads: int = 1  # torch / llama.cpp threads
    gpu_memory_fraction: float = 0.0  # cap on this process's share of GPU memory; 0 = no cap
    max_sessions: int = 16
    # on SIGTERM: stop taking new sessions, give running ones this long to finish, then exit
    shutdown_grace_s: float = 5.0
    # TLS on this service's port: certificate chain and key (PEM files); "" = plaintext
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # with TLS: require client certificates signed by this CA (mTLS); "" = no client certificates
    tls_client_ca_file: str = ""


@dataclass
class ModelServiceConfig(ServiceConfig):
    """What the target and draft services share: a model in a fixed KV pool, stepped in batches."""

    engine: str = "torch"  # torch (the Llama-family paged runner, else transformers) | llamacpp (GGUF)
    model: str = DEFAULT_TARGET_MODEL  # packaged name, .gguf file or HF directory
    dtype: str = "float32"  # torch engine: float32 | bfloat16 | float16 | int4 (4-bit weights, bf16 activations; CPU)
    gguf_type: str = ""  # llamacpp engine: run the GGUF in f32 | f16 | q8_0 (a requantized copy, made once); "" = as shipped
    int4_head: str = "bfloat16"  # torch engine at dtype int4: bfloat16 head | int8 (also an int8 copy for steps of <= 4 logit rows) | q8_0
    # torch engine at dtype int4 in specdec's kernels: the 4-bit matmuls' and 8-bit head's activations, 8 | 16 bits
    int4_activations: int = 8
    # torch engine on the CPU: specdec = its own single-threaded kernels (specdec/serving/cpu_gemm.py) for
    # float32 weights (AVX2/AVX-512; a float32 matrix whose every value is a GGUF's Q4_1 or Q8_0 value, as in
    # a model dequantized from one, is read from those codes on AVX-512: the same results, a sixth of the
    # bytes) and for the int4 precision (AVX-512 VNNI), torch's where they cannot be built | specdec-f32 =
    # the same with every float32 matrix read as float32 (for comparison) | torch = torch's matmuls (MKL,
    # torch's int4 kernel). README "Choosing the defaults"
    cpu_kernels: str = "specdec"
    kv_pool_tokens: int = 16384  # the KV pool, allocated at startup: tokens over all sessions
    block_size: int = 16  # tokens per KV block
    max_step_tokens: int = 512  # tokens in one forward, all sessions together
    max_prefill_tokens: int = 128  # prompt tokens per step (longer prompts are prefilled in chunks)
    admission_wait_s: float = 10.0  # how long a new session waits for room in a full pool
    admission_queue: int = 64  # sessions that may wait at once; beyond, RESOURCE_EXHAUSTED at once
    # torch engine on a GPU: small steps (decodes, verifies) replayed as CUDA graphs, padded up to
    # these batch sizes and tokens per sequence; larger steps run eagerly
    cuda_graphs: bool = True
    cuda_graph_batches: str = "1,2,4,8,16"
    cuda_graph_tokens: str = "1,2,4,8,12,16"
    # on a GPU with gpu_memory_fraction set, kv_pool_tokens = 0 sizes the pool from the memory left
    # in this process's share after the weights, keeping this fraction of the share for activations
    # and graphs
    gpu_activation_reserve: float = 0.1
    # on the CPU, a model loaded once through transformers loads again from its load manifest (the same
    # tensors, checked equal when written; specdec/serving/stored_model.py) without importing transformers
    load_manifest: bool = True
    # with the load manifest, the runner keeps what it built from the model (matrices packed and
    # quantized for specdec's kernels) next to it, and a later start maps that back instead of building
    # it again (one file per set of build options, at most 3 per model; stored_model.keep_built)
    keep_built_weights: bool = True


@dataclass
class TargetConfig(ModelServiceConfig):
    port: int = 50052
    cpu_cores: str = "0"
    gguf_type: str = "f32"  # the same weights as the torch fp32 target (the shipped file, dequantized)
    kv_pool_tokens: int = 32768


@dataclass
class DraftConfig(ModelServiceConfig):
    port: int = 50053
    # auto | torch | llamacpp | ngram. auto (resolved by the draft service for its `device`): the
    # paged torch runner with 4-bit weights (int4 runs as bfloat16 on a GPU) where its batched step
    # scales (AVX-512 CPUs, GPUs), else llama.cpp on the shipped Q4_1 GGUF (AVX2-only CPUs):
    # devices.default_draft_engine, README "Choosing the defaults"
    engine: str = "auto"
    dtype: str = "int4"  # torch engine
    # the shipped Q8_0 head as stored (half the bytes of bf16) and 16-bit activations: the int4 draft then
    # agrees with the fp32 target on 862 of 862 next tokens, against 96.5% at int8 / 8 bits, for the
    # same one-token step time (BENCHMARKS §6q)
    int4_head: str = "q8_0"
    int4_activations: int = 16
    model: str = DEFAULT_DRAFT_MODEL
    cpu_cores: str = "1"
    admission_wait_s: float = 0.0  # a full draft does not queue: the request runs target-only
    max_support: int = 64  # cap on the sparse draft distribution per token
    ngram_max: int = 4
    ngram_min: int = 1


@dataclass
class OrchestratorConfig(ServiceConfig):
    port: int = 50051
    # target replicas: "host:port", several "host:port,host:port", or a DNS name that resolves to
    # several addresses (a Kubernetes headless Service); each session goes to the least loaded
    target_address: str = "127.0.0.1:50052"
    draft_address: str = "127.0.0.1:50053"  # the same forms; "" = no draft service
    # a replica whose call failed is not offered new sessions for this long (outlier ejection)
    replica_ejection_s: float = 10.0
    # bearer token clients must send ("authorization: Bearer <token>"), read from this file;
    # "" = no authentication
    auth_token_file: str = ""
    # TLS to the target and draft services: the CA that signed their certificates ("" = plaintext),
    # and this orchestrator's client certificate and key when they require one (mTLS)
    upstream_tls_ca_file: str = ""
    upstream_tls_cert_file: str = ""
    upstream_tls_key_file: str = ""
    # limits on one request (INVALID_ARGUMENT beyond them)
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompt_tokens: int = 32768
    max_stop_strings: int = 8
    max_stop_string_chars: int = 128
    default_k: int = 8  # a request's k when it sets none (0); with adaptive_k, the most a round drafts
    max_k: int = 32
    # choose each round's k, up to the request's, from the measured draft and verify costs and the
    # request's acceptance so far (specdec/kchoice.py); k = 0 rounds when drafting does not pay
    adaptive_k: bool = False
    # draft tokens per round that all requests speculating at once may ask for together: with n of
    # them, each one's k is min(k, budget // n), and 0 (rounds without drafts) when that is under 2,
    # for a draft whose batched step does not scale (the llama.cpp Q4_1 draft on this CPU: 8 there);
    # 0 = no limit, the default: the int4 torch draft batches (BENCHMARKS.md §6)
    draft_token_budget: int = 0
    # pipelined: when the target rejects a draft, stop the speculation running on the draft (it
    # builds on the rejected draft) after its current step, so the next round's drafts start at
    # once; false = let it run to its end and throw it away (as before; BENCHMARKS.md §6i)
    cut_speculation_on_miss: bool = True
    default_mode: str = "pipelined"  # pipelined | sequential | target-only
    # draft sampling when a sampled request sets none; < 0 = the target's own temperature/top-k/top-p
    # (measured best for the default pair: BENCHMARKS.md, "Sampled requests")
    default_draft_temperature: float = -1.0
    default_draft_top_k: int = 0
    default_draft_top_p: float = 1.0
    probe_interval_s: float = 1.0  # how often the target and draft are probed (health, draft re-attach)
    rpc_timeout_s: float = 60.0
    max_sessions: int = 64


@dataclass
class SpecdecConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)

    @classmethod
    def load(cls, path: str | Path | None) -> "SpecdecConfig":
        cfg = cls()
        if path:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            unknown = set(data) - {"target", "draft", "orchestrator"}
            if unknown:
                raise InvalidArgument(f"{path}: unknown section(s) {sorted(unknown)}")
            for section, values in data.items():
                apply_overrides(getattr(cfg, section), values, f"{path}: [{section}]")
        return cfg

    def to_toml(self) -> str:
        lines: list[str] = []
        for section in ("target", "draft", "orchestrator"):
            lines.append(f"[{section}]")
            for f in fields(getattr(self, section)):
                lines.append(f"{f.name} = {_toml_value(getattr(getattr(self, section), f.name))}")
            lines.append("")
        return "\n".join(lines)


def apply_overrides(obj: Any, values: dict, where: str = "") -> None:
    """Set dataclass fields from a dict, checking names and types."""
    names = {f.name: f for f in fields(obj)}
    for key, value in values.items():
        if value is None:
            continue
        if key not in names:
            raise InvalidArgument(f"{where} unknown setting {key!r}; known: {sorted(names)}")
        current = getattr(obj, key)
        if isinstance(current, bool) or not isinstance(current, (int, float, str)):
            setattr(obj, key, value)
        elif isinstance(current, float) and isinstance(value, (int, float)):
            setattr(obj, key, float(value))
        elif type(current) is not type(value):
            raise InvalidArgument(f"{where} {key} must be {type(current).__name__}, got {value!r}")
        else:
            setattr(obj, key, value)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
