"""Could a layer-skipping draft (the target itself with some decoder layers left out: Draft &
Verify, LayerSkip, SWIFT) raise the ceiling of issue 11's ratio? It would cost fewer bytes a
step than the int4 draft, but only pays if it still agrees with the target nearly everywhere
(the int4 draft agrees at every position, acceptance 0.99).

For ShareGPT + HumanEval prompts, the fp32 target's 64 greedy tokens (transformers generate),
then one teacher-forced forward of the same model with the given layers skipped: the share of
positions whose argmax equals the target's token.

    PYTHONPATH=. python scripts/layer_skip_probe.py [--prompts 8]

Then each single layer left out alone, and the best of them.
"""
from __future__ import annotations

import argparse

import torch

from specdec import hf_compat, models
from specdec.lab.workloads import mixed_workload

SKIPS = ([], [27], [25, 27], list(range(24, 28)), list(range(22, 28)), list(range(20, 28)),
         list(range(4, 28, 3)), list(range(2, 29, 2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    src = models.resolve(models.DEFAULT_TARGET_MODEL)
    model, tok = models.load_model(src), models.load_tokenizer(src)
    layers, num_layers = model.model.layers, model.config.num_hidden_layers
    with torch.inference_mode():
        runs = []
        for p in mixed_workload(args.prompts):
            ids = hf_compat.chat_token_ids(tok, p.messages)
            out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)  # [1, len(ids) + tokens]
            runs.append((len(ids), out))
        def agreement(skip: list[int]) -> float:
            keep = [i for i in range(num_layers) if i not in skip]
            model.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
            model.config.num_hidden_layers = len(keep)
            agree = total = 0
            for n, out in runs:
                pred = model(out, use_cache=False).logits[0, n - 1:-1].argmax(-1)  # [tokens]
                agree += int((pred == out[0, n:]).sum())
                total += out.shape[1] - n
            model.model.layers, model.config.num_hidden_layers = layers, num_layers
            return agree / total

        for skip in SKIPS:
            print(f"{len(skip):2d} of {num_layers} layers skipped {skip}: agreement {agreement(skip):.3f}", flush=True)
        single = {i: agreement([i]) for i in range(num_layers)}
        print("one layer skipped, by layer:", " ".join(f"{i}:{a:.2f}" for i, a in single.items()))
        best = max(single, key=single.get)
        print(f"best single layer to skip: {best}, agreement {single[best]:.3f}")


if __name__ == "__main__":
    main()
