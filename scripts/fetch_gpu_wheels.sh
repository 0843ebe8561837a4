#!/usr/bin/env bash
# Download, on a machine with network, what the lent GPU machine lacks to run
# scripts/gpu_check.sh: that machine has Python 3.12 and a CUDA torch but no network, no
# megatron-core and no Transformer Engine, and takes at most 64 MiB of carried files. Writes
# cp312 manylinux x86_64 wheels (about 20 MB) into gpu-wheels/ (git-ignored); carry that folder
# (the device tool's `carry: ["gpu-wheels"]`) and run scripts/gpu_check.sh there, which installs
# from it. torch is not downloaded: the machine's own is used.
#
# Settings (environment):
#   MEGATRON_CORE_SPEC  default 'megatron-core>=0.19,<0.20'
#   PYTHON              the pip to download with (any Python; default python3)
#   WHEELS              the folder (default gpu-wheels)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-gpu-wheels}"
mkdir -p "$WHEELS"
# megatron-core's own requirements besides torch (numpy, packaging), and what the launcher
# (examples/pretrain_gpt_tst.py: Megatron-LM's megatron.training, shipped in the
# megatron-core wheel) and the check import: pyyaml (megatron.training), psutil
# (dist_checkpointing), tqdm, sentencepiece (SentencePiece tokenizers).
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux2010_x86_64 \
    --dest "$WHEELS" \
    "${MEGATRON_CORE_SPEC:-megatron-core>=0.19,<0.20}" numpy "packaging>=24.2" pyyaml sentencepiece psutil tqdm
du -sh "$WHEELS"
ls "$WHEELS"
