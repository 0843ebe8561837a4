"""Settings Megatron-LM 0.19 accepts but cannot run (its ``pretrain()`` would stop with a
traceback after set-up), found before any work: each function reads only and returns one line
per problem naming the flag (empty: none).
"""

from __future__ import annotations

import importlib.util
import os


def tokenizer_problems(args, *, launch: bool) -> list[str]:
    """The tokenizer settings Megatron-LM's ``set_global_variables`` stops on: a type without
    its ``--vocab-size`` / ``--tokenizer-model`` (``--tokenizer-type`` defaults to
    ``GPT2BPETokenizer``, as in ``pretrain_gpt.py``), and in a
    ``launch`` (not a dry run, which may run where the cluster's files are not) a tokenizer
    file that does not exist (a Hugging Face ``--tokenizer-model`` may be a hub name)."""
    kind = args.tokenizer_type
    if kind == "NullTokenizer" and not (args.vocab_size and args.vocab_size >= 2):
        return [f"--tokenizer-type NullTokenizer needs --vocab-size >= 2 (got {args.vocab_size})"]
    if kind == "HuggingFaceTokenizer" and not args.tokenizer_model:
        return [
            "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a directory or hub name)"
        ]
    if not launch:
        return []
    files = {
        "SentencePieceTokenizer": ("--tokenizer-model",),
        "GPTSentencePieceTokenizer": ("--tokenizer-model",),
        "Llama2Tokenizer": ("--tokenizer-model",),
        "GPT2BPETokenizer": ("--vocab-file", "--merge-file"),
    }.get(kind, ())
    problems = []
    for flag in files:
        path = getattr(args, flag[2:].replace("-", "_"), None)
        if not path or not os.path.isfile(path):
            problems.append(f"--tokenizer-type {kind}: {flag} {path} is not a file")
    return problems


def installed_problems(args) -> list[str]:
    """Packages a flag needs that are not installed here (for a launch; a dry run may run
    where the cluster's packages are not): ``--wandb-project`` without ``wandb``."""
    if getattr(args, "wandb_project", None) and importlib.util.find_spec("wandb") is None:
        return ["--wandb-project needs the wandb package here: pip install wandb"]
    return []


def late_megatron_problems(args) -> list[str]:
    """Settings ``validate_args`` accepts but ``pretrain()`` refuses only after building the
    model: no ``--train-iters``/``--train-samples`` or ``--lr`` (the scheduler raises);
    ``--finetune`` without a checkpoint; ``--lr-decay-style WSD`` without its decay length;
    no ``--eval-interval`` (a ``TypeError`` sizing the validation set); ``--full-validation``
    with one validation set (a ``TypeError`` in ``evaluate()``, Megatron-LM 0.19.2);
    ``--wandb-project`` without ``--wandb-exp-name``."""
    problems = []
    if getattr(args, "wandb_project", None) and not getattr(args, "wandb_exp_name", None):
        problems.append("--wandb-project needs --wandb-exp-name (Megatron-LM raises without)")
    if not args.skip_train:
        if not (args.train_iters or args.train_samples):
            problems.append(
                "give --train-iters or --train-samples (Megatron-LM's scheduler stops without "
                "either after building the model)"
            )
        if args.lr is None:
            problems.append("--lr is required (Megatron-LM's scheduler has no default)")
    if getattr(args, "finetune", False) and not (args.load or args.pretrained_checkpoint):
        problems.append("--finetune needs --load (or --pretrained-checkpoint) to start from")
    if args.full_validation and not getattr(args, "multiple_validation_sets", False):
        problems.append(
            "--full-validation stops Megatron-LM 0.19 at its first evaluation with one "
            "validation set (a TypeError in evaluate()); size --eval-iters to the validation "
            "split instead"
        )
    elif args.eval_interval is None and not args.skip_train:
        problems.append(
            "--eval-interval is required (Megatron-LM 0.19 has no default and would stop with "
            "a TypeError while sizing the validation set)"
        )
    if args.lr_decay_style == "WSD":
        flag, value = (
            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters)
            if args.train_iters
            else ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)
        )
        if value is None:
            problems.append(
                f"--lr-decay-style WSD needs {flag} (the length of the decay; Megatron-LM's "
                "scheduler has no default and would stop after building the model)"
            )
    return problems


def model_problems(args) -> list[str]:
    """Model and layout settings megatron-core 0.19 refuses only while building the model or
    in the first step: heads not divisible by ``--num-query-groups``, a shared expert with
    biases, ``--num-workers`` below 0, a ``--moe-layer-freq`` pattern whose length is not
    ``--num-layers``, ``--moe-router-topk`` above ``--num-experts``, MoE with
    TP > 1 and no ``--sequence-parallel``, a world size expert TP x EP x PP does not divide."""
    problems = []
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups:
        problems.append(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}"
        )
    if args.moe_shared_expert_intermediate_size and args.add_bias_linear:
        problems.append(
            "--moe-shared-expert-intermediate-size: megatron-core's shared experts have no "
            "biases; add --disable-bias-linear"
        )
    if args.num_workers < 0:
        problems.append(f"--num-workers must be 0 or more (got {args.num_workers})")
    experts = args.num_experts or 0
    freq = args.moe_layer_freq
    if experts and isinstance(freq, list) and len(freq) != args.num_layers:
        problems.append(
            f"--moe-layer-freq gives a pattern of {len(freq)} layers for --num-layers "
            f"{args.num_layers}: give one 0/1 entry per layer"
        )
    if experts and args.moe_router_topk > experts:
        problems.append(
            f"--moe-router-topk {args.moe_router_topk} is more than --num-experts {experts}"
        )
    if experts and args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        problems.append(
            "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's "
            "MoE layer refuses it in the first training step)"
        )
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    expert_model = etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size
    if args.world_size % expert_model:
        problems.append(
            f"world size {args.world_size} is not divisible by --expert-tensor-parallel-size "
            f"{etp} x --expert-model-parallel-size {args.expert_model_parallel_size} x "
            f"--pipeline-model-parallel-size {args.pipeline_model_parallel_size}"
        )
    return problems


def without_te_problems(
    args, *, te: bool, apex: bool = True, grouped_gemm: bool = True
) -> list[str]:
    """Features megatron-core 0.19 cannot run without Transformer Engine (``te`` False: TE
    is not where the run will be; a CPU run never has it), without Apex's CUDA extensions
    (``apex`` False), without the ``grouped_gemm`` package (``grouped_gemm`` False), or on
    its local layer spec: the TE spec (Megatron-LM's default), CP > 1,
    FP8, grouped GEMM without the ``grouped_gemm`` package, selective recompute of
    ``layernorm``/``mla_up_proj``, MLA with the local spec, and gradient accumulation fusion
    (Megatron-LM's default; ``ColumnParallelLinear`` raises without Apex's
    ``fused_weight_gradient_mlp_cuda``); each line names the flag that avoids it."""
    problems = []
    if not te and args.transformer_impl == "transformer_engine":
        problems.append(
            "--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer "
            "Engine, which this run lacks: install it, or add --transformer-impl local"
        )
    if not apex and args.gradient_accumulation_fusion:
        problems.append(
            "gradient accumulation fusion (Megatron-LM's default) needs Apex's "
            "fused_weight_gradient_mlp_cuda extension, which this run lacks: add "
            "--no-gradient-accumulation-fusion"
        )
    if args.moe_grouped_gemm and not grouped_gemm and args.transformer_impl == "local":
        problems.append(
            "--moe-grouped-gemm on the local spec needs the grouped_gemm package, which this "
            "run lacks: drop it, or use --transformer-impl transformer_engine"
        )
    if not te and args.context_parallel_size > 1:
        problems.append(
            "--context-parallel-size > 1 needs Transformer Engine (megatron-core's "
            "DotProductAttention refuses context parallelism), which this run lacks"
        )
    if not te and getattr(args, "fp8", None):
        problems.append(
            f"--fp8-format {args.fp8} needs Transformer Engine and CUDA, which this run lacks"
        )
    if args.multi_latent_attention and args.transformer_impl == "local":
        problems.append(
            "--multi-latent-attention needs --transformer-impl transformer_engine: megatron-core "
            "0.19's local spec builds MLA's core attention with arguments its "
            "DotProductAttention does not take (a CPU run has no Transformer Engine)"
        )
    modules = set(args.recompute_modules or []) & {"layernorm", "mla_up_proj"}
    if not te and args.recompute_granularity == "selective" and modules:
        problems.append(
            f"--recompute-modules {' '.join(sorted(modules))} needs Transformer Engine (megatron-"
            "core 0.19's CheckpointWithoutOutput calls its FP8GlobalStateManager), which this "
            "run lacks: drop those modules"
        )
    return problems
