"""Settings Megatron-LM 0.19 accepts but cannot run, each found before any work and said in
one line naming the flag (empty: none): what its ``pretrain()`` stops on only after building
the model or in the first step, what its tokenizer builder stops on, what megatron-core
cannot do without Transformer Engine (every CPU run) and what a CPU run cannot do. Each
function reads and returns lines; none raises.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence


def tokenizer_problems(args, *, launch: bool) -> list[str]:
    """The tokenizer settings Megatron-LM's ``set_global_variables`` would stop on with a
    traceback (it builds the tokenizer right after ``validate_args``), one line each naming
    the flag (empty: none). Reads only (whether files exist).

    - no ``--tokenizer-type`` (Megatron-LM 0.19 has no default: "tokenizer_type None is not
      supported"); ``NullTokenizer`` without ``--vocab-size``; ``HuggingFaceTokenizer``
      without ``--tokenizer-model``;
    - in a launch (a dry run may run where the cluster's files are not): a
      ``--tokenizer-model`` file of a SentencePiece type, or ``--vocab-file`` /
      ``--merge-file`` of ``GPT2BPETokenizer``, that does not exist. A Hugging Face
      ``--tokenizer-model`` may be a hub name and is not checked.
    """
    kind = args.tokenizer_type
    if kind is None:
        return ["--tokenizer-type is required (Megatron-LM 0.19 has no default)"]
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
    """In a launch only (a dry run may run where the cluster's packages are not): packages a
    flag needs that are not installed here. ``--wandb-project`` without ``wandb``
    (Megatron-LM imports it in ``set_global_variables``, a traceback on the last rank)."""
    import importlib.util

    if getattr(args, "wandb_project", None) and importlib.util.find_spec("wandb") is None:
        return ["--wandb-project needs the wandb package here: pip install wandb"]
    return []


def late_megatron_problems(args) -> list[str]:
    """Settings Megatron-LM's ``validate_args`` accepts but its ``pretrain()`` refuses only
    after building the model, one line each naming the flag (empty: none). Reads only.

    - neither ``--train-iters`` nor ``--train-samples``, or no ``--lr``, in a training run
      (``get_optimizer_param_scheduler`` raises);
    - ``--finetune`` without a checkpoint to start from (it would train from scratch);

    - ``--lr-decay-style WSD`` without ``--lr-wsd-decay-iters`` (iteration-based run) or
      ``--lr-wsd-decay-samples`` (sample-based run): ``get_optimizer_param_scheduler`` passes
      ``wsd_decay_steps=None`` and ``OptimizerParamScheduler`` asserts on it.
    - no ``--eval-interval`` (0.19's default is None) in a training run without
      ``--full-validation``: ``get_train_valid_test_num_samples`` computes
      ``train_iters // eval_interval`` and stops with a ``TypeError``.
    - ``--full-validation`` with one validation set: ``evaluate()`` indexes the int
      ``--eval-iters`` (``eval_iters[0]`` of ``torch.tensor(int).tolist()``) and stops with a
      ``TypeError`` at the first evaluation (megatron-core 0.19.2).
    - ``--wandb-project`` without ``--wandb-exp-name``: ``set_global_variables`` raises on
      the last rank (``_set_wandb_writer``).
    """
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
    """Model and layout settings megatron-core refuses only while building the model or in
    the first step (megatron-core 0.19), one line each naming the flag (empty: none).

    - ``--moe-router-topk`` above ``--num-experts`` (``torch.topk`` fails in the first step);
    - MoE with TP > 1 and no ``--sequence-parallel`` (``MoELayer.forward`` raises in training);
    - a world size that expert TP x EP x PP does not divide (``initialize_model_parallel``
      raises inside ``pretrain()``);
    - ``--num-query-groups`` that does not divide ``--num-attention-heads`` (a reshape fails in
      the first forward);
    - a shared expert (``--moe-shared-expert-intermediate-size``) with biases (the default
      without ``--disable-bias-linear``: ``SharedExpertMLP`` asserts while building the
      model);
    - ``--num-workers`` below 0 (the ``DataLoader`` refuses it after the model is built).
    """
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


def cpu_problems(args) -> list[str]:
    """Settings a CPU run (``--device cpu``) cannot do, one line each naming the flag (empty:
    none). Reads only.

    - ``--use-distributed-optimizer``: megatron-core's ``DistributedOptimizer`` builds its
      buffers as CUDA tensors (a ``TypeError`` at set-up on a CPU).
    - pipeline parallelism with tied embeddings: megatron-core's embedding-group all-reduce
      of the tied weights calls ``.cuda()``.
    - ``--bf16`` / ``--fp16``: megatron-core's ``Float16OptimizerWithFloat16Params`` accepts
      only ``torch.cuda.*`` parameter types.
    - ``--log-memory-to-tensorboard``: Megatron-LM reads CUDA memory statistics
      (``KeyError: 'reserved_bytes.all.current'`` at the first log line).
    - ``--mtp-num-layers`` with pipeline parallelism: megatron-core gives the last stage its
      own copy of the embedding and sets it up with ``weight.data.cuda()``
      (``LanguageModule.setup_embeddings_and_output_layer``).
    - ``--profile`` without ``--use-pytorch-profiler``: Megatron-LM then starts CUDA's
      profiler (``cudaProfilerStart``) at ``--profile-step-start``.
    """
    problems = []
    if args.profile and not args.use_pytorch_profiler:
        problems.append(
            "--profile starts CUDA's profiler (nsys); drop it for a CPU run (PyTorch's, "
            "--use-pytorch-profiler, is not checked on a CPU)"
        )
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on:
            problems.append(
                f"{flag} needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA "
                "parameters); a CPU run trains in float32: drop it"
            )
    if getattr(args, "log_memory_to_tensorboard", False):
        problems.append(
            "--log-memory-to-tensorboard reads CUDA memory statistics; drop it for a CPU run"
        )
    if args.use_distributed_optimizer:
        problems.append(
            "--use-distributed-optimizer needs CUDA (megatron-core's DistributedOptimizer "
            "builds CUDA buffers); drop it for a CPU run"
        )
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        problems.append(
            "--pipeline-model-parallel-size > 1 on a CPU needs --untie-embeddings-and-output-"
            "weights (megatron-core's tied-embedding all-reduce calls .cuda())"
        )
    if args.pipeline_model_parallel_size > 1 and getattr(args, "mtp_num_layers", None):
        problems.append(
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs CUDA (megatron-core "
            "sets up the last stage's copy of the embedding with .cuda()); drop one for a CPU run"
        )
    return problems


def cpu_flag_problems(argv: Sequence[str]) -> list[str]:
    """The user's own ``--transformer-impl`` / ``--distributed-backend`` that a CPU run's
    :data:`CPU_FLAGS` would override (``local`` / ``gloo``), one line each (empty: none).

    Args:
        argv: the command line as the user gave it, before :data:`CPU_FLAGS` are appended.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--transformer-impl")
    parser.add_argument("--distributed-backend")
    given, _ = parser.parse_known_args(list(argv))
    problems = []
    if given.transformer_impl not in (None, "local"):
        problems.append(
            f"--transformer-impl {given.transformer_impl} needs CUDA; a CPU run uses local "
            "(drop the flag or run with --device cuda)"
        )
    if given.distributed_backend not in (None, "gloo"):
        problems.append(
            f"--distributed-backend {given.distributed_backend} needs CUDA; a CPU run uses "
            "gloo (drop the flag or run with --device cuda)"
        )
    return problems


def without_te_problems(args, *, te: bool) -> list[str]:
    """Features megatron-core 0.19 accepts but cannot run without Transformer Engine (every
    CPU run), or on its local layer spec, one line each naming the flag (empty: none).

    - ``--context-parallel-size`` > 1, or ``--fp8-format``, without TE (megatron-core's
      ``DotProductAttention`` asserts on CP; FP8 would silently not happen);
    - ``--multi-latent-attention`` with ``--transformer-impl local``: the local spec builds
      MLA's core attention with ``k_channels``/``v_channels``, which its
      ``DotProductAttention`` does not take (a ``TypeError`` while building the model).
    - ``--recompute-granularity selective`` of ``layernorm`` or ``mla_up_proj`` without TE:
      megatron-core's ``CheckpointWithoutOutput`` always takes its FP8 branch and calls TE's
      ``FP8GlobalStateManager`` (a ``NameError`` in the first forward).

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        te: Transformer Engine is importable where the run will be (a dry run of a CUDA line
            assumes the cluster has it; a CPU run never has).
    """
    problems = []
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
