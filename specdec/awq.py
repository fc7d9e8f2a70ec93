"""INT4 AWQ checkpoints in compressed-tensors' W4A16 format (`specdec quantize`).

The intent of AutoAWQ (deprecated, not importable with transformers >= 4.57) kept through a
maintained library: the checkpoint is what llm-compressor's `AWQModifier` writes and what
transformers (`CompressedTensorsHfQuantizer`) and vLLM load, a Hugging Face directory whose
decoder Linear layers are stored `pack-quantized` by compressed-tensors (int4 codes packed
into int32 `weight_packed`, `weight_scale` per group, `weight_zero_point` when asymmetric),
and whose config.json carries the compressed-tensors `quantization_config`. compressed-tensors
does the quantization grid (`calculate_qparams`, `fake_quantize`), the packing and the
config; this module does AWQ's activation-aware scale search, which lives in llm-compressor,
itself not installable next to our pinned transformers (it pins transformers <= 5.17).

AWQ (Lin et al., 2023): before rounding, scale each input channel of a group of Linear layers
by s and fold 1/s into what feeds them (an RMSNorm's weight, or the rows of the previous
Linear), so that the channels that carry large activations lose less to rounding. Per
mapping, s = mean|x|^alpha (normalised to a geometric mean of 1), alpha on a grid in [0, 1),
chosen to minimise the output error on calibration activations:

    || x @ (Q(W * s) / s)^T - x @ W^T ||^2        x [N, in], W [out, in]

alpha = 0 is s = 1, plain round-to-nearest, so the chosen s never does worse than it on the
calibration set. The mappings of a Llama-family layer (llm-compressor's default ones):
input_layernorm -> q/k/v, v_proj -> o_proj (only without GQA: shapes must match),
post_attention_layernorm -> gate/up, up_proj -> down_proj. Activations are captured in one
forward of the float model over the calibration tokens: the scaling is exact in real
arithmetic, so each layer sees the same inputs as it would after the earlier layers were
scaled. Weight clipping search (AWQ's second step) is not done.

The search is pure (`search_scale`); `awq_quantize` drives it over a model and `save_checkpoint`
writes the directory. The services load the result as any model directory (`target.model`);
the paged runner then reads the 4-bit codes as they are (specdec/serving/paged_llama.py).
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec import hf_compat

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AwqSettings:
    """How a model is quantized (compressed-tensors W4A16, group strategy)."""

    group_size: int = 32  # inputs per scale; 32 divides every Llama-family width here (SmolLM2: 576)
    # zero points per group (llm-compressor's W4A16_ASYM): on the default model 0.86 next-token agreement
    # with fp32 against 0.81 symmetric (BENCHMARKS.md §7); symmetric is reproduced exactly by our int4
    symmetric: bool = False
    grid: int = 20  # alpha in {0, 1/grid, ..., (grid-1)/grid}
    max_calibration_tokens: int = 4096
    loss_tokens: int = 512  # the search's output error is measured on at most this many of them (evenly spaced)


@dataclass
class MappingResult:
    """One mapping's search: the loss with s = 1 (round-to-nearest) and with the chosen s."""

    layer: int
    name: str  # e.g. "input_layernorm->q_proj,k_proj,v_proj"
    alpha: float
    rtn_loss: float
    awq_loss: float


@dataclass
class AwqReport:
    settings: AwqSettings
    calibration_tokens: int
    mappings: list[MappingResult] = field(default_factory=list)

    @property
    def rtn_loss(self) -> float:
        return sum(m.rtn_loss for m in self.mappings)

    @property
    def awq_loss(self) -> float:
        return sum(m.awq_loss for m in self.mappings)


# ----------------------------------------------------------------------------------------
# the pure part
# ----------------------------------------------------------------------------------------
def fake_quantize(w: torch.Tensor, settings: AwqSettings) -> torch.Tensor:
    """w [out, in] -> its int4 round trip on compressed-tensors' grid (groups of group_size inputs)."""
    scale, zero = hf_compat.ct_qparams(w, settings.group_size, settings.symmetric)  # [out, in/G] each
    return hf_compat.ct_fake_quantize(w, scale, zero, settings.group_size, settings.symmetric)


@torch.no_grad()
def search_scale(x: torch.Tensor, weights: list[torch.Tensor], settings: AwqSettings
                 ) -> tuple[torch.Tensor, float, float, float]:
    """x [N, in] calibration inputs of the Linear layers `weights` (each [out_i, in], float32).

    Returns (s [in], alpha, loss with s = 1, loss with s): the loss is the mean squared error
    of all outputs, (x / s) @ Q(W * s)^T against x @ W^T."""
    x = x.float()
    x_mean = x.abs().mean(0)  # [in]: from every calibration token
    if x.shape[0] > settings.loss_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, settings.loss_tokens).long()]  # [loss_tokens, in]
    w = torch.cat(weights).float()  # [sum out, in]
    reference = x @ w.t()  # [N, sum out]
    best = (torch.ones_like(x_mean), 0.0, float("inf"))
    rtn = float("nan")
    for i in range(settings.grid):
        alpha = i / settings.grid
        s = x_mean.pow(alpha).clamp(min=1e-4)  # [in]
        s = s / (s.max() * s.min()).sqrt()
        if alpha == 0:
            s = torch.ones_like(x_mean)
        out = x @ (fake_quantize(w * s, settings) / s).t()  # [N, sum out]
        loss = float((out - reference).pow(2).mean())
        if alpha == 0:
            rtn = loss
        if loss < best[2]:
            best = (s, alpha, loss)
    return best[0], best[1], rtn, best[2]


# ----------------------------------------------------------------------------------------
# over a model
# ----------------------------------------------------------------------------------------
def _capture_inputs(model: torch.nn.Module, token_ids: list[list[int]]) -> dict[str, torch.Tensor]:
    """Inputs of every decoder layer's q_proj, o_proj, gate_proj and down_proj over the
    calibration sequences: {'<layer>.q': [N, hidden], ...}, float32 on the CPU."""
    layers = model.get_decoder().layers
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(layers):
        for key, mod in (("q", layer.self_attn.q_proj), ("o", layer.self_attn.o_proj),
                         ("gate", layer.mlp.gate_proj), ("down", layer.mlp.down_proj)):
            def hook(_m, args, name=f"{i}.{key}"):
                seen.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            for ids in token_ids:
                model(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {k: torch.cat(v) for k, v in seen.items()}


@torch.no_grad()
def _scale_inputs_of(linears: list[torch.nn.Linear], s: torch.Tensor) -> None:
    for m in linears:
        m.weight.mul_(s.to(m.weight.dtype))  # columns: [out, in] * [in]


@torch.no_grad()
def _divide_outputs_of(prev: torch.nn.Module, s: torch.Tensor) -> None:
    """prev: an RMSNorm (weight [in]) or a Linear (weight [in, prev in], bias [in])."""
    if isinstance(prev, torch.nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))


@torch.no_grad()
def awq_quantize(model: torch.nn.Module, token_ids: list[list[int]], settings: AwqSettings = AwqSettings()
                 ) -> AwqReport:
    """Search and fold AWQ scales into a float Llama-family model, in place (the model stays
    float: `save_checkpoint` rounds it). token_ids: calibration sequences."""
    budget, kept = settings.max_calibration_tokens, []
    for ids in token_ids:
        if budget <= 0:
            break
        kept.append(ids[:budget])
        budget -= len(kept[-1])
    report = AwqReport(settings, sum(map(len, kept)))
    acts = _capture_inputs(model, kept)
    for i, layer in enumerate(model.get_decoder().layers):
        attn, mlp = layer.self_attn, layer.mlp
        mappings = [("input_layernorm", layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "q"),
                    ("post_attention_layernorm", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "gate"),
                    ("up_proj", mlp.up_proj, [mlp.down_proj], "down")]
        if attn.v_proj.weight.shape[0] == attn.o_proj.weight.shape[1]:  # no GQA: v's outputs are o's inputs
            mappings.insert(1, ("v_proj", attn.v_proj, [attn.o_proj], "o"))
        for prev_name, prev, linears, key in mappings:
            s, alpha, rtn, loss = search_scale(acts[f"{i}.{key}"], [m.weight for m in linears], settings)
            _divide_outputs_of(prev, s)
            _scale_inputs_of(linears, s)
            names = ",".join(n for n, m in (("q_proj", attn.q_proj), ("k_proj", attn.k_proj), ("v_proj", attn.v_proj),
                                             ("o_proj", attn.o_proj), ("gate_proj", mlp.gate_proj),
                                             ("up_proj", mlp.up_proj), ("down_proj", mlp.down_proj))
                             if any(m is x for x in linears))
            report.mappings.append(MappingResult(i, f"{prev_name}->{names}", alpha, rtn, loss))
    log.info("AWQ: %d mappings over %d calibration tokens; output error %.4g (round-to-nearest %.4g)",
             len(report.mappings), report.calibration_tokens, report.awq_loss, report.rtn_loss)
    return report


def save_checkpoint(model: torch.nn.Module, tokenizer, out: Path, settings: AwqSettings,
                    report: AwqReport | None = None) -> Path:
    """Write `model` (float, AWQ-scaled) as a compressed-tensors pack-quantized W4A16 directory:
    every decoder Linear in 4 bits, the output head and embeddings as they are."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_compat.ct_save_w4a16(model, tmp, settings.group_size, settings.symmetric, ignore=["lm_head"])
    tokenizer.save_pretrained(tmp)
    if report is not None:
        (tmp / "awq_report.json").write_text(json.dumps({
            "settings": settings.__dict__, "calibration_tokens": report.calibration_tokens,
            "output_error": {"awq": report.awq_loss, "round_to_nearest": report.rtn_loss},
            "mappings": [m.__dict__ for m in report.mappings]}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
