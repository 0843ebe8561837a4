"""The rules a launch line must pass on top of Megatron-LM's ``validate_args`` and
``TransformerConfig``, each a function returning one line per problem, naming the flag
(empty: none); they read and never raise. :mod:`tst_megatron.training.validate` runs them
with Megatron-LM's own checks, for the real launch and ``--dry-run`` alike. Covered: the
rules megatron-core enforces only inside the first step (sequence parallelism, interleaved
pipelines), settings Megatron-LM accepts but cannot run, data flags, TST, FP8 shapes, a CPU
run's limits, and a resume that would not continue its checkpoint's run.
"""

from __future__ import annotations

import os
import traceback
from typing import Sequence

from tst_megatron.errors import ConfigError
from tst_megatron.training.flags import tst_config
from tst_megatron.training.megatron_checks import (
    cpu_flag_problems,
    cpu_problems,
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
    scheduler_problems,
    train_iters,
)


def tst_problems(args, *, config=None) -> list[str]:
    """Every setting this launcher refuses before any work on top of Megatron-LM's
    ``validate_args``, one line each naming the flag (empty: none): what TST cannot run
    (:func:`_tst_setting_problems`), then with ``--fp8-format`` the GEMM shapes Transformer
    Engine would refuse in the first step
    (:func:`~tst_megatron.training.fp8.fp8_shape_problems`). Reads only.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        config: the model's ``TransformerConfig`` when the caller built it (:func:`check`);
            otherwise, with ``--fp8-format``, built here by Megatron-LM's
            ``core_transformer_config_from_args`` (the sizes FP8 checks are Megatron-LM's).
    """
    return _tst_setting_problems(args) + _fp8_problems(args, config)


def _fp8_problems(args, config) -> list[str]:
    """:func:`~tst_megatron.training.fp8.fp8_shape_problems` of the run (empty without FP8)."""
    if not getattr(args, "fp8", None):
        return []
    from tst_megatron.training.fp8 import fp8_shape_problems

    if config is None:
        from megatron.training.argument_utils import core_transformer_config_from_args

        try:
            config = core_transformer_config_from_args(args)
        except (AssertionError, ValueError) as exc:
            return [validation_error(exc, "TransformerConfig")]
    return fp8_shape_problems(
        config, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size
    )


def _tst_setting_problems(args) -> list[str]:
    """The settings TST cannot run, one line each naming the flag. Reads only."""
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
    if getattr(args, "mtp_num_layers", None) and getattr(args, "overlap_param_gather", False):
        problems.append(
            f"--overlap-param-gather is not supported with --mtp-num-layers and a TST phase 1 "
            f"{bags}: the MTP block does not run in phase 1, so a bucket of MTP parameters "
            "would keep its all-gather in flight at the optimizer step; drop the flag"
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


def data_problems(args) -> list[str]:
    """Data flags Megatron-LM accepts that this launcher cannot honour, one line each naming
    the flag (empty: none). Reads only (``--data-args-path``: whether the file is readable).

    - ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path`` /
      ``--per-split-data-args-path``: the datasets provider builds the three splits from one
      blend with ``--split`` (:func:`~tst_megatron.training.data.build_datasets`); without
      this check a run given only these would train on mock data.
    - ``--data-args-path`` naming no readable file, or a file without a word in it (it would
      leave the run on mock data), or without ``--split`` (Megatron-LM's ``validate_args``
      sets its default split only for ``--data-path``; megatron-core's dataset config would
      assert inside ``pretrain()``).
    """
    problems = []
    for flag in (
        "train_data_path",
        "valid_data_path",
        "test_data_path",
        "per_split_data_args_path",
    ):
        if getattr(args, flag, None):
            problems.append(
                f"--{flag.replace('_', '-')} is not supported by this launcher yet; use "
                "--data-path (or --data-args-path) with --split, or --mock-data"
            )
    path = getattr(args, "data_args_path", None)
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        problems.append(f"--data-args-path {path}: no readable file there")
    elif path:
        with open(path) as f:
            if not f.read().split():
                problems.append(
                    f"--data-args-path {path} is empty: it should hold what --data-path would "
                    "(prefixes, optionally with weights)"
                )
        if not args.split:
            problems.append("--data-args-path needs --split (e.g. --split 969,30,1)")
    return problems


def argv_problems(argv: Sequence[str]) -> list[str]:
    """Flags refused as given on the command line, before Megatron-LM parses it (empty:
    none): ``--yaml-cfg`` (Megatron-LM's experimental YAML config replaces the whole parsed
    namespace, so the ``--tst-*`` flags, ``--device`` and a CPU run's :data:`CPU_FLAGS` would
    be lost).

    Args:
        argv: the command line as the user gave it.
    """
    if any(word == "--yaml-cfg" or word.startswith("--yaml-cfg=") for word in argv):
        return [
            "--yaml-cfg is not supported by this launcher: Megatron-LM's experimental YAML "
            "config replaces the whole command line, --tst-* flags included; pass the flags"
        ]
    return []


def parallel_problems(args, config) -> list[str]:
    """Layout rules megatron-core enforces only inside the first training step, one line each
    naming the flag (empty: none). Reads only.

    - Sequence parallelism splits each rank's sequence across TP: ``--seq-length`` / CP must
      be divisible by TP. TST's phases both run ``--seq-length`` positions (phase 1 folds
      ``S*T`` tokens into ``T`` bags), so one rule covers both.
    - The interleaved pipeline schedule (``--num-layers-per-virtual-pipeline-stage`` or
      ``--num-virtual-stages-per-pipeline-rank``) needs, for each global batch of M
      micro-batches, ``PP <= N <= M`` and ``M mod N`` 0 or ``>= PP``, N being
      ``--microbatch-group-size-per-virtual-pipeline-stage`` (default PP): megatron-core's
      ``forward_backward_pipelining_with_interleaving`` (0.19) raises otherwise.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        config: the model's ``TransformerConfig`` (for the micro-batch group size).
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
        total = consumed_samples(args, train_iters(args))
        batches = {batch for first, batch in global_batches(args) if first < total}
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


def schedule_problems(args) -> list[str]:
    """Megatron-LM's checks of ``--step-batch-size-schedule``: the divisibility of each global
    batch the run reaches by micro-batch x DP, which ``train()`` asserts only when it gets
    there (``update_num_microbatches(..., consistency_check=True)``). The calculator's own
    checks raise when it is built (:func:`check` reports them)."""
    if _batch_calculator(args) is None:
        return []
    per_step = args.micro_batch_size * args.data_parallel_size
    total = consumed_samples(args, train_iters(args))
    return [
        f"--step-batch-size-schedule: global batch {batch} (from sample {first:,}) is not "
        f"divisible by --micro-batch-size {args.micro_batch_size} x data-parallel size "
        f"{args.data_parallel_size}; Megatron-LM asserts it when the run gets there"
        for first, batch in global_batches(args)
        if first < total and batch % per_step
    ]


def resume_checks(args) -> list[str]:
    """The problems of resuming the checkpoint ``--load`` holds (empty: nothing to resume):
    :func:`~tst_megatron.training.plan.resume_problems` (TST) and
    :func:`~tst_megatron.training.plan.scheduler_problems` (Megatron-LM's schedule check)."""
    try:
        found = checkpoint_to_resume(args)
    except ConfigError as exc:
        return [str(exc)]
    if found is None:
        return []
    iteration, common = found
    saved = common.get("args")
    problems = [] if saved is None else resume_problems(args, saved, iteration)
    problems += [] if saved is None else architecture_problems(args, saved)
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
"""The flags whose change makes a checkpoint's weights another model's. Megatron-LM's
``check_checkpoint_args`` compares the first, second and fourth only, and only while loading
(an assertion after the model is built); the others fail later still, as a shape or key
mismatch inside megatron-core's checkpoint loader."""


def architecture_problems(args, saved) -> list[str]:
    """One line naming every model flag of ``args`` that differs from the checkpoint's
    ``saved`` arguments, with both values (empty: none, or ``--use-checkpoint-args``, which
    takes the checkpoint's)."""
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
    """What the user should know before the run starts, one line each (empty: nothing).

    - ``--moe-router-load-balancing-type global_aux_loss``: megatron-core (0.19) accumulates
      its token counts over the micro-batches and data-parallel ranks of a step, so the loss
      and its gradient depend on the layout (DP x micro-batches), unlike ``aux_loss``.
    """
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    notes = []
    if args.num_experts and "global_aux_loss" in kinds:
        notes.append(
            "--moe-router-load-balancing-type global_aux_loss: megatron-core counts the tokens "
            "per expert over the data-parallel ranks and micro-batches of a step, so its value "
            "and gradient change with DP and --micro-batch-size (the same run under another "
            "layout trains differently; aux_loss does not). TST keeps its meaning: a phase-1 "
            "bag counts as one token"
        )
    return notes


def launch_problems(
    args,
    user_argv: Sequence[str],
    *,
    device: str,
    config=None,
    launch: bool = False,
) -> list[str]:
    """Everything the launcher refuses after Megatron-LM's ``validate_args`` and
    ``TransformerConfig``, one line each (empty: none): :func:`schedule_problems`,
    :func:`parallel_problems`, :func:`late_megatron_problems`, :func:`data_problems`,
    :func:`tokenizer_problems`,
    in a launch :func:`installed_problems`, :func:`tst_problems`, :func:`without_te_problems`, for a CPU run :func:`cpu_problems` and
    :func:`cpu_flag_problems`, and, when nothing else is wrong, :func:`resume_checks`.

    Args:
        args: Megatron-LM's arguments after ``validate_args``.
        user_argv: the command line as given, before :data:`CPU_FLAGS` are appended.
        device: ``"cpu"`` or ``"cuda"``.
        config: the model's ``TransformerConfig``.
        launch: a real launch (not a dry run): ``--device cuda`` must see a GPU, and
            Transformer Engine is what is installed here (a dry run assumes the cluster's).
    """
    import importlib.util

    import torch

    problems = schedule_problems(args) + parallel_problems(args, config)
    problems += model_problems(args) + late_megatron_problems(args) + data_problems(args)
    problems += tokenizer_problems(args, launch=launch)
    problems += installed_problems(args) if launch else []
    problems += tst_problems(args, config=config)
    te = device == "cuda" and (
        not launch or importlib.util.find_spec("transformer_engine") is not None
    )
    problems += without_te_problems(args, te=te)
    if device == "cpu":
        problems += cpu_problems(args) + cpu_flag_problems(user_argv)
    elif launch and not torch.cuda.is_available():
        problems.append("--device cuda: no GPU is visible here (use --device cpu for a CPU run)")
    return problems or resume_checks(args)


def validation_error(exc: BaseException, where: str = "argument validation") -> str:
    """One line for an exception raised by Megatron-LM's checks (``where``: which): its
    message with whitespace collapsed or, for a bare ``assert``, the failing source line and
    where it is (``file:line``)."""
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
