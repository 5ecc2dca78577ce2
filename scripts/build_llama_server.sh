#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) and its tools once, as a serving peer for benchmarks
# (benchmarks/serve_peers.sh, docs/benchmarks/2026-12-05-serve-peers.md). The source is the
# llama.cpp that llama-cpp-python's source package vendors (PyPI: no other download).
#
#   bash scripts/build_llama_server.sh [DEST]   # default ../peers/llama.cpp beside the checkout
#
# About 16 minutes on 2 shared cores (JOBS=2, run at nice 10); the binaries land in DEST/build/bin.
# The embedded web UI is off: its default setting downloads files at build time.
set -euo pipefail
DEST=${1:-../peers/llama.cpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
if [ ! -f "$DEST/CMakeLists.txt" ]; then
    tmp=$(mktemp -d)
    python -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    tar -xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp"
    mkdir -p "$(dirname "$DEST")"
    mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DEST"
    rm -rf "$tmp"
fi
cd "$DEST"
cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
nice -n 10 cmake --build build -j"$JOBS" --target llama-server llama-bench llama-batched-bench llama-quantize llama-perplexity llama-imatrix
ls -l build/bin/llama-server build/bin/llama-quantize
