#!/usr/bin/env bash
# Create a virtual environment (default ./.venv) and install tst-megatron into it; idempotent,
# a second run is quick. Prints the combination it set up.
#
# Supported: Python 3.10-3.12 with megatron-core >=0.16.1,<0.20 (0.17 and later need Python
# 3.12, so pip installs 0.16.1 on 3.10/3.11 and 0.19.x on 3.12). CI tests both ends: Python
# 3.11 + megatron-core 0.16.1 and Python 3.12 + megatron-core 0.19.x (.ci/run).
#
# Settings (environment):
#   PYTHON       interpreter for a new venv (default: the first of python3, python3.12,
#                python3.11, python3.10 that is 3.10-3.12)
#   VENV         venv directory (default .venv)
#   TORCH_SPEC   torch requirement installed first (default torch==2.13.0; where no CPU wheel
#                is configured, PyPI's build is the CUDA one, ~5 GB, which also runs on a CPU)
#   MEGATRON_CORE_SPEC  a narrower megatron-core requirement, e.g. 'megatron-core==0.19.2'
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

supported() { # supported PYTHON -> exit 0 when it runs and is 3.10-3.12
    "$1" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 12))' 2>/dev/null
}

if [ ! -x "$VENV/bin/python" ]; then
    if [ -z "${PYTHON:-}" ]; then
        for candidate in python3 python3.12 python3.11 python3.10; do
            if command -v "$candidate" >/dev/null && supported "$candidate"; then
                PYTHON="$candidate"
                break
            fi
        done
    fi
    if [ -z "${PYTHON:-}" ] || ! supported "$PYTHON"; then
        echo "setup.sh: no Python 3.10-3.12 found${PYTHON:+ (PYTHON=$PYTHON)}; set PYTHON=/path/to/python3.12" >&2
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
