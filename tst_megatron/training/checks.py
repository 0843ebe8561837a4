"""The launcher's rules on top of Megatron-LM's ``validate_args`` and ``TransformerConfig``,
each a function that reads only and returns one line per problem naming the flag (empty:
none): TST, data flags, layout rules megatron-core enforces only in the first step, and a
resume that would not continue its checkpoint's run. Megatron-LM's own late refusals are in
:mod:`tst_megatron.training.megatron_checks`.
"""

from __future__ import annotations

import importlib.util
import os
import traceback
from typing import Sequence

import torch

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.cpu_settings import cpu_flag_problems, cpu_problems
from tst_megatron.training.flags import refused_flags, tst_config
from tst_megatron.training.megatron_checks import (
    installed_problems,
    late_megatron_problems,
    model_problems,
    tokenizer_problems,
    without_te_problems,
)
from tst_megatron.training.plan import (
    _batch_calculator,
    checkpoint_to_resume,
    consumed_samples,
    global_batches,
    resume_problems,
    schedule,
    scheduler_problems,
    train_iters,
)


def tst_problems(args, *, config=None) -> list[str]:
    """What TST cannot run (:func:`_tst_setting_problems`), then with ``--fp8-format`` the GEMM
    shapes Transformer Engine would refuse in the first step
    (:func:`~tst_megatron.runtime.fp8.fp8_shape_problems` of ``config``, the model's
    ``TransformerConfig``, which FP8 needs). ``args``: Megatron-LM's, after ``validate_args``.
    """
    problems = _tst_setting_problems(args)
    if not getattr(args, "fp8", None):
        return problems
    from tst_megatron.runtime.fp8 import fp8_shape_problems

    return problems + fp8_shape_problems(
        config, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size
    )


def _tst_setting_problems(args) -> list[str]:
    """The settings TST cannot run, one line each naming the flag."""
    tst = tst_config(args)
    iters = train_iters(args)
    problems = tst.validate(max(iters, 1))
    if problems or tst.phase1_steps(iters) == 0:
        return problems
    bags = "(--tst-bag-size > 1)"
    for flag, on in (
        ("--reset-position-ids", args.reset_position_ids),
        ("--reset-attention-mask", args.reset_attention_mask),
    ):
        if on:
            problems.append(
                f"{flag} is not supported in TST phase 1 {bags}: bags are formed on the packed "
                "token stream; drop the flag or set --tst-bag-size 1"
            )
    if getattr(args, "phase_transition_iterations", None):
        problems.append(
            f"--phase-transition-iterations is not supported with TST {bags}: it restarts "
            "the sampler in each phase; TST switches in-process at N1"
        )
    if args.dataloader_type != "single":
        problems.append(
            f"--dataloader-type {args.dataloader_type} is not supported with TST {bags}: the "
            "phase of a sample is read from its position in the 'single' sampler's order"
        )
    return problems


#: Megatron-LM's flags of ``pretrain_hybrid.py``'s ``HybridModel`` (layer pattern, Mamba mixer):
#: this launcher builds a ``GPTModel``, which reads none of them. Exact flags, and a prefix.
HYBRID_FLAGS = (
    "--hybrid-layer-pattern",
    "--hybrid-override-pattern",
    "--mtp-hybrid-override-pattern",
    "--is-hybrid-model",
    "--disable-mamba-mem-eff-path",
)
HYBRID_FLAG_PREFIX = "--mamba-"


def argv_problems(argv: Sequence[str]) -> list[str]:
    """Flags refused in the command line as given, before Megatron-LM parses it, one line each:
    ``--yaml-cfg`` (its YAML config replaces the whole parsed namespace, ``--tst-*`` included),
    and the ``HybridModel`` flags (:data:`HYBRID_FLAGS`, ``--mamba-*``), which a ``GPTModel``
    would silently ignore (Megatron-LM's parser accepts them for every model; its
    ``validate_args`` even resets ``--num-layers`` from a pattern)."""
    problems = []
    flags = [word.split("=", 1)[0] for word in argv if word.startswith("--")]
    if "--yaml-cfg" in flags:
        problems.append(
            "--yaml-cfg is not supported by this launcher: Megatron-LM's experimental YAML "
            "config replaces the whole command line, --tst-* flags included; pass the flags"
        )
    hybrid = [f for f in flags if f in HYBRID_FLAGS or f.startswith(HYBRID_FLAG_PREFIX)]
    if hybrid:
        problems.append(
            f"{', '.join(dict.fromkeys(hybrid))}: a HybridModel flag (pretrain_hybrid.py's); "
            "this launcher builds pretrain_gpt.py's GPTModel, which would ignore it; drop it "
            "(HybridModel runs are not supported by this launcher)"
        )
    return problems


def parallel_problems(args, config) -> list[str]:
    """Layout rules megatron-core enforces only inside the first training step:

    - sequence parallelism: ``--seq-length`` / CP divisible by TP (both TST phases run
      ``--seq-length`` positions);
    - the interleaved pipeline, for each global batch of M micro-batches and group size N
      (``config.microbatch_group_size_per_vp_stage``, default PP): ``PP <= N <= M`` and
      ``M mod N`` 0 or ``>= PP`` (megatron-core 0.19's
      ``forward_backward_pipelining_with_interleaving`` raises otherwise).
    """
    problems = []
    tp, cp, t = args.tensor_model_parallel_size, args.context_parallel_size, args.seq_length
    if args.sequence_parallel and tp > 1 and t % (cp * tp):
        problems.append(
            f"--seq-length {t} with --sequence-parallel: each rank's {t // cp if t % cp == 0 else t / cp:g} "
            f"positions (--seq-length / CP {cp}) must be divisible by "
            f"--tensor-model-parallel-size {tp}; give a --seq-length divisible by {cp * tp}"
        )
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    if pp > 1 and vpp and vpp > 1:
        group = getattr(config, "microbatch_group_size_per_vp_stage", None) or pp
        per_step = args.micro_batch_size * args.data_parallel_size
        batches = {batch for _, batch in _reached_batches(args)}
        if getattr(args, "eval_iters", 0):
            batches.add(getattr(args, "eval_global_batch_size", None) or args.global_batch_size)
        for batch in sorted(batches):
            m = batch // per_step
            if not pp <= group <= m or 0 < m % group < pp:
                problems.append(
                    f"the interleaved pipeline (PP {pp}, {vpp} virtual stages) with global batch "
                    f"{batch} = {m} micro-batches of {args.micro_batch_size} x DP "
                    f"{args.data_parallel_size}: megatron-core needs PP {pp} <= "
                    f"--microbatch-group-size-per-virtual-pipeline-stage {group} <= {m} and "
                    f"{m} mod {group} = 0 or >= {pp}; change --global-batch-size or the group size"
                )
    return problems


def _reached_batches(args) -> list[tuple[int, int]]:
    """``[(first sample, global batch)]`` of the global batches the run reaches."""
    total = consumed_samples(args, train_iters(args))
    return [(first, batch) for first, batch in global_batches(args) if first < total]


def schedule_problems(args) -> list[str]:
    """Each global batch of ``--step-batch-size-schedule`` the run reaches that micro-batch x
    DP does not divide: Megatron-LM's ``train()`` asserts it only when it gets there. Raises
    what Megatron-LM's batch-size calculator raises for a malformed schedule."""
    if _batch_calculator(args) is None:
        return []
    per_step = args.micro_batch_size * args.data_parallel_size
    return [
        f"--step-batch-size-schedule: global batch {batch} (from sample {first:,}) is not "
        f"divisible by --micro-batch-size {args.micro_batch_size} x data-parallel size "
        f"{args.data_parallel_size}; Megatron-LM asserts it when the run gets there"
        for first, batch in _reached_batches(args)
        if batch % per_step
    ]


def resume_checks(args) -> list[str]:
    """The problems of resuming the checkpoint in ``--load`` (empty: none, or nothing to
    resume): TST's, the model's (:func:`architecture_problems`) and the LR schedule's."""
    try:
        found = checkpoint_to_resume(args)
    except ConfigError as exc:
        return [str(exc)]
    if found is None:
        return []
    iteration, common = found
    saved, problems = common.get("args"), []
    if saved is not None:
        problems = resume_problems(args, saved, iteration) + architecture_problems(args, saved)
    return problems + scheduler_problems(args, common.get("opt_param_scheduler"), iteration)


ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "swiglu",
    "normalization",
    "qk_layernorm",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "multi_latent_attention",
    "mtp_num_layers",
)
"""The flags whose change makes a checkpoint another model's. Megatron-LM's
``check_checkpoint_args`` compares three of them, and only after the model is built."""


def architecture_problems(args, saved) -> list[str]:
    """One line naming each :data:`ARCHITECTURE` flag of ``args`` that differs from the
    checkpoint's ``saved`` arguments (empty: none, or ``--use-checkpoint-args``)."""
    if getattr(args, "use_checkpoint_args", False):
        return []
    changed = []
    for name in ARCHITECTURE:
        if not hasattr(saved, name):
            continue
        if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
            continue
        was, now = getattr(saved, name), getattr(args, name, None)
        if was != now:
            changed.append(f"--{name.replace('_', '-')} {was} (this run: {now})")
    if not changed:
        return []
    return [
        f"the checkpoint in --load {args.load} is of another model: {', '.join(changed)}; give "
        "the checkpoint's model flags (or --use-checkpoint-args)"
    ]


def launch_notes(args) -> list[str]:
    """What the user should know before the run starts, one line each: the TST settings'
    (``TSTConfig.notes``), that megatron-core 0.19's ``global_aux_loss`` counts tokens over DP
    and micro-batches (layout-dependent), and that a fused Adam is not made to start MTP afresh
    at the switch (:class:`~tst_megatron.training.switch.FreshAdamForMTP`)."""
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    notes = tst_config(args).notes(train_iters(args))
    if args.num_experts and "global_aux_loss" in kinds:
        notes.append(
            "--moe-router-load-balancing-type global_aux_loss: megatron-core counts the tokens "
            "per expert over the data-parallel ranks and micro-batches of a step, so its value "
            "and gradient change with DP and --micro-batch-size (the same run under another "
            "layout trains differently; aux_loss does not). TST keeps its meaning: a phase-1 "
            "bag counts as one token"
        )
    mtp = getattr(args, "mtp_num_layers", None) and schedule(args).n1 > 0
    if mtp and args.optimizer == "adam" and _group_step_adam():
        notes.append(
            "--mtp-num-layers: this machine's Adam (Transformer Engine's or Apex's FusedAdam) "
            "is left as it is at the switch, so the MTP parameters, idle in phase 1, take their "
            "first updates without Adam's bias correction ((1 - beta1) / sqrt(1 - beta2) times "
            "a first step); with torch's AdamW they start afresh"
        )
    return notes


def _group_step_adam() -> bool:
    """Whether megatron-core's ``Adam`` is a fused Adam (Transformer Engine's, else Apex's
    ``FusedAdam``; else it is ``torch.optim.AdamW``)."""
    from megatron.core.optimizer import Adam

    return Adam is not torch.optim.AdamW


def launch_problems(
    args, user_argv: Sequence[str], *, device: str, config=None, launch: bool = False
) -> list[str]:
    """Every rule of this module, :mod:`~tst_megatron.training.megatron_checks` and
    :mod:`~tst_megatron.runtime.cpu_settings`, one line each; in a launch the data files
    (:func:`~tst_megatron.data.gpt_datasets.data_file_problems`); :func:`resume_checks` only
    when nothing else is wrong.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        user_argv: the command line as given, before :data:`CPU_FLAGS` are appended.
        device: ``"cpu"`` or ``"cuda"``.
        config: the model's ``TransformerConfig``.
        launch: a real launch, which checks this machine (a GPU, installed packages, TE);
            a dry run assumes the cluster's.

    Raises:
        AssertionError, ValueError: Megatron-LM's batch-size calculator refused the schedule.
    """
    from tst_megatron.data.gpt_datasets import data_file_problems, data_problems

    problems = schedule_problems(args) + parallel_problems(args, config)
    problems += model_problems(args) + late_megatron_problems(args) + data_problems(args)
    problems += tokenizer_problems(args, launch=launch)
    problems += [
        f"--{flag.replace('_', '-')} is not supported by this launcher: {why}"
        for flag, why in refused_flags().items()
        if getattr(args, flag, False)
    ]
    problems += installed_problems(args) if launch else []
    problems += tst_problems(args, config=config)

    def here(package: str) -> bool:  # installed where the run will be (a dry run: assumed)
        return device == "cuda" and (not launch or importlib.util.find_spec(package) is not None)

    problems += without_te_problems(
        args,
        te=here("transformer_engine"),
        apex=here("fused_weight_gradient_mlp_cuda"),
        grouped_gemm=here("grouped_gemm"),
    )
    if device == "cpu":
        problems += cpu_problems(args) + cpu_flag_problems(user_argv)
    elif launch and not torch.cuda.is_available():
        problems.append("--device cuda: no GPU is visible here (use --device cpu for a CPU run)")
    if launch and not problems:
        problems += data_file_problems(args)
    return problems or resume_checks(args)


def validation_error(exc: BaseException, where: str = "argument validation") -> str:
    """One line for an exception raised by Megatron-LM's checks (``where``): its message with
    whitespace collapsed or, for a bare ``assert``, the failing source line and ``file:line``."""
    message = " ".join(str(exc).split())
    if message and isinstance(exc, (AssertionError, ValueError)):
        return f"Megatron-LM's {where}: {message}"
    if message:
        return f"Megatron-LM's {where}: {type(exc).__name__}: {message}"
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return f"Megatron-LM's {where}: {type(exc).__name__}"
    frame = frames[-1]
    place = "/".join(frame.filename.split(os.sep)[-3:])
    return (
        f"Megatron-LM's {where}: {type(exc).__name__} at {place}:{frame.lineno}: "
        f"{(frame.line or '').strip()}"
    )
