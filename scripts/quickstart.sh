#!/usr/bin/env bash
# Set up ./.venv if needed, then the main job: TST pretraining of a small MoE GPT on
# megatron-core mock data, 2 CPU processes with expert parallelism (EP=2), S=4, r=0.3,
# through the phase switch. Checkpoints and TensorBoard logs go to runs/quickstart/.
# A second run resumes from the last checkpoint (and has nothing left to do).
# Extra arguments are appended to the trainer's flags (e.g. --train-iters 400).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
out=runs/quickstart
.venv/bin/torchrun --nproc_per_node 2 --master_port "${MASTER_PORT:-29533}" \
    examples/pretrain_gpt_tst.py \
    --device cpu --mock-data --vocab-size 512 --seq-length 64 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 \
    --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-ffn-hidden-size 128 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 \
    --expert-model-parallel-size 2 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 200 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style WSD --lr-warmup-iters 10 \
    --hidden-dropout 0 --attention-dropout 0 \
    --tst-bag-size 4 --tst-phase1-fraction 0.3 \
    --log-interval 10 --eval-interval 20 --eval-iters 2 \
    --save "$out/checkpoints" --load "$out/checkpoints" --save-interval 100 \
    --tensorboard-dir "$out/tensorboard" "$@" 2>&1 | grep -v "Unable to save MockGPTDataset indexes"
echo "checkpoints: $out/checkpoints   TensorBoard: .venv/bin/tensorboard --logdir $out/tensorboard"
