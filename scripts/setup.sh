#!/usr/bin/env bash
# Create ./.venv and install tst-megatron into it (idempotent; a second run is quick).
# TORCH_SPEC overrides the torch requirement (default: the CPU wheel torch==2.13.0;
# on a CUDA machine e.g. TORCH_SPEC='torch==2.13.0' with your CUDA index configured).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.tst_megatron_installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
    .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "$TORCH_SPEC"
    .venv/bin/python -m pip install -q -e ".[dev,hf]"
    touch "$stamp"
fi
