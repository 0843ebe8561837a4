"""The one check path of a launch line, before any work: the real launch
(:func:`tst_megatron.training.cli.main`) and ``--dry-run`` both call :func:`check`, which runs
Megatron-LM's parser (an unknown flag is one line, not a usage dump), ``validate_args``, the
model's ``TransformerConfig``, the run plan, then
:func:`tst_megatron.training.checks.launch_problems`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import Optional, Sequence
from unittest import mock

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.cpu_settings import CPU_FLAGS, pick_device
from tst_megatron.training.checks import (
    Launch,
    argv_problems,
    dry_run_assumptions,
    launch_notes,
    launch_problems,
    validation_error,
)
from tst_megatron.training.checks.resume import checkpoint_to_resume
from tst_megatron.training.flags import add_tst_args
from tst_megatron.training.plan import RunPlan, run_plan


@dataclasses.dataclass
class Checked:
    """What :func:`check` found: Megatron-LM's validated ``args`` (None when the parser or
    ``validate_args`` refused), ``device`` (``"cpu"`` or ``"cuda"``), ``problems`` (one line
    each; empty: the launch may start), ``notes`` for the user (the launch and the dry run
    print the same), the run's ``plan`` (:class:`~tst_megatron.training.plan.RunPlan`, built
    once here; None where ``args`` is, or the batch-size schedule was refused) and, in a dry
    run, what it ``assumed`` of the cluster (:mod:`tst_megatron.runtime.assumed`)."""

    args: Optional[argparse.Namespace]
    device: str
    problems: list
    notes: list
    plan: Optional[RunPlan] = None
    assumed: list = dataclasses.field(default_factory=list)


#: The ``args_defaults`` Megatron-LM's ``pretrain_gpt.py`` gives its argument validation.
PRETRAIN_GPT_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


class _ParserError(Exception):
    """Megatron-LM's argument parser rejected the command line (argparse's message)."""


def _parse(argv: Sequence[str]):
    """Megatron-LM's ``parse_args`` of ``argv`` (it reads ``sys.argv``, restored after) with the
    launcher's flags, whose parser raises :class:`_ParserError` instead of printing usage."""
    from megatron.training.arguments import parse_args

    def extra_args(parser):
        def error(message):
            raise _ParserError(message)

        parser.error = error  # this parser object only
        return add_tst_args(parser)

    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt_tst.py", *argv]
    try:
        return parse_args(extra_args_provider=extra_args)
    finally:
        sys.argv = saved


def _load_checkpoint_args(args) -> None:
    """``--use-checkpoint-args``, as Megatron-LM's ``parse_and_validate_args`` does it."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    assert args.load is not None or args.pretrained_checkpoint is not None, (
        "--use-checkpoint-args requires --load or --pretrained-checkpoint argument"
    )
    assert args.non_persistent_ckpt_type != "local", (
        "--use-checkpoint-args is not supported with --non_persistent_ckpt_type=local"
    )
    load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
    load_args_from_checkpoint(args)


def check(argv: Sequence[str], *, dry_run: bool = False, model: str = "gpt") -> Checked:
    """Every check of a launch line for this process's ``WORLD_SIZE``, before any work.

    In order, stopping at the first stage that refuses: :func:`argv_problems`, Megatron-LM's
    ``parse_args``, ``--use-checkpoint-args``, ``validate_args`` (with
    :data:`PRETRAIN_GPT_DEFAULTS`),
    ``core_transformer_config_from_args``, the run's :class:`RunPlan`, then
    :func:`launch_problems` (every rule of :data:`tst_megatron.training.checks.RULES`). A CPU
    run appends
    :data:`CPU_FLAGS` and, in a launch, enables :func:`tst_megatron.runtime.cpu.enable` first.
    A dry run mutes Megatron-LM's prints and answers for the cluster's GPU and TE
    (:mod:`tst_megatron.runtime.assumed`). Starts no process, builds no model, reads no data
    (a resume reads the checkpoint's common state). ``model``: the launcher's model class,
    ``"gpt"`` or ``"hybrid"`` (``Launch.model``).
    """
    from tst_megatron.runtime import assumed

    user_argv, assumptions = list(argv), []
    device = pick_device(user_argv, cuda=True if dry_run else None)
    if refused := argv_problems(user_argv, model):
        return Checked(None, device, refused, [], assumed=assumptions)
    argv = user_argv + list(CPU_FLAGS) if device == "cpu" else user_argv
    if device == "cpu" and not dry_run:
        from tst_megatron.runtime import cpu

        cpu.enable(training=True)
        # validate_args asks for it with TP or CP > 1 before Blackwell
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    def muted():
        return assumed.quiet() if dry_run else contextlib.nullcontext()

    with muted():
        from megatron.training.argument_utils import core_transformer_config_from_args
        from megatron.training.arguments import validate_args

        try:
            args = _parse(argv)
        except _ParserError as exc:
            return Checked(
                None, device, [f"Megatron-LM's argument parser: {exc}"], [], assumed=assumptions
            )
    # a CPU run sets CUDA_DEVICE_MAX_CONNECTIONS=1 itself when unset
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
    env = env if dry_run and device == "cpu" else {}
    gpu = getattr(args, "dry_run_gpu", None)
    cluster = assumed.assumed_cluster(assumptions, gpu) if dry_run else contextlib.nullcontext()
    with cluster, muted(), mock.patch.dict(os.environ, env):
        try:
            if args.use_checkpoint_args:
                _load_checkpoint_args(args)
            validate_args(args, PRETRAIN_GPT_DEFAULTS)
        except SystemExit as exc:  # an exit() of validate_args (argv_problems has those known)
            line = f"Megatron-LM's argument validation exited (status {exc.code}) before any work"
            return Checked(None, device, [line], [], assumed=assumptions)
        except Exception as exc:  # AssertionError, ValueError, RuntimeError, ZeroDivisionError;
            # validate_args stops at its first failed check, so the other checks wait
            return Checked(None, device, [validation_error(exc)], [], assumed=assumptions)
        try:
            config = core_transformer_config_from_args(
                assumed.without_te_kernels(args, assumptions) if dry_run else args
            )
        except Exception as exc:  # AssertionError, ValueError; ZeroDivisionError (no layers)
            problem = validation_error(exc, "TransformerConfig")
            return Checked(args, device, [problem], [], assumed=assumptions)
    try:
        plan = run_plan(args, resumed=_resumed(args))
    except (AssertionError, ValueError) as exc:  # Megatron-LM's batch-size calculator refused
        problem = validation_error(exc, "batch-size schedule")
        return Checked(args, device, [problem], [], assumed=assumptions)
    launch = Launch(args, tuple(user_argv), device, config, plan, launch=not dry_run, model=model)
    if dry_run:
        assumptions += dry_run_assumptions(launch)
    return Checked(
        args, device, launch_problems(launch), launch_notes(launch), plan, assumed=assumptions
    )


def parse(argv: Sequence[str], model: str = "gpt") -> Checked:
    """The launch's :func:`check` of ``argv``, its notes printed on rank 0 (``note: ...``),
    then Megatron-LM's ``set_global_variables`` (as its ``parse_and_validate_args`` does).

    Raises:
        ConfigError: every problem found, one line each.
    """
    from megatron.training.global_vars import set_global_variables

    checked = check(argv, model=model)
    if checked.problems:
        raise ConfigError("\n".join(checked.problems))
    if os.environ.get("RANK", "0") == "0":
        for line in checked.notes:
            print(f"note: {line}", flush=True)
    # saved in every checkpoint's args: a later resume plans the steps already taken with them
    checked.args.tst_global_batches = checked.plan.global_batches
    set_global_variables(checked.args)
    return checked


def _resumed(args) -> Optional[tuple[int, object]]:
    """``(iteration, saved args)`` of the checkpoint this launch resumes, for
    :func:`~tst_megatron.training.plan.run_plan` (None: none, or unreadable, which the resume
    rules report)."""
    try:
        found = checkpoint_to_resume(args)
    except ConfigError:
        return None
    if found is None or found[1].get("args") is None:
        return None
    return found[0], found[1]["args"]
