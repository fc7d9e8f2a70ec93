"""Is a runner batch-invariant between a verify and a decode? One sequence of 100 tokens, then
9 new tokens as one 9-token verify and, on a second sequence, as 9 one-token decodes; prints
the largest logit difference between the two:
    python scripts/batch_invariance_probe.py MODEL_SPEC DTYPE      # e.g. smollm2-135m-instruct float32
(an INT4 checkpoint from `specdec quantize` with DTYPE int4). One thread."""
import sys
sys.path.insert(0, ".")

import torch

from specdec.serving.batch import SeqChunk
from specdec.serving.paged_llama import PagedLlamaRunner

torch.set_num_threads(1)
spec, dtype = sys.argv[1], sys.argv[2]
r = PagedLlamaRunner.load(spec, dtype, "cpu", pool_tokens=1024, block_size=16, max_seqs=2)
prompt, new = list(range(1000, 1100)), list(range(2000, 2009))
a, b = r.blocks.reserve(200), r.blocks.reserve(200)
for s in (a, b):
    r.forward([SeqChunk(s, prompt, 0, 1)])
(verify,) = r.forward([SeqChunk(a, new, 100, 9)])  # [9, V]
decode = torch.cat([r.forward([SeqChunk(b, [t], 100 + i, 1)])[0] for i, t in enumerate(new)])  # [9, V]
print(f"{spec} {dtype}: verify vs decode, max |dlogit| {(verify.float() - decode.float()).abs().max().item():.3g}")
