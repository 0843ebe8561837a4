#!/usr/bin/env bash
# Set up the venv if needed (default ./.venv; VENV=... for another, see setup.sh), then run the
# whole test suite (unit, 2-process gloo, slow ones too) with its Python.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
