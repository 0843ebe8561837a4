#!/usr/bin/env bash
# The GPU path in one command (about 13 min on one H100/H200; --real-size-only: the real-size
# step rows alone, about 5 min; --no-real-size: the rest, < 8 min): Transformer Engine spec +
# bf16 and FP8 (delayed and current scaling) through the TST switch against the local spec,
# distributed optimizer + alltoall + grouped GEMM, the MCE against megatron-core's fused CE,
# phase 1 vs the baseline at a real size (seq 4096, vocabulary 131,072) on real text, and
# FP8 and distributed-optimizer save/resume. Writes docs/results/gpu_check.md (a Markdown
# table; training logs in runs/gpu_check.log) and exits 1 if a check fails.
#
# PYTHON: the interpreter with torch (CUDA), megatron-core and Transformer Engine (default:
# .venv/bin/python when it exists, else python3). Where that interpreter has no megatron-core
# and a gpu-wheels/ folder is here (scripts/fetch_gpu_wheels.sh, for a machine without
# network), the wheels of the packages it lacks are installed without network into
# .gpu-site (git-ignored), put on PYTHONPATH: its own torch and packages are used. Without Transformer Engine the TE and FP8 rows
# say "skipped: Transformer Engine not installed". Extra arguments go to
# tests/gpu/gpu_check.py (e.g. --output FILE). Without a GPU it exits at once with status 1,
# checking nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q GPU; then
    echo "gpu_check.sh: no NVIDIA GPU on this machine (nvidia-smi finds none); nothing was checked" >&2
    exit 1
fi
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import megatron.core" 2>/dev/null && [ -d gpu-wheels ]; then
    # only what that interpreter lacks (its own numpy etc. stay), into .gpu-site (git-ignored)
    wheels=()
    for pair in megatron_core:megatron.core numpy:numpy packaging:packaging pyyaml:yaml \
        sentencepiece:sentencepiece psutil:psutil tqdm:tqdm; do
        "$PYTHON" -c "import ${pair#*:}" 2>/dev/null || wheels+=(gpu-wheels/"${pair%%:*}"-*.whl)
    done
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
        --target .gpu-site "${wheels[@]}"
    export PYTHONPATH="$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tst_megatron from this checkout
exec "$PYTHON" tests/gpu/gpu_check.py "$@"
