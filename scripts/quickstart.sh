#!/usr/bin/env bash
# The main job, from nothing to a trained model on real text (2 CPU processes, ~4 minutes):
#   1. set up ./.venv;
#   2. build a corpus of the running Python's standard library and pydoc topics (JSONL);
#   3. train a SentencePiece BPE tokenizer (4096 ids) on it;
#   4. preprocess it into a Megatron .bin/.idx dataset;
#   5. pretrain a small MoE GPT (4 layers, h=128, 8 experts top-2, RoPE, RMSNorm, SwiGLU)
#      with TST (S=4, r=0.3) on 2 processes with expert parallelism (EP=2), through the
#      phase switch to the end, in Megatron-LM's own training loop
#      (examples/pretrain_gpt_tst.py); checkpoints, TensorBoard logs;
#   6. plot training and validation loss against steps with the switch marked;
#   7. export the final checkpoint to Hugging Face (Mixtral) and continue a prompt with
#      plain transformers.
# Each step reuses its output when it is already there, so a second run starts training at
# once (and, when the last checkpoint is at --train-iters, only redraws the plot).
# Extra arguments are appended to the launcher's flags (any Megatron-LM flag). A longer run
# (e.g. --train-iters 800 --lr-wsd-decay-iters 80) starts over: remove runs/quickstart/checkpoints
# and runs/quickstart/tensorboard first (Megatron-LM refuses to resume under another length).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
venv="${VENV:-.venv}"  # as scripts/setup.sh
py=$venv/bin/python
out=runs/quickstart
data=$out/data
[ -f "$data/stdlib.jsonl" ] || $py tools/build_corpus.py --source python-stdlib --output "$data/stdlib.jsonl"
[ -f "$data/tokenizer.model" ] || $py tools/train_tokenizer.py --input "$data/stdlib.jsonl" \
    --model-prefix "$data/tokenizer" --vocab-size 4096
[ -f "$data/stdlib_text_document.idx" ] || $py tools/preprocess_data.py --input "$data/stdlib.jsonl" \
    --output-prefix "$data/stdlib" --tokenizer-type SentencePieceTokenizer \
    --tokenizer-model "$data/tokenizer.model" --append-eod --workers 2
"$venv/bin/torchrun" --nproc_per_node 2 --master_port "${MASTER_PORT:-29533}" \
    examples/pretrain_gpt_tst.py --device cpu \
    --data-path "$data/stdlib_text_document" --split 98,2,0 --data-cache-path "$data/cache" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$data/tokenizer.model" \
    --vocab-size 4096 --seq-length 128 --max-position-embeddings 128 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 \
    --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --num-experts 8 --moe-ffn-hidden-size 128 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 \
    --expert-model-parallel-size 2 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 600 \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style WSD --lr-wsd-decay-style linear --lr-wsd-decay-iters 60 \
    --lr-warmup-iters 30 \
    --adam-beta2 0.95 --moe-token-dispatcher-type alltoall --num-workers 0 \
    --hidden-dropout 0 --attention-dropout 0 \
    --tst-bag-size 4 --tst-phase1-fraction 0.3 \
    --log-interval 20 --eval-interval 50 --eval-iters 4 \
    --save "$out/checkpoints" --load "$out/checkpoints" --save-interval 200 \
    --tensorboard-dir "$out/tensorboard" "$@"
$py tools/plot_losses.py --tensorboard-dir "$out/tensorboard" --output "$out/loss.png" \
    --title "TST (S=4, r=0.3) on the Python stdlib corpus, MoE 8x top-2, EP=2"
# The trained model is an ordinary one: export it to Hugging Face (our own output, so --force
# refreshes it) and let plain transformers continue a prompt.
$py tools/convert_checkpoint.py export --load "$out/checkpoints" --save "$out/hf" --force
echo "greedy continuation of 'def main(' by Hugging Face transformers:"
$py examples/generate_hf.py "$out/hf" --prompt "def main(" --max-new-tokens 32
echo
echo "artifacts:"
echo "  corpus, tokenizer, dataset: $data/"
echo "  checkpoints (torch_dist):   $out/checkpoints/ (latest: $(cat $out/checkpoints/latest_checkpointed_iteration.txt))"
echo "  TensorBoard logs:           $out/tensorboard/  ($venv/bin/tensorboard --logdir $out/tensorboard)"
echo "  loss plot:                  $out/loss.png"
echo "  Hugging Face model:         $out/hf/  (MixtralForCausalLM; examples/generate_hf.py $out/hf)"
