#!/usr/bin/env bash
# Installs the Python packages (CPU PyTorch pinned) and builds the C++ extension.
# Debian/Ubuntu packages for the extension: see the README (or run .ci/run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade pip
# Pinned: an unpinned torch pulls a multi-gigabyte CUDA build.
python -m pip install -q "torch==2.13.0" -r requirements.txt
python -m pip install -q --no-build-isolation -e .
