#!/usr/bin/env bash
# Sets up everything on a fresh machine: the system's gRPC/protobuf toolchain
# (Debian/Ubuntu, when missing), the Python packages (CPU PyTorch pinned) and
# the C++ extension of PolyBeast. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

have_grpc() {
    command -v pkg-config >/dev/null && pkg-config --exists grpc++ protobuf \
        && command -v protoc >/dev/null && command -v grpc_cpp_plugin >/dev/null
}
# What apt must add: the gRPC toolchain when missing, openssl, and, as root, iproute2 (`ip netns`: the
# multi-host tests build hosts on one machine with it; they need root, and skip without it).
PACKAGES=""
if ! have_grpc; then
    PACKAGES="build-essential pkg-config libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev"
fi
if [ "$(id -u)" = 0 ] && ! command -v ip >/dev/null; then PACKAGES="$PACKAGES iproute2"; fi
# openssl: python -m beast.tls makes certificates with it (and the TLS tests, theirs).
if ! command -v openssl >/dev/null; then PACKAGES="$PACKAGES openssl"; fi
# clang-format: CI checks csrc/ against .clang-format with it.
if ! command -v clang-format >/dev/null; then PACKAGES="$PACKAGES clang-format"; fi
if [ -n "$PACKAGES" ]; then
    if command -v apt-get >/dev/null; then
        SUDO=""
        if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -q
        # shellcheck disable=SC2086
        $SUDO apt-get install -y -q --no-install-recommends $PACKAGES
    elif ! have_grpc; then
        echo "Install gRPC and protobuf development files first (see README.md:" \
             "conda-forge 'grpc-cpp libprotobuf', or Homebrew 'grpc protobuf pkg-config')." >&2
        exit 1
    fi
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q --upgrade pip
# Pinned: an unpinned torch pulls a multi-gigabyte CUDA build. On a GPU
# machine, install the CUDA build of torch yourself first and drop this pin.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
"$PYTHON" -m pip install -q -r requirements.txt
# NetHack's environments. nle pins gymnasium to an older release (nle 1.3.0: ==1.2.0), whose
# gymnasium.make refuses a gymnasium.Wrapper subclass as an entry point (tests/flaky_env.py);
# nle runs on the gymnasium installed above, so its pins are left out.
"$PYTHON" -m pip install -q --no-deps nle
"$PYTHON" -m pip install -q --no-build-isolation -e .
"$PYTHON" -c "import libpolybeast, torch; print('set-up done: torch', torch.__version__)"
