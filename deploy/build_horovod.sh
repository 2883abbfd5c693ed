#!/usr/bin/env bash
# Build horovod 0.28.1 (CPU, gloo, PyTorch only) from its sdist against the installed torch, and
# cache the wheel under a folder named by the sdist's sha256, so a cached wheel is always the one
# built from the pinned bytes (another pin, another folder):
#   ${CKPTD_CACHE:-~/.cache/ckptd}/horovod-<sdist sha256>/horovod-0.28.1-*.whl
#
# Why a patch: horovod 0.28.1 (the last release) compiles its PyTorch extension as C++14, and
# torch >= 2.1 headers need C++17, so the stock `pip install horovod` fails. The two CMakeLists
# that set the standard (the top-level one and horovod/torch/CMakeLists.txt) are switched to 17;
# nothing else changes. The sdist is pinned by its sha256 so the build is reproducible.
#
# Usage: deploy/build_horovod.sh            (build once; a cached wheel is reused; prints its path)
#        deploy/build_horovod.sh --install  (also pip-install the cached wheel and its small
#                                            dependencies: cloudpickle, psutil, pyyaml, packaging, cffi)
# About 9 min here (MAKEFLAGS=-j1, on 2 shared cores); set MAKEFLAGS=-jN to use more. Needs cmake
# and a C++17 compiler.
set -euo pipefail
VERSION=0.28.1
SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
CACHE="${CKPTD_CACHE:-$HOME/.cache/ckptd}/horovod-$SHA256"
mkdir -p "$CACHE"

wheel=$(ls "$CACHE"/horovod-"$VERSION"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cd "$work"
  python -m pip download --quiet --no-deps --no-binary :all: "horovod==$VERSION" -d .
  echo "$SHA256  horovod-$VERSION.tar.gz" | sha256sum -c -
  tar xzf "horovod-$VERSION.tar.gz"
  cd "horovod-$VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' CMakeLists.txt horovod/torch/CMakeLists.txt
  # Refuse to build silently unpatched (a future sdist with other wording would otherwise fail
  # 20 minutes later inside the compiler).
  grep -q 'set(CMAKE_CXX_STANDARD 17)' CMakeLists.txt
  grep -q 'set(CMAKE_CXX_STANDARD 17)' horovod/torch/CMakeLists.txt
  ! grep -q 'set(CMAKE_CXX_STANDARD 14)' CMakeLists.txt horovod/torch/CMakeLists.txt
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="${MAKEFLAGS:--j1}" \
    python -m pip wheel --no-deps --no-build-isolation -w "$work/dist" .
  cp "$work"/dist/horovod-"$VERSION"-*.whl "$CACHE"/
  wheel=$(ls "$CACHE"/horovod-"$VERSION"-*.whl | head -n1)
fi
echo "$wheel"
if [ "${1:-}" = "--install" ]; then
  python -m pip install "$wheel"  # no torch among its dependencies (only in an extra)
fi
