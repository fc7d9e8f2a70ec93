#!/usr/bin/env bash
# Build llama.cpp's own speculative-decoding example (the "llama.cpp speculative" peer)
# from the llama.cpp sources vendored in the llama-cpp-python sdist, pinned to the same
# version as the installed Python binding.
#
# Idempotent: a second run with the binaries in place does nothing. Everything lives
# outside the repo, under $SPECDEC_CACHE_DIR/llamacpp-peer (default ~/.cache/specdec/...):
#   sdist/   the downloaded llama-cpp-python sdist
#   src/     its unpacked tree (vendor/llama.cpp is the CMake project)
#   build/   the CMake build folder
#   bin/     llama-speculative, llama-speculative-simple, llama-quantize, llama-server (copies)
#
# Only the needed targets are built, statically linked, Release, with -DGGML_NATIVE=ON.
# On this 2-core machine with -j2 the build takes ~5-6 min (measured); set JOBS to change.
#
# Usage: scripts/build_llamacpp_peer.sh [--force]
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="${SPECDEC_CACHE_DIR:-$HOME/.cache/specdec}/llamacpp-peer"
JOBS="${JOBS:-2}"
TARGETS=(llama-speculative llama-speculative-simple llama-quantize llama-server)
# native, but without AMX: some virtual machines advertise AMX yet trap its tile instructions
# (the same flags as scripts/install.sh uses for llama-cpp-python)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

if [[ "${1:-}" != "--force" ]]; then
  ok=1
  for t in "${TARGETS[@]}"; do [[ -x "$ROOT/bin/$t" ]] || ok=0; done
  [[ "$(cat "$ROOT/bin/VERSION" 2>/dev/null)" == "$VERSION $NO_AMX" ]] || ok=0
  if [[ $ok == 1 ]]; then
    echo "llama.cpp peer already built in $ROOT/bin"
    exit 0
  fi
fi

mkdir -p "$ROOT/sdist" "$ROOT/bin"
SDIST="$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  echo "downloading llama-cpp-python==$VERSION sdist"
  python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$ROOT/sdist"
fi

SRC="$ROOT/src/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
  echo "unpacking $SDIST"
  rm -rf "$ROOT/src" && mkdir -p "$ROOT/src"
  tar xzf "$SDIST" -C "$ROOT/src"
fi

BUILD="$ROOT/build"
start=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# LLAMA_CURL is deprecated in this llama.cpp version (only a warning); LLAMA_OPENSSL is what
# would pull a network dependency now, so it is turned off as well.
cmake -S "$LLAMA" -B "$BUILD" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_SERVER=ON \
  -DCMAKE_C_FLAGS="$NO_AMX" \
  -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DLLAMA_BUILD_APP=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"

for t in "${TARGETS[@]}"; do
  cp -f "$(find "$BUILD/bin" -maxdepth 1 -name "$t" -type f | head -1)" "$ROOT/bin/$t"
done
echo "$VERSION $NO_AMX" > "$ROOT/bin/VERSION"
echo "built ${TARGETS[*]} into $ROOT/bin in $(( $(date +%s) - start )) s"
