#!/usr/bin/env bash
# Create a virtual environment (default ./.venv) and install tst-megatron into it; idempotent,
# a second run is quick. Prints the combination it set up.
#
# Supported: Python 3.12 with megatron-core >=0.19,<0.20 (it ships Megatron-LM's training loop,
# megatron.training, which the launcher runs; it needs Python 3.12). CI runs the suite with
# megatron-core 0.19.x (.ci/run). Python 3.11 and megatron-core 0.16.1 are no longer supported.
#
# Settings (environment):
#   PYTHON       interpreter for a new venv (default: python3.12, or python3 when it is 3.12;
#                pyenv's 3.12 is found too)
#   VENV         venv directory (default .venv)
#   TORCH_SPEC   torch requirement installed first (default torch==2.13.0; where no CPU wheel
#                is configured, PyPI's build is the CUDA one, ~5 GB, which also runs on a CPU)
#   MEGATRON_CORE_SPEC  a narrower megatron-core requirement, e.g. 'megatron-core==0.19.2'
#
# scripts/setup.sh --container: no venv; install into the Python environment as it is (NVIDIA's
# PyTorch container), keeping its torch, Transformer Engine and Apex (scripts/setup_container.py;
# PYTHON: that environment's interpreter, default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --container ]; then
    exec "${PYTHON:-python3}" scripts/setup_container.py
fi
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

supported() { # supported PYTHON -> exit 0 when it runs and is Python 3.12
    "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null
}

if [ -x "$VENV/bin/python" ] && ! supported "$VENV/bin/python"; then
    echo "setup.sh: $VENV is $("$VENV/bin/python" -V 2>&1), but tst_megatron needs Python 3.12 (megatron-core>=0.19); remove $VENV (or set VENV=another directory) and run again" >&2
    exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
    if [ -z "${PYTHON:-}" ]; then
        for candidate in python3.12 python3 "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.12*/bin/python3.12; do
            if command -v "$candidate" >/dev/null && supported "$candidate"; then
                PYTHON="$candidate"
                break
            fi
        done
    fi
    if [ -z "${PYTHON:-}" ] || ! supported "$PYTHON"; then
        echo "setup.sh: no Python 3.12 found${PYTHON:+ (PYTHON=$PYTHON is not 3.12)}; set PYTHON=/path/to/python3.12" >&2
        exit 1
    fi
    "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.tst_megatron_installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] ||
    { [ -n "${MEGATRON_CORE_SPEC:-}" ] && [ "$MEGATRON_CORE_SPEC" != "$(cat "$stamp")" ]; }; then
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first and pinned: a bare "torch" requirement would pull whatever build pip prefers.
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install -q -e ".[dev,hf]" ${MEGATRON_CORE_SPEC:+"$MEGATRON_CORE_SPEC"}
    printf '%s' "${MEGATRON_CORE_SPEC:-}" >"$stamp"
fi
"$VENV/bin/python" - "$VENV" <<'EOF'
import importlib.metadata as md
import platform
import sys

print(
    f"set up {sys.argv[1]}: Python {platform.python_version()}, torch {md.version('torch')}, "
    f"megatron-core {md.version('megatron-core')}"
)
EOF
