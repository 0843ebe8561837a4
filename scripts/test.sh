#!/usr/bin/env bash
# Set up ./.venv if needed, then run the whole test suite (unit, 2-process gloo, slow ones too).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
