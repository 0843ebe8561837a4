#!/usr/bin/env bash
# Set up ./.venv if needed, then run the main job: a tiny TST run (MoE GPT, EP=2, 2 processes)
# on synthetic data through the phase switch. Extra arguments go to the example script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec .venv/bin/torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29533}" \
    examples/quickstart_synthetic.py --expert-model-parallel-size 2 "$@"
