"""Public Megatron-LM (0.19) launch scripts as the argument lists they pass to
``pretrain_gpt.py``, for the Megatron-LM launcher (``examples/pretrain_gpt_tst.py``):
changed only by the script name, ``--tst-bag-size`` added, and data, tokenizer and
checkpoint paths pointing at local names (a dry run reads none of them).

Each entry: ``world_size`` (a world size the script runs at), ``argv`` (in the script's
order, after bash word splitting), ``env`` (what the script exports that Megatron-LM's
validation reads) and where it comes from (the comment above it). What several MoE lines give
alike is written once (:data:`_HF_DATA`, :func:`_deepseek_v3_model`, the ModelZoo pieces such
as :func:`_modelzoo_layout`) and spliced in where the line has it, so every argv keeps the
script's flags in the script's order.

:data:`SHRUNK` and :func:`shrunk`: the same scripts cut to 2 CPU processes by :func:`shrink`,
which edits the script's own flag list (size flags get small values, the flags a CPU run
cannot take are dropped, each with the missing piece named), so a shrunk run stays visibly
the script (``tests/e2e/test_mlm_launch_scripts_shrunk.py``).
"""

VOCAB = "data/gpt2-vocab.json"  # GPT-2 BPE files (the 175B script's $3/$4)
MERGES = "data/gpt2-merges.txt"

#: Every script below exports this (or sets it to 1 when unset); with TP or CP > 1 on a GPU
#: before Blackwell, Megatron-LM's validate_args asserts it.
CONNECTIONS = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


# Local paths used in place of the scripts' $1/$2/$3 arguments and cluster paths.
CKPT = "runs/launch-script/checkpoints"
TB = "runs/launch-script/tensorboard"
CACHE = "runs/launch-script/data_cache"
DATA = "data/corpus_text_document"  # a Megatron .bin/.idx prefix
SP_MODEL = "data/tokenizer.model"  # a SentencePiece model (Llama2Tokenizer)
HF_DIR = "data/qwen3-tokenizer"  # a local Hugging Face tokenizer directory
TIKTOKEN = "data/tiktoken-vocab.json"  # a local TikTokenizer vocabulary

TST = ["--tst-bag-size", "4"]

# NVIDIA/Megatron-LM core_v0.19.0 examples/mixtral/train_mixtral_8x7b_distributed.sh, with
# CHECKPOINT_PATH=$CKPT TOKENIZER_MODEL=$SP_MODEL DATA_PATH=$DATA, WANDB_API_KEY unset.
# World size: GPUS_PER_NODE=8 x NNODES; 4 nodes (32 GPUs) because the script's
# EP 8 x PP 4 needs 32 ranks (megatron-core requires ETP*EP*PP | world size).
MIXTRAL_8X7B = {
    "world_size": 32,
    "env": CONNECTIONS,
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

# NVIDIA/Megatron-LM core_v0.19.0 examples/llama/train_llama3_8b_h100_fp8.sh, its mock-data branch
# (TOKENIZER_ARG=MOCK), DTYPE=fp8, 8 GPUs on one node. The script passes "--split '99,1,0'"
# inside one array element, so bash hands the quotes through: the value is "'99,1,0'"
# (megatron-core reads the numbers out of it).
LLAMA3_8B_FP8 = {
    "world_size": 8,
    "env": CONNECTIONS,
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


def _without(argv: list, flag: str, values: int = 1) -> list:
    """``argv`` without ``flag`` and the ``values`` words after it."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 1 + values :]


# NVIDIA/Megatron-LM core_v0.19.0 examples/gpt3/train_gpt3_175b_distributed.sh with
# CHECKPOINT_PATH=$CKPT TENSORBOARD_LOGS_PATH=$TB VOCAB_FILE=$VOCAB MERGE_FILE=$MERGES
# DATA_PATH=$DATA. TP 8 x PP 16 needs 128 ranks ("Change for multinode config": 16 nodes of
# 8). The script passes both --global-batch-size 1536 and --step-batch-size-schedule, which
# Megatron-LM 0.19's validate_args itself refuses ("Cannot specify both"; see
# GPT3_175B_AS_PUBLISHED): the entry drops --global-batch-size, as that message asks (the
# schedule's last batch is the same 1536).
GPT3_175B_AS_PUBLISHED = {
    "world_size": 128,
    "env": CONNECTIONS,
    "argv": [
        # GPT_MODEL_ARGS
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048",
        "--attention-backend", "auto",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "1536",
        "--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536",
        "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16",
        "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        # DATA_ARGS
        "--data-path", DATA, "--vocab-file", VOCAB, "--merge-file", MERGES,
        "--split", "949,50,1",
        # EVAL_AND_LOGGING_ARGS
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", CKPT, "--load", CKPT, "--eval-iters", "10", "--tensorboard-dir", TB,
    ] + TST,
}  # fmt: skip
# The script passes no --tokenizer-type: pretrain_gpt.py's default (its args_defaults, which
# the launcher gives validate_args too) is GPT2BPETokenizer, the type its --vocab-file and
# --merge-file are for. GPT3_175B names it anyway.
GPT3_175B = dict(
    GPT3_175B_AS_PUBLISHED,
    argv=_without(GPT3_175B_AS_PUBLISHED["argv"], "--global-batch-size")
    + ["--tokenizer-type", "GPT2BPETokenizer"],
)

# NVIDIA/Megatron-LM core_v0.19.0 examples/gptoss/02_train.sh with GPUS_PER_NODE=4 (the
# script reads it from the environment; "Adjust each value based on your setup"): one node,
# PP_SIZE = WORLD_SIZE = 4. Its default of 8 GPUs makes PP 8, which Megatron-LM itself refuses
# for the script's 12 layers ("Number of layers should be divisible by the
# pipeline-model-parallel size"). TP 1, EP 1, DTYPE fp8, the mock-data branch
# (TOKENIZER_ARG=MOCK), CHECKPOINT_PATH=$CKPT. As in the Llama script, "--split '99,1,0'" is
# one array element, so the value keeps its quotes after word splitting. Two of its flags,
# --export-force-local-attention and --enable-gpt-oss, are ModelOpt's (megatron.post_training,
# added to pretrain_gpt.py's parser only when nvidia-modelopt is installed; they pick
# ModelOpt's model builder), not Megatron-LM's: GPT_OSS leaves them out (see
# GPT_OSS_AS_PUBLISHED).
GPT_OSS_AS_PUBLISHED = {
    "world_size": 4,
    "env": CONNECTIONS,
    "argv": [
        # MODEL_ARGS
        "--no-masked-softmax-fusion", "--transformer-impl", "transformer_engine",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--no-rope-fusion",
        "--normalization", "RMSNorm", "--num-layers", "12", "--hidden-size", "512",
        "--ffn-hidden-size", "2048", "--num-attention-heads", "64", "--group-query-attention",
        "--num-query-groups", "8", "--seq-length", "8192", "--max-position-embeddings", "8192",
        "--use-mcore-models", "--rotary-percent", "1.0", "--rope-type", "rope",
        "--position-embedding-type", "rope", "--rotary-base", "10000",
        "--no-bias-gelu-fusion", "--export-force-local-attention", "--no-bias-dropout-fusion",
        "--quick-geglu", "--glu-linear-offset", "1.0", "--softmax-type", "learnable",
        "--window-attn-skip-freq", "2", "--activation-func-clamp-value", "7.0",
        "--window-size", "127,0", "--enable-gpt-oss",
        # MOE_ARGS
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type",
        "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm",
        "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
        "--overlap-grad-reduce", "--moe-ffn-hidden-size", "2048", "--moe-router-dtype", "fp32",
        "--moe-z-loss-coeff", "1e-3", "--moe-permute-fusion",
        # DATA_ARGS_LIST (mock)
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
        "--data-cache-path", CACHE, "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers",
        "1",
        # TRAINING_ARGS
        "--micro-batch-size", "1", "--global-batch-size", "128", "--lr", "1.0e-5",
        "--train-samples", "1953125000", "--lr-decay-samples", "1949218748",
        "--lr-decay-style", "cosine", "--min-lr", "1.0e-6", "--weight-decay", "0.1",
        "--lr-warmup-fraction", "0.05", "--clip-grad", "1.0", "--bf16", "--use-flash-attn",
        "--attention-softmax-in-fp32", "--accumulate-allreduce-grads-in-fp32",
        "--disable-bf16-reduced-precision-matmul", "--recompute-activations",
        # MODEL_PARALLEL_ARGS
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "4",
        "--expert-model-parallel-size", "1", "--sequence-parallel", "--context-parallel-size",
        "1", "--use-distributed-optimizer", "--fp8-format", "hybrid", "--fp8-param-gather",
        "--fp8-amax-compute-algo", "max", "--fp8-amax-history-len", "1024",
        # LOGGING_ARGS
        "--log-interval", "1", "--save-interval", "10000", "--eval-interval", "50000000",
        "--eval-iters", "0", "--save", CKPT, "--tensorboard-dir", f"{CKPT}/tensorboard",
        "--moe-per-layer-logging", "--no-load-optim", "--no-load-rng", "--log-throughput",
    ] + TST,
}  # fmt: skip

# --- pieces of the MoE lines below (DeepSeek-V3, Qwen3), each in the order the lines give it --

#: The Hugging Face tokenizer and the data of the DeepSeek-V3 and Qwen3 lines.
_HF_DATA = [
    "--data-cache-path", CACHE, "--tokenizer-type", "HuggingFaceTokenizer",
    "--tokenizer-model", HF_DIR, "--data-path", DATA, "--split", "99,1,0", "--no-mmap-bin-files",
]  # fmt: skip
#: Dropout, clipping and weight decay of the DeepSeek-V3 and Qwen3 lines.
_REGULARIZATION = [
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0",
    "--weight-decay", "0.1",
]  # fmt: skip
#: The learning-rate schedule and Adam betas of DeepSeek-V3 (both lines) and Qwen3-235B-A22B.
_LR_3_9E_6 = [
    "--lr-decay-samples", "584765624", "--lr-warmup-samples", "1536000",
    "--lr-warmup-init", "3.9e-7", "--lr", "3.9e-6", "--min-lr", "3.9e-7",
    "--lr-decay-style", "cosine", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
]  # fmt: skip


def _batches(micro: str, global_: str, samples: str, exit_minutes: str) -> list:
    """The switches and batch flags that follow the layout flags of these lines."""
    return [
        "--use-mcore-models", "--sequence-parallel", "--use-flash-attn", "--disable-bias-linear",
        "--micro-batch-size", micro, "--global-batch-size", global_, "--train-samples", samples,
        "--exit-duration-in-mins", exit_minutes,
    ]  # fmt: skip


def _logging(zeros_and_norms: bool, level: bool) -> list:
    """The checkpoint strictness, initialisation and logging flags up to ``--tensorboard-dir``
    (with ``--log-num-zeros-in-grad --log-params-norm``, with ``--logging-level 40``)."""
    out = ["--dist-ckpt-strictness", "log_all", "--init-method-std", "0.02"]
    out += ["--log-timers-to-tensorboard", "--log-memory-to-tensorboard"]
    out += ["--log-num-zeros-in-grad", "--log-params-norm"] if zeros_and_norms else []
    out += ["--log-validation-ppl-to-tensorboard", "--log-throughput", "--log-interval", "1"]
    return out + (["--logging-level", "40"] if level else []) + ["--tensorboard-dir", TB]


def _deepseek_v3_model(moe_layer_freq: str, dispatcher: list, router: str) -> list:
    """DeepSeek-V3's model (MLA, 256 experts with a shared expert, sigmoid routing with expert
    bias) and its data, from ``--transformer-impl`` to ``--mscale-all-dim``, as both
    DeepSeek-V3 lines give them: ``moe_layer_freq`` as the line writes it, ``dispatcher``
    after ``--moe-router-topk``, ``router`` (one flag) after ``--moe-permute-fusion``."""
    return [
        "--transformer-impl", "transformer_engine", "--seq-length", "4096", *_HF_DATA,
        "--no-create-attention-mask-in-dataloader", "--num-workers", "6",
        "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432",
        "--num-attention-heads", "128", "--kv-channels", "128", "--max-position-embeddings",
        "4096", "--position-embedding-type", "rope", "--rotary-base", "10000",
        "--make-vocab-size-divisible-by", "3232", "--normalization", "RMSNorm",
        "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights",
        "--multi-latent-attention", *_REGULARIZATION, "--qk-layernorm", *_LR_3_9E_6,
        "--num-experts", "256", "--moe-layer-freq", moe_layer_freq,
        "--moe-ffn-hidden-size", "2048", "--moe-shared-expert-intermediate-size", "2048",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-router-topk", "8",
        *dispatcher, "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-4",
        "--moe-router-group-topk", "4", "--moe-router-num-groups", "8",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-score-function", "sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-3",
        "--moe-router-dtype", "fp32", "--moe-permute-fusion", router,
        "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--rotary-scaling-factor", "40",
        "--mscale", "1.0", "--mscale-all-dim", "1.0",
    ]  # fmt: skip


# NVIDIA/Megatron-LM core_v0.19.0 examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (the
# DeepSeek-V3 model: MLA, 256 experts with a shared expert, sigmoid routing with expert bias,
# MTP), its PRETRAIN_ARGS with the defaults TP=1 EP=8 MBS=4 GBS=2048, USE_MEGATRON_FSDP=1
# (Megatron-FSDP flags appended; the script unsets CUDA_DEVICE_MAX_CONNECTIONS), WANDB=0,
# PROFILE=0, OUTPUT_PATH -> $CKPT, DATA_PATH=$DATA, tokenizer deepseek-ai/DeepSeek-V3 ->
# $HF_DIR. The script leaves the node count to the user: 32 nodes of 8 = 256 ranks here.
DEEPSEEK_V3 = {
    "world_size": 256,
    "env": {},
    "argv": [
        "--distributed-timeout-minutes", "60", "--tensor-model-parallel-size", "1",
        "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
        "--context-parallel-size", "1", "--use-distributed-optimizer", "--overlap-grad-reduce",
        "--overlap-param-gather", *_batches("4", "2048", "585937500", "220"),
        "--no-check-for-nan-in-loss-and-grad", "--manual-gc", "--manual-gc-interval", "10",
        "--recompute-granularity", "selective",
        "--recompute-modules", "mlp", "moe", "mla_up_proj", "layernorm",
        *_deepseek_v3_model(
            "[0]*3+[1]*58",
            ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
             "--moe-router-pre-softmax"],
            "--moe-router-force-load-balancing",
        ),
        "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1", "--eval-iters", "32",
        "--eval-interval", "100", "--auto-detect-ckpt-format", "--load", CKPT, "--save", CKPT,
        "--save-interval", "100", *_logging(zeros_and_norms=True, level=True),
        "--bf16", "--enable-experimental",
        # USE_MEGATRON_FSDP=1
        "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
        "--no-gradient-accumulation-fusion", "--use-distributed-optimizer",
        "--calculate-per-token-loss", "--init-model-with-meta-device", "--ckpt-format",
        "fsdp_dtensor", "--fsdp-double-buffer", "--use-nccl-ub",
        "--megatron-fsdp-grad-comm-dtype", "bf16", "--megatron-fsdp-main-grads-dtype", "bf16",
    ] + TST,
}  # fmt: skip
#: The script's gpt-oss model without ModelOpt's two flags.
GPT_OSS = dict(
    GPT_OSS_AS_PUBLISHED,
    argv=_without(
        _without(GPT_OSS_AS_PUBLISHED["argv"], "--export-force-local-attention", 0),
        "--enable-gpt-oss",
        0,
    ),
)

#: The same without MTP (``--mtp-num-layers``, ``--mtp-loss-scaling-factor``): MLA, the MoE
#: and Megatron-FSDP on their own.
DEEPSEEK_V3_NO_MTP = dict(
    DEEPSEEK_V3,
    argv=_without(_without(DEEPSEEK_V3["argv"], "--mtp-num-layers"), "--mtp-loss-scaling-factor"),
)

# --- Megatron-MoE-ModelZoo's sbatch_benchmarking.sh: the flags it puts around a config ------


def _modelzoo_layout(timeout: str, tp: str, pp: str, ep: str, vpp_layers: str = None) -> list:
    """The layout flags that open a ModelZoo line (``vpp_layers``: layers per virtual stage)."""
    pipeline = ["--pipeline-model-parallel-size", pp]
    if vpp_layers:
        pipeline += ["--num-layers-per-virtual-pipeline-stage", vpp_layers]
    return [
        "--distributed-timeout-minutes", timeout, "--tensor-model-parallel-size", tp, *pipeline,
        "--expert-model-parallel-size", ep, "--context-parallel-size", "1",
        "--expert-tensor-parallel-size", "1", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--overlap-param-gather",
    ]  # fmt: skip


def _wandb(name: str) -> list:
    """The W&B flags of a ModelZoo line (``WANDB_PROJECT`` empty: the common.conf default)."""
    return ["--wandb-project", "moe-benchmarking-v0.19.0", "--wandb-exp-name", name]


#: DISPATCHER=deepep (the default): the flex dispatcher with DeepEP.
_DEEPEP = ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
#: PR=fp8: the blockwise FP8 recipe and the precision-aware optimizer.
_FP8_BLOCKWISE = [
    "--fp8-recipe", "blockwise", "--fp8-format", "e4m3", "--fp8-param-gather",
    "--use-precision-aware-optimizer", "--main-grads-dtype", "fp32", "--main-params-dtype",
    "fp32", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
    "--moe-router-padding-for-fp8",
]  # fmt: skip
#: A2A_OVERLAP=1: the expert-parallel all-to-all overlap (--delay-wgrad-compute with it).
_A2A_OVERLAP = ["--delay-wgrad-compute", "--overlap-moe-expert-parallel-comm"]
#: What both Qwen3 configs give between the batch flags and the model sizes.
_QWEN3 = [
    "--manual-gc", "--manual-gc-interval", "5", "--cross-entropy-loss-fusion",
    "--cross-entropy-fusion-impl", "te", "--enable-experimental",
    "--transformer-impl", "transformer_engine", *_HF_DATA, "--num-workers", "6",
    "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope",
    "--rotary-percent", "1.0", "--rotary-base", "1000000",
    "--rotary-seq-len-interpolation-factor", "1", "--normalization", "RMSNorm", "--swiglu",
    "--norm-epsilon", "1e-06",
]  # fmt: skip


# yanring/Megatron-MoE-ModelZoo (e8650517) best_practice/qwen3/run_30b.sh, "EP + DP
# solution": PP=1 VPP=1 TP=1 EP=8 NNODES=4 (32 ranks) sbatch_benchmarking.sh
# --moe-router-force-load-balancing, i.e. model_configs/benchmarking/Qwen3-30B-A3B.yaml
# turned into flags as sbatch_benchmarking.sh does (yq: "false" entries dropped, "true" ->
# bare flag; LAYERS_PER_VP=false with VPP 1), runtime.conf's Qwen3-30B-A3B row (CP 1, MBS 1,
# GBS 256, alltoall, grouped GEMM, SEQ_LEN 4096), then the appended flags: the command line's
# --moe-router-force-load-balancing, DISPATCHER's default deepep (flex) and PR=fp8 (the
# script's fp8 recipe; its default PR=bf16 appends --tp-comm-overlap, which Megatron-LM
# itself refuses at TP 1). The config's --cross-entropy-fusion-impl te (added in August 2025)
# is refused by Megatron-LM 0.19 itself ("Transformer Engine cross entropy loss fusion is
# disabled due to stability issues. Use --cross-entropy-fusion-impl native ..."): QWEN3_30B_A3B
# takes native, as that message says. LOAD_PATH/OUTPUT_PATH -> $CKPT, MCORE_RELEASE_VERSION=0.19.0 (in the
# W&B project name; run_30b.sh's empty WANDB_PROJECT falls back to it), COMMENT=baseline.
QWEN3_30B_A3B_AS_PUBLISHED = {
    "world_size": 32,
    "env": CONNECTIONS,
    "argv": [
        *_modelzoo_layout("60", "1", "1", "8"), "--no-create-attention-mask-in-dataloader",
        *_batches("1", "256", "268554688", "230"), *_QWEN3,
        "--num-layers", "48", "--hidden-size", "2048", "--ffn-hidden-size", "6144",
        "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "4",
        "--kv-channels", "128", "--qk-layernorm", "--seq-length", "4096",
        "--max-position-embeddings", "40960", "--make-vocab-size-divisible-by", "1187",
        *_REGULARIZATION,
        "--lr-decay-samples", "255126953", "--lr-warmup-samples", "162761", "--lr", "1.2e-4",
        "--min-lr", "1.2e-5", "--lr-decay-style", "cosine", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95",
        "--num-experts", "128", "--moe-ffn-hidden-size", "768",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "8",
        "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3", "--moe-token-dispatcher-type",
        "alltoall", "--moe-permute-fusion", "--moe-router-dtype", "fp32",
        "--moe-router-fusion",
        "--eval-iters", "32", "--eval-interval", "500",
        "--finetune", "--auto-detect-ckpt-format", "--load", CKPT, "--save",
        f"{CKPT}/checkpoints", "--save-interval", "500",
        *_logging(zeros_and_norms=True, level=False),
        *_wandb("Qwen3-30B-A3B-TP1PP1EP8CP1VPP1-MBS1GBS256-baseline"), "--bf16",
        # appended by the command line and sbatch_benchmarking.sh
        "--moe-router-force-load-balancing", *_DEEPEP, *_FP8_BLOCKWISE,
    ] + TST,
}  # fmt: skip


def _native_cross_entropy(script: dict) -> dict:
    """``script`` with ``--cross-entropy-fusion-impl native`` where it gives ``te`` (Megatron-LM
    0.19 refuses the TE fusion itself and names native)."""
    argv = list(script["argv"])
    argv[argv.index("--cross-entropy-fusion-impl") + 1] = "native"
    return dict(script, argv=argv)


QWEN3_30B_A3B = _native_cross_entropy(QWEN3_30B_A3B_AS_PUBLISHED)

# yanring/Megatron-MoE-ModelZoo (e8650517) best_practice/qwen3/run_h100_235b.sh, the "H100
# config": DISPATCHER=deepep A2A_OVERLAP=1 TP=2 PP=8 VPP=4 EP=32 NNODES=32 (256 ranks)
# GBS=2048 sbatch_benchmarking.sh with the script's own MBS=1 SEQ_LEN=4096
# MOE_GROUPED_GEMM=true PR=bf16 COMMENT=baseline, i.e. model_configs/benchmarking/
# Qwen3-235B-A22B.yaml turned into flags as sbatch_benchmarking.sh does (yq: "false" entries
# dropped, "true" -> bare flag; LAYERS_PER_VP = runtime.conf's 96 layers / PP 8 / VPP 4 = 3),
# then the command line's flags, then what the script appends: DISPATCHER=deepep's flex
# dispatcher, PR=bf16's --tp-comm-overlap, A2A_OVERLAP=1's --delay-wgrad-compute
# --overlap-moe-expert-parallel-comm (and CUDA_DEVICE_MAX_CONNECTIONS=32, exported after the
# config's 1). LOAD_PATH/OUTPUT_PATH -> $CKPT, the tokenizer Qwen/Qwen3-235B-A22B -> $HF_DIR,
# WANDB_PROJECT empty -> common.conf's moe-benchmarking-v$MCORE_RELEASE_VERSION (0.19.0).
# The config's --cross-entropy-fusion-impl te is refused by Megatron-LM 0.19 itself (as for
# QWEN3_30B_A3B_AS_PUBLISHED): QWEN3_235B_A22B_H100 takes native, as its message says.
QWEN3_235B_A22B_H100_AS_PUBLISHED = {
    "world_size": 256,
    "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"},
    "argv": [
        *_modelzoo_layout("220", "2", "8", "32", vpp_layers="3"),
        "--no-create-attention-mask-in-dataloader", "--account-for-embedding-in-pipeline-split",
        "--account-for-loss-in-pipeline-split",
        *_batches("1", "2048", "268554688", "230"), *_QWEN3,
        "--num-layers", "94", "--hidden-size", "4096",
        "--ffn-hidden-size", "12288", "--num-attention-heads", "64", "--kv-channels", "128",
        "--group-query-attention", "--num-query-groups", "4", "--qk-layernorm",
        "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--make-vocab-size-divisible-by", "1187", *_REGULARIZATION, *_LR_3_9E_6,
        "--num-experts", "128", "--moe-ffn-hidden-size", "1536",
        "--moe-router-load-balancing-type", "aux_loss", "--moe-router-topk", "8",
        "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-3", "--moe-permute-fusion",
        "--moe-router-fusion", "--moe-router-dtype", "fp32",
        "--eval-iters", "32", "--eval-interval", "500",
        "--finetune", "--auto-detect-ckpt-format", "--load", CKPT, "--no-load-rng",
        "--no-load-optim", "--save", f"{CKPT}/checkpoints", "--save-interval", "100",
        *_logging(zeros_and_norms=False, level=True),
        *_wandb("Qwen3-235B-A22B-TP2PP8EP32CP1VPP4-MBS1GBS2048-baseline"), "--bf16",
        # the command line
        "--recompute-granularity", "selective", "--recompute-modules", "moe_act", "layernorm",
        "--moe-router-force-load-balancing", "--cuda-graph-impl", "transformer_engine",
        "--cuda-graph-scope", "moe_router", "moe_preprocess",
        # appended by sbatch_benchmarking.sh: DISPATCHER=deepep, PR=bf16, A2A_OVERLAP=1
        *_DEEPEP, "--tp-comm-overlap", *_A2A_OVERLAP,
    ] + TST,
}  # fmt: skip

QWEN3_235B_A22B_H100 = _native_cross_entropy(QWEN3_235B_A22B_H100_AS_PUBLISHED)

# yanring/Megatron-MoE-ModelZoo (e8650517) best_practice/deepseek-v3/run_deepseek_v3_h100.sh,
# "H100 config. best config on 1024 H100 GPUs": A2A_OVERLAP=1 PP=8 VPP=4 TP=2 EP=64
# NNODES=128 (1024 ranks) GBS=8192 PR=fp8 sbatch_benchmarking.sh, MBS=1 SEQ_LEN=4096
# MOE_GROUPED_GEMM=true; model_configs/benchmarking/DeepSeek-V3.yaml turned into flags as
# sbatch_benchmarking.sh does ("false" entries dropped: --finetune, --log-num-zeros-in-grad,
# --log-params-norm), the command line's flags (its --pipeline-model-parallel-layout, so no
# virtual-stage or uneven-PP flags are added), then DISPATCHER's default deepep (flex),
# PR=fp8's blockwise recipe and precision-aware optimizer, A2A_OVERLAP=1's
# --delay-wgrad-compute --overlap-moe-expert-parallel-comm (and
# CUDA_DEVICE_MAX_CONNECTIONS=32). LOAD_PATH/OUTPUT_PATH -> $CKPT, the tokenizer
# unsloth/DeepSeek-V3 -> $HF_DIR, empty COMMENT and WANDB_PROJECT -> common.conf's
# v$MCORE_RELEASE_VERSION (0.19.0) forms.
DEEPSEEK_V3_H100 = {
    "world_size": 1024,
    "env": {"CUDA_DEVICE_MAX_CONNECTIONS": "32"},
    "argv": [
        *_modelzoo_layout("60", "2", "8", "64"), *_batches("1", "8192", "585937500", "220"),
        "--no-save-optim", "--no-check-for-nan-in-loss-and-grad", "--cross-entropy-loss-fusion",
        "--cross-entropy-fusion-impl", "native", "--manual-gc", "--manual-gc-interval", "10",
        *_deepseek_v3_model("([0]*3+[1]*58)", [], "--moe-router-fusion"),
        "--eval-iters", "32", "--eval-interval", "200",
        "--no-load-optim", "--no-load-rng", "--auto-detect-ckpt-format", "--load", CKPT,
        "--save", f"{CKPT}/checkpoints", "--save-interval", "500",
        *_logging(zeros_and_norms=False, level=True),
        *_wandb("DeepSeek-V3-TP2PP8EP64CP1VPP4-MBS1GBS8192-v0.19.0"), "--bf16",
        "--enable-experimental",
        # the command line
        "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "mlp",
        "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.1",
        "--pipeline-model-parallel-layout", "Et|(tt|)*30mL",
        # appended by sbatch_benchmarking.sh: DISPATCHER=deepep, PR=fp8, A2A_OVERLAP=1
        *_DEEPEP, *_FP8_BLOCKWISE, *_A2A_OVERLAP,
    ] + TST,
}  # fmt: skip

#: The scripts that pass the dry run as they are (model families: dense GPT with a batch-size
#: schedule, Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 MLA + MoE, gpt-oss attention).
SCRIPTS = {
    "gpt3_175b": GPT3_175B,
    "llama3_8b_fp8": LLAMA3_8B_FP8,
    "mixtral_8x7b": MIXTRAL_8X7B,
    "qwen3_30b_a3b": QWEN3_30B_A3B,
    "deepseek_v3_no_mtp": DEEPSEEK_V3_NO_MTP,
    "gpt_oss": GPT_OSS,
}


# --- pretrain_hybrid.py: megatron-core's HybridModel (examples/pretrain_hybrid_tst.py) -------

# NVIDIA/Megatron-LM main (2026-08) examples/mamba/train.sh, MODEL_SCALE="800M" (Mamba-2,
# attention and MLP layers), with DATA_PATH=$DATA TOKENIZER_PATH=$SP_MODEL and its local
# checkpoint/cache/TensorBoard directories; torchrun --nproc_per_node 8 (one node).
MAMBA_800M = {
    "world_size": 8,
    "env": CONNECTIONS,
    "argv": [
        "--tensor-model-parallel-size", "1", "--sequence-parallel",
        "--pipeline-model-parallel-size", "1", "--use-distributed-optimizer",
        "--overlap-param-gather", "--overlap-grad-reduce", "--untie-embeddings-and-output-weights",
        "--init-method-std", "0.02", "--position-embedding-type", "none",
        "--hybrid-layer-pattern", "M-M-M--M-*M-M-M-M--*M-M-M-M-*M--M-M-M-*M-M--M-M-",
        "--hidden-size", "1024", "--num-attention-heads", "16", "--group-query-attention",
        "--num-query-groups", "8", "--seq-length", "4096", "--max-position-embeddings", "4096",
        "--train-samples", "73242188", "--lr-warmup-samples", "50000",
        "--lr-decay-samples", "73192188", "--save", CKPT, "--load", CKPT,
        "--data-path", DATA, "--data-cache-path", CACHE, "--split", "99,1,0",
        "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", SP_MODEL,
        "--distributed-backend", "nccl", "--micro-batch-size", "4", "--global-batch-size", "32",
        "--lr", "2.5e-4", "--min-lr", "2.5e-5", "--lr-decay-style", "cosine",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--disable-bias-linear", "--normalization", "RMSNorm",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "10",
        "--save-interval", "2000", "--eval-interval", "2000", "--eval-iters", "32", "--bf16",
        "--use-mcore-models",
        "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
        "--no-create-attention-mask-in-dataloader", "--tensorboard-dir", TB,
    ] + TST,
}  # fmt: skip

# NVIDIA-Nemotron-3-Nano-30B-A3B (Mamba-2, attention and a 128-expert MoE: sigmoid routing,
# expert bias, a shared expert): its model flags as NVIDIA/Megatron-LM main (2026-08)
# publishes them in examples/post_training/modelopt/conf/nvidia/
# NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.sh (MODEL_ARGS), less the three flags of the ModelOpt
# scripts that pretrain_hybrid.py's parser does not have (--trust-remote-code,
# --enable-experimental, --export-model-type HybridModel), its tokenizer a local directory; then
# examples/mamba/train.sh's training flags (data, schedule, optimizer, logging) with TP 4 + SP,
# EP 8 and the distributed optimizer, on 4 nodes of 8 GPUs.
NEMOTRON3_NANO = {
    "world_size": 32,
    "env": CONNECTIONS,
    "argv": [
        # MODEL_ARGS
        "--save-interval", "100000", "--micro-batch-size", "1",
        "--moe-token-dispatcher-type", "alltoall", "--moe-permute-fusion",
        "--use-fused-weighted-squared-relu", "--cross-entropy-loss-fusion",
        "--cross-entropy-fusion-impl", "native", "--moe-router-score-function", "sigmoid",
        "--moe-grouped-gemm", "--num-experts", "128", "--moe-router-topk", "6",
        "--moe-aux-loss-coeff", "1e-4", "--moe-router-topk-scaling-factor", "2.5",
        "--moe-router-enable-expert-bias", "--moe-router-dtype", "fp32",
        "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-shared-expert-intermediate-size", "3712",
        "--attention-backend", "flash", "--disable-gloo-process-groups",
        "--mamba-num-heads", "64", "--mamba-head-dim", "64",
        "--hybrid-layer-pattern", "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "--use-mcore-models", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--init-method-std", "0.0173", "--position-embedding-type", "none", "--squared-relu",
        "--hidden-size", "2688", "--num-attention-heads", "32", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "1856", "--kv-channels", "128",
        "--normalization", "RMSNorm",
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", HF_DIR, "--bf16",
        "--seq-length", "8192", "--max-position-embeddings", "8192",
        # examples/mamba/train.sh's training flags, with the layout above
        "--tensor-model-parallel-size", "4", "--sequence-parallel",
        "--expert-model-parallel-size", "8", "--use-distributed-optimizer",
        "--overlap-param-gather", "--overlap-grad-reduce",
        "--train-samples", "73242188", "--lr-warmup-samples", "50000",
        "--lr-decay-samples", "73192188", "--save", CKPT, "--load", CKPT,
        "--data-path", DATA, "--data-cache-path", CACHE, "--split", "99,1,0",
        "--global-batch-size", "256", "--lr", "2.5e-4", "--min-lr", "2.5e-5",
        "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--clip-grad", "1.0",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--log-interval", "10",
        "--eval-interval", "2000", "--eval-iters", "32", "--tensorboard-dir", TB,
    ] + TST,
}  # fmt: skip

# NVIDIA Nemotron 3 Super (Mamba-2, attention, a 512-expert latent MoE, 2 MTP layers; MXFP8) as
# NVIDIA/Megatron-LM main (d98e8a64dd, 2026-08-22) publishes its GB200 release run:
# tests/functional_tests/test_cases/nemotron/nemotron3_super_release_gb200/model_config.yaml
# (ENV_VARS and MODEL_ARGS; its runner, shell_test_utils/_run_training.sh, passes `true` as the
# bare flag and "[a b]" as two words, to pretrain_hybrid.py). CI placeholders: ${DATA_BLEND},
# ${DATA_CACHE_PATH}, the checkpoint, TensorBoard and W&B paths -> local names;
# ${TOKENIZER_TYPE}/${TOKENIZER_MODEL_PATH} -> TikTokenizer and a local vocabulary file (the
# line sets --tiktoken-pattern). World size: 64 GPUs (EP 64 needs a multiple of 64; Megatron-
# Bridge's recipe of the same layout, nemotron_3_super_pretrain_64gpu_gb200_fp8mx_config, is
# "64 x GB200"; the release job's node count is not public).
NEMOTRON3_SUPER_GB200 = {
    "world_size": 64,
    "gpu": "GB200",
    "env": {
        "CUDA_DEVICE_MAX_CONNECTIONS": "32", "NCCL_GRAPH_REGISTER": "0", "NCCL_NVLS_ENABLE": "0",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.8",
        "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "TORCH_NCCL_HIGH_PRIORITY": "1",
        "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "64",
        "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "128", "NVLINK_DOMAIN_SIZE": "72", "USE_MNNVL": "1",
        "NVTE_BWD_LAYERNORM_SM_MARGIN": "20", "NVTE_FWD_LAYERNORM_SM_MARGIN": "20",
        "TORCHINDUCTOR_WORKER_START": "fork", "QUANTIZATION_TYPE_DEBUG": "1",
        "NON_DETERMINSTIC_RESULTS": "1",
    },
    "argv": [
        # Distributed args
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
        "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--sequence-parallel", "--ddp-num-buckets", "10", "--ddp-pad-buckets-for-high-nccl-busbw",
        "--high-priority-stream-groups", "ep", "--distributed-timeout-minutes", "10",
        "--disable-gloo-process-groups",
        # Training args
        "--micro-batch-size", "1", "--global-batch-size", "512", "--train-samples", "12207031",
        "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native",
        "--attention-backend", "fused", "--transformer-impl", "transformer_engine",
        "--cuda-graph-impl", "transformer_engine",
        "--cuda-graph-modules", "attn", "mamba", "moe_router", "moe_preprocess",
        "--cuda-graph-warmup-steps", "3", "--te-rng-tracker", "--manual-gc",
        "--manual-gc-interval", "100", "--no-create-attention-mask-in-dataloader",
        "--num-workers", "1", "--exit-interval", "23840", "--override-opt_param-scheduler",
        # Network size args
        "--use-mcore-models",
        "--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
        "--is-hybrid-model", "--mamba-num-heads", "128", "--num-layers", "88",
        "--hidden-size", "4096", "--ffn-hidden-size", "2688", "--num-attention-heads", "32",
        "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "128",
        "--hybrid-layer-pattern",
        "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME"
        "/*E/*E",
        "--position-embedding-type", "none", "--normalization", "RMSNorm",
        "--untie-embeddings-and-output-weights", "--init-method-std", "0.014",
        "--disable-bias-linear", "--squared-relu", "--use-fused-weighted-squared-relu",
        # Data args
        "--seq-length", "8192", "--max-position-embeddings", "8192",
        "--data-path", DATA, "--data-cache-path", CACHE, "--tiktoken-pattern", "v2",
        "--tokenizer-type", "TikTokenizer", "--tokenizer-model", TIKTOKEN, "--no-mmap-bin-files",
        # MoE args
        "--num-experts", "512", "--moe-router-topk", "22", "--moe-router-topk-scaling-factor",
        "5.0", "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-dtype", "fp32", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-aux-loss-coeff", "1e-4", "--moe-router-padding-for-quantization",
        "--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "hybridep",
        "--moe-hybridep-num-sms", "32", "--moe-grouped-gemm", "--moe-permute-fusion",
        "--moe-latent-size", "1024", "--moe-shared-expert-intermediate-size", "5376",
        # MTP args
        "--mtp-num-layers", "2", "--calculate-per-token-loss", "--mtp-loss-scaling-factor", "0.3",
        # Mixed precision / quantization args
        "--bf16", "--grad-reduce-in-bf16", "--first-last-layers-bf16",
        "--num-layers-at-start-in-bf16", "0", "--num-layers-at-end-in-bf16", "14",
        "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--fp8-param-gather",
        "--reuse-grad-buf-for-mxfp8-param-ag",
        # Regularization args
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--clip-grad", "1.0",
        "--weight-decay", "0.1",
        # Learning rate args
        "--lr", "4.5e-4", "--min-lr", "4.5e-6", "--lr-decay-style", "WSD",
        "--lr-warmup-samples", "24414063", "--lr-decay-samples", "3048706055",
        "--lr-wsd-decay-style", "minus_sqrt", "--lr-wsd-decay-samples", "610351563",
        "--adam-beta1", "0.9", "--adam-beta2", "0.95",
        # Checkpointing args
        "--save", CKPT, "--load", CKPT, "--ckpt-format", "torch_dist",
        "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load",
        "--ckpt-assume-constant-structure", "--dist-ckpt-strictness", "log_all", "--async-save",
        "--async-strategy", "nvrx", "--async-ckpt-use-cpu-shm", "--use-persistent-ckpt-worker",
        "--save-interval", "200", "--save-retain-interval", "2000",
        # Validation args
        "--eval-interval", "100", "--eval-iters", "14",
        # Logging args
        "--log-interval", "10", "--log-params-norm", "--log-num-zeros-in-grad",
        "--log-timers-to-tensorboard", "--log-memory-to-tensorboard", "--log-throughput",
        "--log-progress", "--log-energy", "--log-memory-interval", "50", "--logging-level", "20",
        "--timing-log-option", "minmax", "--check-weight-hash-across-dp-replicas-interval",
        "2000", "--tensorboard-dir", TB, "--wandb-project", "megatron-core-release-runs",
        "--wandb-entity", "adlr", "--wandb-exp-name", "nemotron3-super-tst",
        "--wandb-save-dir", "runs/launch-script/wandb",
    ] + TST,
}  # fmt: skip

#: The pretrain_hybrid.py lines that pass the hybrid launcher's dry run as they are.
HYBRID_SCRIPTS = {"mamba_800m": MAMBA_800M, "nemotron3_nano_30b_a3b": NEMOTRON3_NANO}


# --- the same scripts shrunk to 2 CPU processes -------------------------------------------


def flag_values(argv: list, i: int) -> int:
    """The number of values after the flag ``argv[i]``: the words up to the next ``--`` word
    (``--recompute-modules mlp moe ...`` has several, a switch none)."""
    n = 0
    while i + 1 + n < len(argv) and not argv[i + 1 + n].startswith("--"):
        n += 1
    return n


def shrink(argv: list, sizes: dict, drop=(), paths: dict = None) -> list:
    """``argv`` with the values of the flags in ``sizes`` replaced (each occurrence; a value is
    one word, or a list of words) and the flags in ``drop`` removed with their values; every
    other word kept, in order, with the placeholder paths of ``paths`` replaced.

    Raises:
        KeyError: a flag of ``drop`` is not in ``argv`` (a stale table).
    """
    missing = [flag for flag in drop if flag not in argv]
    if missing:
        raise KeyError(f"not in the script: {missing}")
    out, i = [], 0
    while i < len(argv):
        word, n = argv[i], flag_values(argv, i) if argv[i].startswith("--") else 0
        if word in drop:  # the flag and its values are left out
            i += 1 + n
            continue
        if word in sizes:
            value = sizes[word]
            out += [word, *([value] if isinstance(value, str) else value)]
        else:
            for j in range(i, i + 1 + n):
                text = argv[j]
                for placeholder, local in (paths or {}).items():
                    text = text.replace(placeholder, local)
                out.append(text)
        i += 1 + n
    return out


#: Sizes every shrunk script takes where it has the flag: 2 layers of width 64, 4 experts
#: (top 2), 32-token samples, a global batch of 4, 4 iterations (the switch at 2: the run adds
#: --tst-phase1-iters 2), validation at 2 and 4, a log line each iteration.
SIZES = {
    "--num-layers": "2", "--hidden-size": "64", "--ffn-hidden-size": "128",
    "--num-attention-heads": "4", "--num-query-groups": "2", "--kv-channels": "16",
    "--seq-length": "32", "--max-position-embeddings": "32", "--num-experts": "4",
    "--moe-ffn-hidden-size": "64", "--moe-shared-expert-intermediate-size": "64",
    "--moe-router-topk": "2", "--micro-batch-size": "1", "--global-batch-size": "4",
    "--train-iters": "4", "--train-samples": "16", "--lr-decay-iters": "4",
    "--lr-warmup-iters": "1", "--lr-decay-samples": "16", "--lr-warmup-samples": "4",
    "--vocab-size": "512", "--eval-interval": "2", "--eval-iters": "1",
    "--save-interval": "4", "--log-interval": "1", "--num-workers": "0", "--split": "80,10,10",
}  # fmt: skip

# What a CPU run cannot take, each found by running the shrunk script: the flags dropped and
# the missing piece.

#: FP8 needs Transformer Engine (CUDA only).
FP8 = ["--fp8-format", "--fp8-amax-history-len", "--fp8-amax-compute-algo", "--fp8-param-gather"]
#: The distributed optimizer runs on a CPU (tests/distributed/test_distributed_optimizer.py);
#: the shrunk lines drop it to keep their runs as they were measured.
DIST_OPT = ["--use-distributed-optimizer", "--overlap-param-gather"]
#: megatron-core's Float16OptimizerWithFloat16Params (--bf16, --fp16) accepts only
#: ``torch.cuda.*`` parameter types, which the CPU runtime does not redirect: fp32 instead.
HALF = ["--bf16"]
#: --log-memory-to-tensorboard reads CUDA allocator statistics (``torch.cuda.memory_stats()``
#: keys), which the CPU runtime's stand-in does not have.
MEMORY = ["--log-memory-to-tensorboard"]
#: Grouped GEMM and permute fusion are Transformer Engine (or grouped_gemm) kernels.
TE_MOE = ["--moe-grouped-gemm", "--moe-permute-fusion"]
#: --transformer-impl transformer_engine: a CPU run uses the local spec, and the launcher
#: refuses another --transformer-impl rather than override it (``checks.hardware.cpu_flag_problems``).
TE_IMPL = ["--transformer-impl"]
#: --apply-layernorm-1p (zero-centred gamma): the CPU run's norm (the local spec with the
#: project's norms, tst_megatron.models.layers) refuses it without Transformer Engine or Apex.
LAYERNORM_1P = ["--apply-layernorm-1p"]

#: The two scripts without --num-workers use Megatron-LM's default of 2 DataLoader worker
#: processes; in a child spawned by the test harness those are spawned too and cannot
#: pickle Megatron-LM's local ``worker_init_fn`` (under torchrun they are forked).
WORKERS = ["--num-workers", "0"]

#: Per script: ``script`` (the entry above; DeepSeek-V3 with its MTP layer), ``sizes`` (on
#: top of :data:`SIZES`: parallel sizes for 2 processes as the family suggests -- GPT-3 TP 2,
#: Llama DP 2, Mixtral and gpt-oss PP 2, Qwen3 and DeepSeek-V3 EP 2 -- and the family's own
#: size flags), ``drop`` (flags a CPU run or the local spec cannot take, each
#: with the reason beside it), ``add`` (flags appended, with the reason), ``data`` (the local
#: files the script reads).
SHRUNK = {
    "gpt3_175b": {
        "script": GPT3_175B,
        "sizes": {
            "--tensor-model-parallel-size": "2", "--pipeline-model-parallel-size": "1",
            # tokens: a batch of 2 until 4 samples of 32 tokens are consumed, then 4
            "--step-batch-size-schedule": "0:2 128:4",
            # Megatron-LM 0.19's GPT2BPETokenizer is Hugging Face's AutoTokenizer "gpt2"
            # (MegatronHFTokenizer), fetched from the Hub even with --vocab-file and
            # --merge-file given; no Hub here: the same vocabulary as a local directory
            "--tokenizer-type": "HuggingFaceTokenizer",
        },
        "drop": ["--fp16"],  # as HALF
        "add": WORKERS + ["--tokenizer-model", HF_DIR],
        "data": "gpt2",
    },
    "llama3_8b_fp8": {
        "script": LLAMA3_8B_FP8,
        "sizes": {},
        # --grad-reduce-in-bf16 goes with --bf16 (HALF); --profile starts CUDA's profiler
        # (and PyTorch's, --use-pytorch-profiler, crashed a 2-process CPU run with SIGSEGV)
        "drop": FP8 + DIST_OPT + HALF + LAYERNORM_1P + ["--grad-reduce-in-bf16"]
        + ["--profile", "--profile-step-start", "--profile-step-end"],
        "data": "mock",
    },
    "mixtral_8x7b": {
        "script": MIXTRAL_8X7B,
        "sizes": {"--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "1"},
        "drop": DIST_OPT + HALF + ["--moe-grouped-gemm"],
        "add": WORKERS,
        "data": "sp",
    },
    "qwen3_30b_a3b": {
        "script": QWEN3_30B_A3B,
        "sizes": {"--expert-model-parallel-size": "2", "--moe-token-dispatcher-type": "alltoall"},
        "drop": DIST_OPT + HALF + TE_MOE + TE_IMPL + [
            "--moe-router-fusion",  # Transformer Engine's fused router
            "--moe-flex-dispatcher-backend",  # flex: DeepEP (CUDA); alltoall instead
            # the script's fp8 recipe (Transformer Engine); the precision-aware optimizer
            # is TE's FusedAdam (OptimizerConfig refuses it without), its dtypes with it
            "--fp8-recipe", "--fp8-format", "--fp8-param-gather", "--moe-router-padding-for-fp8",
            "--use-precision-aware-optimizer", "--main-grads-dtype", "--main-params-dtype",
            "--exp-avg-dtype", "--exp-avg-sq-dtype",
            "--wandb-project", "--wandb-exp-name",  # wandb is not installed
        ] + MEMORY,
        "data": "hf",
    },
    "deepseek_v3": {
        "script": DEEPSEEK_V3,
        "sizes": {
            "--expert-model-parallel-size": "2", "--moe-layer-freq": "[0]*1+[1]*1",
            "--moe-token-dispatcher-type": "alltoall",
            # without MLA (below) Megatron-LM refuses mla_up_proj recomputation; layernorm
            # recomputation (CheckpointWithoutOutput) calls Transformer Engine's
            # FP8GlobalStateManager, undefined without it (NameError on the first forward)
            "--recompute-modules": ["mlp", "moe"],
            "--moe-router-num-groups": "2", "--moe-router-group-topk": "1",
            "--q-lora-rank": "32", "--kv-lora-rank": "16", "--qk-head-dim": "16",
            "--qk-pos-emb-head-dim": "8", "--v-head-dim": "16",
        },
        "drop": DIST_OPT + HALF + TE_MOE + TE_IMPL + [
            "--moe-flex-dispatcher-backend",  # flex: HybridEP (CUDA); alltoall instead
            # Megatron-FSDP (USE_MEGATRON_FSDP=1): Megatron-LM refuses it with
            # CUDA_DEVICE_MAX_CONNECTIONS=1, which the launcher sets on a CPU; it also needs
            # the distributed optimizer (above) and NCCL user buffers
            "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
            "--init-model-with-meta-device", "--ckpt-format", "--fsdp-double-buffer",
            "--use-nccl-ub", "--megatron-fsdp-grad-comm-dtype", "--megatron-fsdp-main-grads-dtype",
            # MLA: MLASelfAttention passes k_channels/v_channels (its q/k and v head sizes
            # differ) to the core attention; megatron-core's local DotProductAttention takes
            # neither (only Transformer Engine's does), so MLA cannot run on the local spec:
            # standard attention with the script's heads (the MLA sizes stay, unused)
            "--multi-latent-attention",
        ] + MEMORY,
        "data": "hf",
    },
    "gpt_oss": {
        "script": GPT_OSS,
        "sizes": {"--pipeline-model-parallel-size": "2", "--window-size": "8,0"},
        "drop": FP8 + DIST_OPT + HALF + TE_MOE + TE_IMPL,
        "data": "mock",
    },
}  # fmt: skip


def shrunk(name: str, files: dict, run_dir: str) -> list:
    """The argv of ``SHRUNK[name]``'s script cut to 2 CPU processes (:func:`shrink` with
    :data:`SIZES` and the entry's sizes and drops), its paths pointing at ``files``
    (:func:`tests.e2e.local_data.build_local_files`) and ``run_dir``, then the switch at
    iteration 2 (``--tst-phase1-iters 2``) and ``--device cpu`` (the launcher adds its CPU
    flags: the local spec, gloo, no fused kernels)."""
    entry = SHRUNK[name]
    data = {"gpt2": files.get("bpe_data"), "hf": files.get("bpe_data")}
    data.update(sp=files.get("sp_data"), mock=DATA)
    paths = {CKPT: f"{run_dir}/ckpt", TB: f"{run_dir}/tb", CACHE: f"{run_dir}/cache"}
    paths.update({DATA: data[entry["data"]], SP_MODEL: files.get("sp"), HF_DIR: files.get("hf")})
    paths.update({VOCAB: files.get("vocab"), MERGES: files.get("merges")})
    paths = {k: v for k, v in paths.items() if v is not None}  # a mock-data line reads none
    argv = shrink(entry["script"]["argv"], dict(SIZES, **entry["sizes"]), entry["drop"], paths)
    argv += shrink(entry.get("add", []), {}, (), paths)
    return argv + ["--tst-phase1-iters", "2", "--device", "cpu"]
