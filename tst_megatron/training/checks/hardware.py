"""Hardware rules: what a run needs of the machine it runs on. Transformer Engine, Apex,
``grouped_gemm`` and packages a flag needs; a GPU for ``--device cuda``; and the settings a
CPU run (``--device cpu``) refuses, megatron-core 0.19 needing CUDA for them."""

from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
from megatron.core.optimizer import Adam

from tst_megatron.training.argv import flag_values


def installed_problems(args) -> list[str]:
    """Packages a flag needs that are not installed here (for a launch; a dry run may run
    where the cluster's packages are not): ``--wandb-project`` without ``wandb``."""
    if getattr(args, "wandb_project", None) and importlib.util.find_spec("wandb") is None:
        return ["--wandb-project needs the wandb package here: pip install wandb"]
    return []


def without_te_problems(
    args, *, te: bool, apex: bool = True, grouped_gemm: bool = True, pattern=None
) -> list[str]:
    """Features megatron-core 0.19 cannot run without Transformer Engine (``te`` False: TE
    is not where the run will be; a CPU run never has it), without Apex's CUDA extensions
    (``apex`` False), without the ``grouped_gemm`` package (``grouped_gemm`` False), or on
    its local layer spec: the TE spec (Megatron-LM's default), CP > 1,
    FP8, grouped GEMM without the ``grouped_gemm`` package, selective recompute of
    ``layernorm``/``mla_up_proj``, MLA with the local spec, gradient accumulation fusion
    (Megatron-LM's default; ``ColumnParallelLinear`` raises without Apex's
    ``fused_weight_gradient_mlp_cuda``), and without both TE and Apex the distributed
    optimizer with the legacy ``--ckpt-format torch`` (its load raises ``KeyError: 'step'``
    with torch's AdamW); each line names the flag that avoids it. ``pattern``: the launch's
    parsed ``--hybrid-layer-pattern`` (its MLA/DSA layers are the hybrid rule's)."""
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
    if not (te or apex) and args.use_distributed_optimizer and args.ckpt_format == "torch":
        problems.append(
            "--use-distributed-optimizer with --ckpt-format torch cannot resume without "
            "Transformer Engine or Apex (megatron-core 0.19's load of that optimizer state "
            "raises KeyError: 'step' with torch's AdamW): use --ckpt-format torch_dist "
            "(Megatron-LM's default)"
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
    # a hybrid pattern's MLA or DSA layers ('+', 'D') turn MLA on: the hybrid rule names them
    by_pattern = pattern is not None and (pattern.has("+") or pattern.has("D"))
    if args.multi_latent_attention and args.transformer_impl == "local" and not by_pattern:
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


def cpu_problems(args) -> list[str]:
    """Settings a CPU run cannot do, megatron-core 0.19 needing CUDA for them, one line each:
    ``--bf16``/``--fp16``, ``--log-memory-to-tensorboard``, ``--record-memory-history``,
    ``--profile`` (CUDA's profiler), PP > 1 with tied embeddings or ``--mtp-num-layers``, the
    distributed optimizer's ``fully_reshardable`` checkpoints, any ``--cuda-graph-impl``."""
    problems = []
    if args.use_distributed_optimizer and getattr(args, "dist_ckpt_optim_fully_reshardable", False):
        problems.append(
            "--dist-ckpt-optim-fully-reshardable needs CUDA (megatron-core 0.19's distributed "
            "optimizer gathers that checkpoint's state with .cuda()); drop it for a CPU run "
            "(the default dp_reshardable checkpoints resume, also into another DP size)"
        )
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
    if getattr(args, "cuda_graph_impl", "none") != "none":
        problems.append(
            f"--cuda-graph-impl {args.cuda_graph_impl} captures CUDA graphs, which a CPU has "
            "not (megatron-core's RNG tracker fails at start-up); drop it for a CPU run"
        )
    if getattr(args, "record_memory_history", False):
        problems.append("--record-memory-history records CUDA's allocator; drop it for a CPU run")
    if getattr(args, "log_memory_to_tensorboard", False):
        problems.append(
            "--log-memory-to-tensorboard reads CUDA memory statistics; drop it for a CPU run"
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
    """The user's own ``--transformer-impl`` / ``--distributed-backend`` in ``argv`` (the
    command line as given) that a CPU run's ``CPU_FLAGS`` (``local`` / ``gloo``) would override."""
    given = flag_values(argv, "--transformer-impl", "--distributed-backend")
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


#: The packages a dry run assumes the cluster has (``{name: module it imports}``):
#: :func:`problems` checks them only in a launch.
CLUSTER_PACKAGES = {
    "Transformer Engine": "transformer_engine",
    "Apex": "fused_weight_gradient_mlp_cuda",
    "grouped_gemm": "grouped_gemm",
}


def problems(launch) -> list[str]:
    """The hardware rules of a :class:`~tst_megatron.training.checks.Launch`: in a launch,
    this machine's packages and GPU; in a dry run, the cluster's (a CUDA run is assumed to
    have Transformer Engine, Apex and ``grouped_gemm``)."""
    args, device = launch.args, launch.device

    def here(package: str) -> bool:  # installed where the run will be (a dry run: assumed)
        return device == "cuda" and (
            not launch.launch or importlib.util.find_spec(package) is not None
        )

    found = installed_problems(args) if launch.launch else []
    if launch.launch and getattr(args, "dry_run_gpu", None):  # honoured only by --dry-run
        found.append(
            f"--dry-run-gpu {args.dry_run_gpu} names the GPU a --dry-run checks the line for; a "
            "launch runs on this machine's GPU: drop it, or add --dry-run"
        )
    found += without_te_problems(
        args,
        te=here(CLUSTER_PACKAGES["Transformer Engine"]),
        apex=here(CLUSTER_PACKAGES["Apex"]),
        grouped_gemm=here(CLUSTER_PACKAGES["grouped_gemm"]),
        pattern=launch.pattern,
    )
    if device == "cpu":
        found += cpu_problems(args) + cpu_flag_problems(launch.argv)
    elif launch.launch and not torch.cuda.is_available():
        found.append("--device cuda: no GPU is visible here (use --device cpu for a CPU run)")
    return found


def notes(launch) -> list[str]:
    """That a fused Adam (TE's or Apex's) is not made to start the MTP parameters afresh at
    the switch (:class:`~tst_megatron.loop.switch.FreshAdamForMTP`)."""
    args = launch.args
    mtp = getattr(args, "mtp_num_layers", None) and launch.plan.n1 > 0
    if not (mtp and args.optimizer == "adam" and _group_step_adam()):
        return []
    return [
        "--mtp-num-layers: this machine's Adam (Transformer Engine's or Apex's FusedAdam) "
        "is left as it is at the switch, so the MTP parameters, idle in phase 1, take their "
        "first updates without Adam's bias correction ((1 - beta1) / sqrt(1 - beta2) times "
        "a first step); with torch's AdamW they start afresh"
    ]


def _group_step_adam() -> bool:
    """Whether megatron-core's ``Adam`` is a fused Adam (Transformer Engine's, else Apex's
    ``FusedAdam``; else it is ``torch.optim.AdamW``)."""
    return Adam is not torch.optim.AdamW
