"""Where the int4 draft's disagreement with the fp32 target comes from (BENCHMARKS §6q): a simulation.

    python scripts/activation_rounding_sim.py [PROMPTS=12]

The fp32 target runner, with its matmuls' activations fake-quantized (each row's groups of 32
rounded to 255 levels, int8, or 65,535, int16: what specdec's VNNI kernels multiply), in the
decoder layers ("body") and in the output head, and optionally the head's weights requantized
with one scale per vocabulary row (the former int8 head). The shipped weights stay exact (the
Q4_1 codes and Q8_0 head are the target's own values). Top-1 agreement with the plain fp32
target over the positions of seed-0 prompts, 4 tokens a step; the real int4 draft alongside.
"""
import sys, json
sys.path.insert(0, ".")
import torch
from specdec import hf_compat, models
from specdec.lab.steps import VARIANTS, argmax_per_position, load
from specdec.lab.workloads import mixed_workload
from specdec.serving import paged_llama as pl
torch.set_num_threads(2)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 8

def fq(x, G=32, L=127):
    t, k = x.shape
    g = x.float().reshape(t, k // G, G)
    s = g.abs().amax(-1, keepdim=True) / L
    q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0)
    return (q * s).reshape(t, k)

orig_linear = pl.linear
MODE = {"body": None, "head": None}
head_ids = set(); kind = {}
def linear(x, w, bias=None):
    is_head = id(w) in head_ids
    m = MODE["head"] if is_head else MODE["body"]
    if m is not None:
        L = m.get(kind.get(id(w)), m.get("*"))
        if L: x = fq(x, 32, L)
    if is_head and MODE.get("rowq"):
        return x @ WROWQ
    return orig_linear(x, w, bias)
pl.linear = linear

target = load(VARIANTS["torch-fp32"], models.DEFAULT_TARGET_MODEL, 2)
w = target.weights
head_ids.update({id(w.lm_head), id(w.small_head)})
P = w.lm_head.panels
W = P.permute(1, 0, 2).reshape(P.shape[1], -1)  # [in, out]
sc = (W.abs().amax(0, keepdim=True) / 127)
WROWQ = (torch.round(W / sc).clamp(-127, 127) * sc.bfloat16().float())
for lw in w.layers:
    for nm in ("qkv", "o", "gate_up", "down"): kind[id(getattr(lw, nm))] = nm
draft = load(VARIANTS["torch-int4-x8"], models.DEFAULT_DRAFT_MODEL, 2)  # the 8-bit draft of §6p
print("cpu_kernels", getattr(target, "c_attention", None), type(w.lm_head), file=sys.stderr)


tok = models.load_tokenizer(models.resolve(models.DEFAULT_TARGET_MODEL))
A = {"*": 127}
H = {"*": 32767}
variants = {"int8 all": (A, A, False), "int8 all, head rowq": (A, A, True), "int16 all": (H, H, False),
 "int16 body, head int8": (H, A, False), "int16 qkv+down, head int16": ({"*": 127, "qkv": 32767, "down": 32767}, H, False),
 "int16 all, head rowq": (H, H, True)}
agree = dict.fromkeys(list(variants) + ["draft (int4, 8-bit activations, int8 head)"], 0); n = 0
for p in mixed_workload(N, 0):
    ids = hf_compat.chat_token_ids(tok, p.messages)[:400]
    MODE.update(body=None, head=None, rowq=False)
    ref = argmax_per_position(target, ids)
    for name, (b, h, r) in variants.items():
        MODE.update(body=b, head=h, rowq=r)
        agree[name] += int((argmax_per_position(target, ids) == ref).sum())
    MODE.update(body=None, head=None, rowq=False)
    agree["draft (int4, 8-bit activations, int8 head)"] += int((argmax_per_position(draft, ids) == ref).sum())
    n += len(ids)
    print(n, {k: round(v / n, 4) for k, v in agree.items()}, file=sys.stderr, flush=True)
print(json.dumps({"positions": n, "agreement": {k: round(v / n, 4) for k, v in agree.items()}}))
