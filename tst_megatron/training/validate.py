"""The one check path of a launch line, before any work: the real launch
(:func:`tst_megatron.training.cli.main`) and ``--dry-run`` both call :func:`check`, which runs
Megatron-LM's parser (an unknown flag is one line, not a usage dump), ``validate_args``, the
model's ``TransformerConfig``, the run plan, then
:func:`tst_megatron.training.checks.launch_problems`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional, Sequence
from unittest import mock

from tst_megatron.data.gpt_datasets import data_settings
from tst_megatron.data.resume import checkpoint_folder, read_resume
from tst_megatron.errors import ConfigError
from tst_megatron.loop.plan import run_plan
from tst_megatron.models.family import GPT, ModelFamily
from tst_megatron.models.pattern import pattern_of
from tst_megatron.runtime import cpu
from tst_megatron.runtime.distributed import is_rank_zero
from tst_megatron.training import assumed
from tst_megatron.training.argv import CPU_FLAGS, given, pick_device
from tst_megatron.training.checks import (
    Launch,
    argv_problems,
    dry_run_assumptions,
    launch_notes,
    launch_problems,
    validation_error,
)
from tst_megatron.training.checks.resume import current_data_identity
from tst_megatron.training.flags import add_tst_args

#: The ``args_defaults`` Megatron-LM's ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` both give
#: their argument validation (``parse_and_validate_args``).
PRETRAIN_ARGS_DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}


class _ParserError(Exception):
    """Megatron-LM's argument parser rejected the command line (argparse's message)."""


def _parse(argv: Sequence[str]):
    """Megatron-LM's ``parse_args`` of ``argv`` (it reads ``sys.argv``, restored after) with the
    launcher's flags, whose parser raises :class:`_ParserError` instead of printing usage."""
    # Megatron-LM's training package: heavy, imported where it runs
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
    # Megatron-LM's training package: heavy, imported where it runs
    from megatron.training.checkpointing import load_args_from_checkpoint

    assert args.load is not None or args.pretrained_checkpoint is not None, (
        "--use-checkpoint-args requires --load or --pretrained-checkpoint argument"
    )
    assert args.non_persistent_ckpt_type != "local", (
        "--use-checkpoint-args is not supported with --non_persistent_ckpt_type=local"
    )
    load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
    load_args_from_checkpoint(args)


def check(argv: Sequence[str], *, dry_run: bool = False, family: ModelFamily = GPT) -> Launch:
    """Every check of a launch line of ``family``'s launcher for this process's
    ``WORLD_SIZE``, before any work: the returned :class:`Launch` holds its ``problems`` (none:
    the launch may start), ``notes``, and what it found on the way (``args``, ``config``,
    ``plan``; ``assumed`` in a dry run).

    The stages, in order, stopping at the first that finds a problem: :func:`argv_problems`
    (the command line as given), Megatron-LM's ``parse_args``, the checkpoints it would read
    (:func:`_checkpoints`: intact, no code in their pickles), ``--use-checkpoint-args`` with
    ``validate_args`` (:data:`PRETRAIN_ARGS_DEFAULTS`) and ``core_transformer_config_from_args``,
    the run's :class:`RunPlan`, then :func:`launch_problems` (every rule of
    :data:`tst_megatron.training.checks.RULES`). A CPU run appends :data:`CPU_FLAGS` and, in a
    launch, enables :func:`tst_megatron.runtime.cpu.enable` first. A dry run mutes Megatron-LM's
    prints and answers for the cluster's GPU and TE (:mod:`tst_megatron.training.assumed`).
    Starts no process, builds no model, reads no data (a resume reads the checkpoint's common
    state).
    """
    device = pick_device(argv, cuda=True if dry_run else None)
    launch = Launch(tuple(argv), family, device, launch=not dry_run, given=tuple(given(argv)))
    for stage in (_given, _parsed, _checkpoints, _validated, _planned, _ruled):
        stage(launch)
        if launch.problems:
            break
    return launch


def _given(launch: Launch) -> None:
    """The command line as given (:func:`argv_problems`); a CPU launch enables the CPU
    runtime."""
    launch.problems += argv_problems(launch.argv, launch.family, launch.given)
    if launch.device == "cpu" and launch.launch and not launch.problems:
        cpu.enable(training=True)
        # validate_args asks for it with TP or CP > 1 before Blackwell
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _muted(launch: Launch):
    return assumed.quiet() if not launch.launch else contextlib.nullcontext()


def _parsed(launch: Launch) -> None:
    """Megatron-LM's parser (an unknown flag is one line, not a usage dump)."""
    argv = list(launch.argv) + (list(CPU_FLAGS) if launch.device == "cpu" else [])
    with _muted(launch):
        try:
            launch.args = _parse(argv)
        except _ParserError as exc:
            launch.problems.append(f"Megatron-LM's argument parser: {exc}")


def _checkpoints(launch: Launch) -> None:
    """The checkpoints Megatron-LM would read (``--load``, ``--pretrained-checkpoint``), before
    anything reads them (``--use-checkpoint-args`` next, then Megatron-LM's own load, whose
    unpickling is unrestricted): intact, and no pickle in them would run code
    (:func:`~tst_megatron.data.resume.checkpoint_folder`). A dry run also reads
    every entry against its CRC-32 (a launch does not: every rank would read it all)."""
    for flag in ("--load", "--pretrained-checkpoint"):
        try:
            checkpoint_folder(launch.args, flag, crc=not launch.launch)
        except ConfigError as exc:
            launch.problems.append(str(exc))


def _validated(launch: Launch) -> None:
    """``--use-checkpoint-args``, ``validate_args``, what the rules read (:func:`_read`),
    ``--hybrid-layer-pattern`` and the model's ``TransformerConfig``, in a dry run as for the
    cluster's GPU (:func:`~tst_megatron.training.assumed.assumed_cluster`)."""
    # megatron.training (Megatron-LM) is heavy: imported once the command line is known good
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.arguments import validate_args

    args, dry_run = launch.args, not launch.launch
    # a CPU run sets CUDA_DEVICE_MAX_CONNECTIONS=1 itself when unset
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1")}
    env = env if dry_run and launch.device == "cpu" else {}
    gpu = getattr(args, "dry_run_gpu", None)
    cluster = assumed.assumed_cluster(launch.assumed, gpu) if dry_run else contextlib.nullcontext()
    with cluster, _muted(launch), mock.patch.dict(os.environ, env):
        try:
            if args.use_checkpoint_args:
                _load_checkpoint_args(args)
            validate_args(args, PRETRAIN_ARGS_DEFAULTS)
            _read(launch)  # raises nothing
            launch.pattern = pattern_of(args)  # --hybrid-layer-pattern, parsed once, here
        except SystemExit as exc:  # an exit() of validate_args (argv_problems has those known)
            launch.args = None
            launch.problems.append(
                f"Megatron-LM's argument validation exited (status {exc.code}) before any work"
            )
            return
        except Exception as exc:  # AssertionError, ValueError, RuntimeError, ZeroDivisionError;
            # validate_args stops at its first failed check, so the other checks wait
            launch.args = None
            launch.problems.append(validation_error(exc))
            return
        try:
            launch.config = core_transformer_config_from_args(
                assumed.without_te_kernels(args, launch.assumed) if dry_run else args
            )
        except Exception as exc:  # AssertionError, ValueError; ZeroDivisionError (no layers)
            launch.problems.append(validation_error(exc, "TransformerConfig"))


def _read(launch: Launch) -> None:
    """What the rules read, read once after ``validate_args``: the checkpoint this launch
    resumes (:func:`~tst_megatron.data.resume.read_resume`; one that cannot be read is the
    resume rules' line) and the data settings (None when ``--data-args-path`` cannot be read
    or is no text: the data rules' line)."""
    launch.resumed, launch.resume_error = read_resume(launch.args)
    try:
        launch.data = data_settings(launch.args)
    except (OSError, ValueError):  # ValueError: UnicodeDecodeError
        launch.data = None


def _planned(launch: Launch) -> None:
    """The run's :class:`RunPlan` (Megatron-LM's batch-size calculator, the TST schedule)."""
    try:
        launch.plan = run_plan(launch.args, resumed=_resumed(launch))
    except (AssertionError, ValueError) as exc:  # Megatron-LM's batch-size calculator refused
        launch.problems.append(validation_error(exc, "batch-size schedule"))


def _ruled(launch: Launch) -> None:
    """Every launch rule and note; in a dry run, what it could not check here."""
    if not launch.launch:
        launch.assumed += dry_run_assumptions(launch)
    launch.problems += launch_problems(launch)
    launch.notes += launch_notes(launch)


def check_and_set_up(argv: Sequence[str], family: ModelFamily = GPT) -> Launch:
    """The launch's :func:`check` of ``argv``, its notes printed on rank 0 (``note: ...``),
    then Megatron-LM's ``set_global_variables`` (as its ``parse_and_validate_args`` does).

    Raises:
        ConfigError: every problem found, one line each.
    """
    # megatron.training (Megatron-LM) is heavy: imported once the command line is known good
    from megatron.training.global_vars import set_global_variables

    launch = check(argv, family=family)
    if launch.problems:
        raise ConfigError("\n".join(launch.problems))
    if is_rank_zero():
        for line in launch.notes:
            print(f"note: {line}", flush=True)
    # saved in every checkpoint's args: a later resume plans the steps already taken with them
    launch.args.tst_global_batches = launch.plan.global_batches
    # and the identity of its data: a resume on re-preprocessed files is refused (resume rules)
    launch.args.tst_data_identity = current_data_identity(launch.args)
    set_global_variables(launch.args)
    return launch


def _resumed(launch: Launch) -> Optional[tuple[int, object]]:
    """``(iteration, saved args)`` of the checkpoint this launch resumes, for
    :func:`~tst_megatron.loop.plan.run_plan` (None: none, unreadable, which the resume
    rules report, or saved without its args)."""
    if launch.resumed is None or launch.resumed[1].get("args") is None:
        return None
    return launch.resumed[0], launch.resumed[1]["args"]
