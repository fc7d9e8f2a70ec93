"""The draft/orchestrator configurations the single-stream and load probes compare: name -> (section, field, value) overrides of the embedded defaults."""

CONFIGS = {  # name -> (section, field, value) overrides of the embedded defaults
    "k8": [("orchestrator", "default_k", 8)],
    "no-cut": [("orchestrator", "default_k", 8), ("orchestrator", "cut_speculation_on_miss", False)],  # as before §6i
    "bf16-head": [("draft", "int4_head", "bfloat16")],  # the int4 draft as it was before the int8 head
    "k2": [("orchestrator", "default_k", 2)],
    "k3": [("orchestrator", "default_k", 3)],
    "k4": [("orchestrator", "default_k", 4)],
    "k4-mkl": [("orchestrator", "default_k", 4), ("target", "cpu_kernels", "torch")],  # the fp32 target in MKL (before §6o)
    "k8-mkl": [("orchestrator", "default_k", 8), ("target", "cpu_kernels", "torch")],
    "adaptive-mkl": [("orchestrator", "default_k", 8), ("orchestrator", "adaptive_k", True), ("target", "cpu_kernels", "torch")],
    "k6": [("orchestrator", "default_k", 6)],
    "k7": [("orchestrator", "default_k", 7)],
    "adaptive": [("orchestrator", "default_k", 8), ("orchestrator", "adaptive_k", True)],
    "q8_0": [("draft", "engine", "llamacpp"), ("draft", "gguf_type", "q8_0")],
    "q4_1": [("draft", "engine", "llamacpp"), ("draft", "gguf_type", "")],
    "f16": [("draft", "engine", "llamacpp"), ("draft", "gguf_type", "f16")],
    # the int4 draft with 8-bit activations and the int8 head (the default before §6q)
    "x8": [("draft", "int4_head", "int8"), ("draft", "int4_activations", 8)],
    "x8-k12": [("draft", "int4_head", "int8"), ("draft", "int4_activations", 8), ("orchestrator", "default_k", 12)],
    # 16-bit activations and the shipped Q8_0 head
    "x16": [("draft", "int4_head", "q8_0"), ("draft", "int4_activations", 16)],
    "x16-k12": [("draft", "int4_head", "q8_0"), ("draft", "int4_activations", 16), ("orchestrator", "default_k", 12)],
    "x16-k16": [("draft", "int4_head", "q8_0"), ("draft", "int4_activations", 16), ("orchestrator", "default_k", 16)],
    "x16-adaptive": [("draft", "int4_head", "q8_0"), ("draft", "int4_activations", 16), ("orchestrator", "default_k", 16),
                     ("orchestrator", "adaptive_k", True)],
    # the orchestrator pinned to the target's core (0) or the draft's (1); unpinned by default
    "orch0": [("orchestrator", "cpu_cores", "0")],
    "orch1": [("orchestrator", "cpu_cores", "1")],
    # the target in float32 panels instead of its GGUF codes (the same logits; BENCHMARKS §6s)
    "panels": [("target", "cpu_kernels", "specdec-f32")],
}
