"""Three public Megatron-LM launch scripts, as the argument lists they pass to
``pretrain_gpt.py``, with only what a TST user changes: the script name (the tests run
``examples/pretrain_gpt_tst.py``), ``--tst-bag-size`` added, and data, tokenizer and
checkpoint paths pointing at local files.

Each entry: ``world_size`` (the script's own number of processes), ``argv`` (in the
script's order, after bash word splitting) and where it comes from.
"""

# Local paths used in place of the scripts' $1/$2/$3 arguments and cluster paths.
CKPT = "runs/launch-script/checkpoints"
TB = "runs/launch-script/tensorboard"
CACHE = "runs/launch-script/data_cache"
DATA = "data/corpus_text_document"  # a Megatron .bin/.idx prefix
SP_MODEL = "data/tokenizer.model"  # a SentencePiece model (Llama2Tokenizer)
HF_DIR = "data/qwen3-tokenizer"  # a local Hugging Face tokenizer directory

TST = ["--tst-bag-size", "4"]

# NVIDIA/Megatron-LM examples/mixtral/train_mixtral_8x7b_distributed.sh, with
# CHECKPOINT_PATH=$CKPT TOKENIZER_MODEL=$SP_MODEL DATA_PATH=$DATA, WANDB_API_KEY unset.
# World size: GPUS_PER_NODE=8 x NNODES; 4 nodes (32 GPUs) because the script's
# EP 8 x PP 4 needs 32 ranks (megatron-core requires ETP*EP*PP | world size).
MIXTRAL = {
    "world_size": 32,
    "argv": [
        # MODEL_ARGS
        "--use-mcore-models", "--disable-bias-linear", "--seq-length", "4096",
        "--max-position-embeddings", "32768", "--num-layers", "32", "--hidden-size", "4096",
        "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--init-method-std", "0.01",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--swiglu", "--untie-embeddings-and-output-weights",
        "--group-query-attention", "--num-query-groups", "8", "--no-masked-softmax-fusion",
        "--no-position-embedding", "--rotary-base", "1000000",
        # MOE_ARGS
        "--num-experts", "8", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
        "aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
        "--overlap-grad-reduce",
        # DATA_ARGS
        "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", SP_MODEL,
        "--data-path", DATA, "--split", "99990,8,2",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "256", "--lr", "1e-4",
        "--train-iters", "500000", "--lr-decay-iters", "320000", "--lr-decay-style", "cosine",
        "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--lr-warmup-iters", "500",
        "--clip-grad", "1.0", "--bf16",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
        "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
        "--sequence-parallel",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "1000",
        "--eval-iters", "10", "--save", CKPT, "--load", CKPT, "--tensorboard-dir",
        f"{CKPT}/tensorboard", "--no-load-optim", "--no-load-rng",
    ] + TST,
}  # fmt: skip

# NVIDIA/Megatron-LM examples/llama/train_llama3_8b_h100_fp8.sh, its mock-data branch
# (TOKENIZER_ARG=MOCK), DTYPE=fp8, 8 GPUs on one node. The script passes "--split '99,1,0'"
# inside one array element, so bash hands the quotes through: the value is "'99,1,0'"
# (megatron-core reads the numbers out of it).
LLAMA3_FP8 = {
    "world_size": 8,
    "argv": [
        # MODEL_ARGS
        "--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096",
        "--ffn-hidden-size", "14336", "--num-attention-heads", "32", "--group-query-attention",
        "--num-query-groups", "8", "--kv-channels", "128", "--seq-length", "8192",
        "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--swiglu", "--normalization", "RMSNorm",
        "--init-method-std", "0.0134", "--attention-backend", "fused", "--apply-layernorm-1p",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        # TRAINING_ARGS (+ DDP_ARGS)
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples",
        "1953125000", "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252",
        "--lr", "0.00015", "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4",
        "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16",
        "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion", "--calculate-per-token-loss",
        "--manual-gc", "--empty-unused-memory-level", "1", "--exit-duration-in-mins", "235",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        # DTYPE_ARGS
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
        "max", "--fp8-param-gather",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--context-parallel-size", "1",
        "--sequence-parallel",
        # DATA_ARGS_LIST (mock)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
        "--data-cache-path", CACHE, "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers",
        "1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100",
        "--save-interval", "1000", "--log-throughput", "--profile", "--profile-step-start",
        "4", "--profile-step-end", "6", "--ckpt-format", "torch_dist",
        "--distributed-timeout-minutes", "60", "--save", CKPT, "--load", CKPT,
        "--tensorboard-dir", TB,
    ] + TST,
}  # fmt: skip

# yanring/Megatron-MoE-ModelZoo model_configs/benchmarking/Qwen3-30B-A3B.yaml, turned into
# flags as sbatch_benchmarking.sh does (yq: "false" entries dropped, "true" -> bare flag),
# with runtime_configs/benchmarking/runtime.conf's Qwen3-30B-A3B row (TP1 PP1 EP8 CP1 VPP1
# MBS1 GBS256 48 layers, alltoall, grouped GEMM, 4 nodes x 8 = 32 ranks, SEQ_LEN 4096) and
# DISPATCHER=alltoall (appends --moe-token-dispatcher-type alltoall). PR=bf16 would append
# --tp-comm-overlap, which Megatron-LM itself refuses at TP=1 (it switches SP off and then
# asserts SP for the overlap), so PR is left out. LOAD_PATH/OUTPUT_PATH -> $CKPT.
QWEN3_30B_A3B = {
    "world_size": 32,
    "argv": [
        "--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--expert-model-parallel-size", "8",
        "--context-parallel-size", "1", "--expert-tensor-parallel-size", "1",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--no-create-attention-mask-in-dataloader",
        "--use-mcore-models", "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "256", "--train-samples",
        "268554688", "--exit-duration-in-mins", "230", "--manual-gc", "--manual-gc-interval",
        "5",
        "--transformer-impl", "transformer_engine",
        "--data-cache-path", CACHE, "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", HF_DIR, "--data-path", DATA, "--split", "99,1,0",
        "--no-mmap-bin-files", "--num-workers", "6",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
        "--rotary-percent", "1.0", "--rotary-base", "1000000",
        "--rotary-seq-len-interpolation-factor", "1", "--normalization", "RMSNorm", "--swiglu",
        "--norm-epsilon", "1e-06", "--num-layers", "48", "--hidden-size", "2048",
        "--ffn-hidden-size", "6144", "--num-attention-heads", "32", "--group-query-attention",
        "--num-query-groups", "4", "--kv-channels", "128", "--qk-layernorm", "--seq-length",
        "4096", "--max-position-embeddings", "40960", "--make-vocab-size-divisible-by", "1187",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0",
        "--weight-decay", "0.1",
        "--lr-decay-samples", "255126953", "--lr-warmup-samples", "162761", "--lr", "1.2e-4",
        "--min-lr", "1.2e-5", "--lr-decay-style", "cosine", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--num-experts", "128", "--moe-ffn-hidden-size", "768",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "8",
        "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type",
        "alltoall", "--moe-permute-fusion", "--moe-router-dtype", "fp32",
        "--eval-iters", "32", "--eval-interval", "500",
        "--finetune", "--auto-detect-ckpt-format", "--load", CKPT, "--save", f"{CKPT}/out",
        "--save-interval", "500", "--dist-ckpt-strictness", "log_all",
        "--init-method-std", "0.02",
        "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-num-zeros-in-grad",
        "--log-params-norm", "--log-validation-ppl-to-tensorboard", "--log-throughput",
        "--log-interval", "1", "--tensorboard-dir", TB, "--wandb-project", "moe-benchmarking",
        "--wandb-exp-name", "Qwen3-30B-A3B-TP1PP1EP8CP1VPP1-MBS1GBS256-local",
        "--bf16",
        "--moe-token-dispatcher-type", "alltoall",
    ] + TST,
}  # fmt: skip

SCRIPTS = {"mixtral_8x7b": MIXTRAL, "llama3_8b_fp8": LLAMA3_FP8, "qwen3_30b_a3b": QWEN3_30B_A3B}
