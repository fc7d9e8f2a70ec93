"""Per-process placement: CPU cores and threads, or a GPU memory cap.

On CPU each service pins itself to its own cores so that the draft and the target really
run in parallel; on a GPU each service caps its own share of device memory.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def parse_int_ranges(spec: str | None) -> list[int]:
    """"0", "1-3", "0,2,5-6" -> the listed integers, ranges inclusive; None/"" -> []."""
    out: list[int] = []
    for part in str(spec or "").split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def parse_cores(spec: str | None) -> list[int] | None:
    """Core ids to pin to; None/"" -> None (no pinning)."""
    return parse_int_ranges(spec) or None


def default_draft_engine(device: str) -> str:
    """The draft engine that is fastest for a draft placed on `device` (measured; README,
    "Choosing the defaults"): the paged torch runner (int4 weights on CPU, bf16 on a GPU) on a
    GPU or where torch's CPU int4 kernel has AVX-512 (a draft step of 22.5 ms, and 8 sequences'
    step 50.8 against llama.cpp's 111.9); elsewhere llama.cpp on the GGUF as shipped, since on an
    AVX2-only CPU torch's int4 step costs 42.6 ms against llama.cpp's 22.2, batches no better
    (8 x 1: 187 against 182 ms) and prefills at 10 ms a token (BENCHMARKS.md §6a). A draft set to
    run on the CPU of a GPU host is judged by that CPU."""
    if resolve_device(device).startswith("cuda"):
        return "torch"
    import torch

    return "torch" if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else "llamacpp"


def resolve_draft_engine(engine: str, device: str) -> str:
    """A draft config's engine, "auto" (the default) resolved for its device."""
    return default_draft_engine(device) if engine == "auto" else engine


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def configure_process(device: str, cpu_cores: str | None, num_threads: int, gpu_memory_fraction: float) -> dict:
    """Apply placement; returns what was applied (for logs and /metrics)."""
    import torch

    applied: dict = {"device": device}
    cores = parse_cores(cpu_cores)
    if cores:
        available = os.sched_getaffinity(0)
        usable = [c for c in cores if c in available] or sorted(available)
        os.sched_setaffinity(0, usable)
        applied["cpu_cores"] = usable
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    applied["num_threads"] = torch.get_num_threads()
    if device.startswith("cuda") and gpu_memory_fraction > 0:
        torch.cuda.set_per_process_memory_fraction(gpu_memory_fraction)
        applied["gpu_memory_fraction"] = gpu_memory_fraction
    log.info("placement: %s", applied)
    return applied


def kv_pool_tokens_for_memory(share_bytes: int, weight_bytes: int, kv_bytes_per_token: int,
                              activation_reserve: float, block_size: int) -> int:
    """KV pool tokens (whole blocks) that fit in a process's share of GPU memory: the share, less
    `activation_reserve` of it (activations, CUDA graphs' buffers, allocator slack), less the
    weights. Raises ValueError when not one block fits (the share is too small for the model)."""
    if share_bytes <= 0:
        raise ValueError("kv_pool_tokens = 0 sizes the pool from gpu_memory_fraction, which is not set")
    if not 0 <= activation_reserve < 1:
        raise ValueError(f"gpu_activation_reserve must be in [0, 1), got {activation_reserve}")
    free = int(share_bytes * (1 - activation_reserve)) - weight_bytes
    blocks = free // (kv_bytes_per_token * block_size)
    if blocks < 1:
        raise ValueError(f"this process's share of GPU memory ({share_bytes / 2**30:.2f} GiB, less "
                         f"{activation_reserve:.0%} reserved) does not hold the weights ({weight_bytes / 2**30:.2f} "
                         f"GiB) and one KV block: raise gpu_memory_fraction")
    return int(blocks) * block_size


def gpu_share_bytes(device: str, gpu_memory_fraction: float) -> int:
    """This process's share of its GPU's memory (0 off a GPU or without a fraction)."""
    if not device.startswith("cuda") or gpu_memory_fraction <= 0:
        return 0
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory * gpu_memory_fraction)


def process_memory_bytes(device: str = "cpu") -> dict:
    """RSS (and its peak) on CPU; allocator current/peak on a GPU."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    out["rss_bytes"] = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    out["peak_rss_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if device.startswith("cuda"):
        import torch

        out["gpu_allocated_bytes"] = int(torch.cuda.memory_allocated())
        out["gpu_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        out["gpu_peak_reserved_bytes"] = int(torch.cuda.max_memory_reserved())  # what the caching allocator holds
    return out
