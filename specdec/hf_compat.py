"""Every transformers API that moves between versions is wrapped here, and only here.

Pinned: transformers 5.24 on this machine (the GPU image has 5.17). Decisions:
- the forward keyword for the KV cache is `cache=` in 5.24 and `past_key_values=` before;
  we look at the model's forward signature once and use whichever it takes;
- `DynamicCache.crop` takes only a negative count in 5.24 (absolute lengths before);
  `crop_cache(cache, n)` removes the last n entries with `crop(-n)`, guarded by n > 0,
  which means the same thing in both versions;
- GGUF-loaded models carry a quantizer that refuses `save_pretrained`; `plain_copy`
  rebuilds the dequantized model without it so that it can be cached on disk.

torch's private int4 weight-only matmul for CPU (`torch._weight_int4pack_mm_for_cpu`, the
kernel gpt-fast and torchao use on CPU) is also wrapped here: pinned torch 2.13; it takes
bf16 activations only (fp32 runs a reference path ~30x slower), and the CUDA op packs
differently, so `int4_pack`/`int4_matmul` are CPU-only. Its int8 sibling
(`torch._weight_int8pack_mm`, per-row scales, bf16 activations) is `int8_matmul`.

compressed-tensors (pinned 0.20.0; the format llm-compressor writes and transformers and vLLM
load) is used for INT4 AWQ checkpoints: its quantization grid (`calculate_qparams`,
`fake_quantize`), its packing (`PackedQuantizationCompressor`, `unpack_from_int32`) and its
`QuantizationConfig`; the `ct_*` functions are the only place that imports it.
"""
from __future__ import annotations

import inspect
import json
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: the orchestrator uses this module's tokenizer calls without torch
    import torch


@lru_cache(maxsize=None)
def _cache_kwarg(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_dynamic_cache(model: torch.nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older signature
        return DynamicCache()


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache) -> torch.Tensor:
    """input_ids: [1, n] -> logits [n, V] (float32), appending n entries to `cache`."""
    kw = {_cache_kwarg(type(model)): cache}
    out = model(input_ids=input_ids, use_cache=True, **kw)
    return out.logits[0].float()


def crop_cache(cache, n_remove: int) -> None:
    if n_remove > 0:
        cache.crop(-n_remove)


def plain_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh


def rope_type(config) -> str:
    """The model's RoPE variant ("default", "llama3", "linear", "yarn", "dynamic", ...).

    5.x keeps it in `config.rope_parameters["rope_type"]`; 4.x in `config.rope_scaling`
    (`rope_type`, or `type` in older files), where None means the default rotation.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type") or params.get("type") or "default")


def rope_tables(model: torch.nn.Module, positions: int, dtype: torch.dtype,
                device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [positions, head_dim] for positions 0..positions-1, in `dtype`.

    Computed by the model's own rotary module (one per decoder since 4.45, called as
    `rotary_emb(x, position_ids)` with x only giving dtype and device), so rope scaling
    variants (llama3, linear, yarn) come out exactly as the model applies them. Variants
    whose frequencies depend on the current sequence length (dynamic, longrope) are not
    position tables; callers must not use this for them.
    """
    import torch
    rotary = getattr(model.get_decoder(), "rotary_emb", None)
    if rotary is None:
        raise ValueError(f"{type(model).__name__} has no decoder-level rotary_emb")
    pos = torch.arange(positions, device=device).unsqueeze(0)  # [1, P]
    x = torch.zeros(1, dtype=dtype, device=device)  # dtype/device carrier only
    with torch.no_grad():
        cos, sin = rotary(x, pos)  # each [1, P, D]
    return cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous()  # each [P, D]


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a chat rendered with the tokenizer's template and a generation prompt.

    `apply_chat_template(tokenize=True)` returns a BatchEncoding in 5.x and a list before.
    """
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The same chat rendered as text (what a text-prompt peer such as llama.cpp is given)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# -- torch's private int4 / int8 weight-only ops (CPU) -----------------------------------------------------------------
def int4_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes [out, in] int32 in 0..15 -> torch's packed CPU int4 layout (opaque)."""
    import torch
    return torch._convert_weight_to_int4pack_for_cpu(codes, 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 @ the packed weight, w = (q - 8) * scale + zero per group of `group` rows
    of `in`; scales_zeros [in/group, out, 2] bf16 -> [T, out] bf16."""
    import torch
    return torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_zeros)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [T, in] bf16 @ an int8 weight stored [out, in], w = code * scale per output row;
    scales [out] bf16 -> [T, out] bf16 (torch's private weight-only int8 op)."""
    import torch
    return torch._weight_int8pack_mm(x, codes, scales)


# -- compressed-tensors (INT4 W4A16 checkpoints: specdec/awq.py writes them, the paged runner reads them) --
CT_DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
CT_SCALE_DTYPE = "bfloat16"  # the checkpoint's scales: what the paged runner's int4 kernel takes, exactly


def _ct_args(group_size: int, symmetric: bool):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=group_size)


def ct_qparams(w: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> compressed-tensors' min/max scale and zero point per group, [out, in/G] each
    (scale rounded to CT_SCALE_DTYPE and back, so codes are computed with the scale that is stored)."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    out, k = w.shape
    if k % group_size:
        raise ValueError(f"{k} input features are not a multiple of the group size {group_size}")
    groups = w.detach().float().reshape(out, k // group_size, group_size)  # [out, in/G, G]
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), _ct_args(group_size, symmetric))
    return scale.to(getattr(torch, CT_SCALE_DTYPE)).float(), zero  # [out, in/G] float32, [out, in/G] int8


def ct_fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                     symmetric: bool) -> torch.Tensor:
    """w [out, in] -> its int4 round trip (compressed-tensors' quantize then dequantize)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    return fake_quantize(w.float(), scale, zero, _ct_args(group_size, symmetric))


def ct_save_w4a16(model: torch.nn.Module, out: Path, group_size: int, symmetric: bool, ignore: list[str]) -> None:
    """Write a float HF model as a compressed-tensors `pack-quantized` W4A16 directory: the decoder
    layers' Linear weights packed by compressed-tensors' own compressor, the rest in bfloat16; the
    config's `quantization_config` as llm-compressor writes it (compressed-tensors' QuantizationConfig)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from safetensors.torch import save_file

    import compressed_tensors

    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args(group_size, symmetric))
    linears = {f"model.layers.{i}.{name}" for i in range(len(model.get_decoder().layers)) for name in CT_DECODER_LINEARS}
    state: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module in linears and leaf == "weight":
            scale, zero = ct_qparams(t, group_size, symmetric)
            packed = PackedQuantizationCompressor.compress(
                {"weight": t.float(), "weight_scale": scale, "weight_zero_point": zero}, scheme)
            state.update({f"{module}.{k}": v.to(getattr(torch, CT_SCALE_DTYPE)) if k == "weight_scale" else v
                          for k, v in packed.items()})
        elif not (name == "lm_head.weight" and model.config.tie_word_embeddings):
            state[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config["dtype"] = "bfloat16"
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=ignore,
                              quantization_status="compressed")
    config["quantization_config"] = {"quant_method": "compressed-tensors", "version": compressed_tensors.__version__,
                                     **json.loads(qcfg.model_dump_json(exclude={"quant_method"}))}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def ct_dequantize_config():
    """from_pretrained's quantization_config for a compressed-tensors checkpoint loaded dense
    (weights dequantized once at load by compressed-tensors)."""
    from transformers import CompressedTensorsConfig

    return CompressedTensorsConfig(dequantize=True)


def ct_w4a16_settings(config) -> tuple[int, bool] | None:
    """(group_size, symmetric) when a HF config is a compressed-tensors pack-quantized int4 group
    checkpoint of the decoder Linears (what ct_save_w4a16 and llm-compressor's W4A16 write); else None."""
    q = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    q = q if isinstance(q, dict) else (q.to_dict() if q is not None and hasattr(q, "to_dict") else None)
    if not q or q.get("quant_method") != "compressed-tensors" or q.get("format") != "pack-quantized":
        return None
    groups = list((q.get("config_groups") or {}).values())
    if len(groups) != 1:
        return None
    w = groups[0].get("weights") or {}
    if w.get("num_bits") != 4 or w.get("type") != "int" or w.get("strategy") != "group":
        return None
    return int(w["group_size"]), bool(w.get("symmetric", True))


def ct_read_w4a16(directory: Path, module: str, group_size: int, symmetric: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Linear of a pack-quantized checkpoint: (codes [out, in] int8 in -8..7, scale [out, in/G],
    zero point [out, in/G] int8), unpacked by compressed-tensors."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    t = _ct_tensors(directory, module)
    shape = torch.Size(t["weight_shape"].tolist())
    codes = unpack_from_int32(t["weight_packed"], 4, shape)  # [out, in]
    scale = t["weight_scale"]  # [out, in/G]
    if symmetric:
        zero = torch.zeros(scale.shape, dtype=torch.int8)
    else:
        zero = unpack_from_int32(t["weight_zero_point"], 4, torch.Size((shape[0], scale.shape[1])), packed_dim=0)
    return codes, scale, zero


@lru_cache(maxsize=4)
def _ct_key_files(directory: Path) -> dict[str, str]:
    """Every tensor name of a checkpoint -> the safetensors file holding it (read once per directory,
    not once per Linear: loading reads 7 Linears a layer)."""
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    with safe_open(str(directory / "model.safetensors"), framework="pt") as st:
        return {key: "model.safetensors" for key in st.keys()}


def _ct_tensors(directory: Path, module: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    mine = [(k, f) for k, f in _ct_key_files(Path(directory)).items() if k.startswith(module + ".")]
    for f in sorted({f for _, f in mine}):
        with safe_open(str(directory / f), framework="pt") as st:
            out.update({k[len(module) + 1:]: st.get_tensor(k) for k, g in mine if g == f})
    if "weight_packed" not in out:
        raise ValueError(f"{directory}: no packed weight for {module}")
    return out
