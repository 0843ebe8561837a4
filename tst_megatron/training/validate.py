"""One path for every check of a launch line, before any work: the real launch
(:func:`tst_megatron.training.cli.main`) and ``--dry-run`` both call :func:`check`.

Megatron-LM's parser (an unknown flag is one line, not a usage dump), ``validate_args``, the
model's ``TransformerConfig`` (its ``__post_init__`` checks what ``validate_args`` does not:
heads divisible by TP, MoE biases at expert TP > 1, MLA), then the launcher's rules
(:func:`tst_megatron.training.checks.launch_problems`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
from typing import Optional, Sequence
from unittest import mock

from tst_megatron.errors import ConfigError
from tst_megatron.training.checks import (
    argv_problems,
    launch_notes,
    launch_problems,
    validation_error,
)
from tst_megatron.training.flags import CPU_FLAGS, add_tst_args, pick_device


@dataclasses.dataclass
class Checked:
    """What :func:`check` found."""

    args: Optional[argparse.Namespace]
    """Megatron-LM's validated arguments (None when the parser or validation refused)."""
    config: object
    """The model's ``TransformerConfig`` (None when not built)."""
    device: str
    """``"cpu"`` or ``"cuda"``."""
    problems: list
    """One line per problem (empty: the launch may start)."""
    notes: list
    """One line per note for the user (and what a dry run assumed)."""


class _ParserError(Exception):
    """Megatron-LM's argument parser rejected the command line (argparse's message)."""


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The launcher's flags added to ``parser`` (Megatron-LM's, built for this call), whose
    ``error`` raises :class:`_ParserError` instead of printing the whole usage and exiting."""

    def error(message):
        raise _ParserError(message)

    parser = add_tst_args(parser)
    parser.error = error  # this parser object only
    return parser


def _parse(argv: Sequence[str]):
    """Megatron-LM's ``parse_args`` with the launcher's flags on ``argv`` (it reads
    ``sys.argv``, restored after)."""
    from megatron.training.arguments import parse_args

    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt_tst.py", *argv]
    try:
        return parse_args(extra_args_provider=_one_line_errors)
    finally:
        sys.argv = saved


def _load_checkpoint_args(args) -> None:
    """``--use-checkpoint-args``: the model arguments from the checkpoint, as Megatron-LM's
    ``parse_and_validate_args`` reads them before ``validate_args``."""
    from megatron.training.checkpointing import load_args_from_checkpoint

    assert args.load is not None or args.pretrained_checkpoint is not None, (
        "--use-checkpoint-args requires --load or --pretrained-checkpoint argument"
    )
    load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
    load_args_from_checkpoint(args)


def check(argv: Sequence[str], *, dry_run: bool = False) -> Checked:
    """Every check of a launch line for this process's ``WORLD_SIZE``, before any work.

    In order, stopping at the first stage that fails: :func:`argv_problems`; Megatron-LM's
    ``parse_args`` with the launcher's flags (one line for an unknown flag or a bad value);
    ``--use-checkpoint-args``; ``validate_args``; ``core_transformer_config_from_args``; then
    :func:`launch_problems`. A CPU run (``--device cpu``) appends :data:`CPU_FLAGS` first.

    A real launch on a CPU enables the CPU runtime (:func:`tst_megatron.runtime.cpu.enable`)
    before validating, so Megatron-LM asks its stand-in; Megatron-LM's prints are shown. A
    dry run (``dry_run``) captures Megatron-LM's prints and warnings and answers for the
    cluster's GPU and Transformer Engine (:mod:`tst_megatron.training.assumed`); its notes
    say so. Neither starts a process, builds a model or reads data (a resume reads the
    checkpoint's common state).
    """
    from tst_megatron.training import assumed

    argv, notes = list(argv), []
    device = pick_device(argv, cuda=True if dry_run else None)
    refused = argv_problems(argv)
    if refused:
        return Checked(None, None, device, refused, notes)
    user_argv = list(argv)
    if device == "cpu":
        argv += list(CPU_FLAGS)
        if not dry_run:
            from tst_megatron.runtime import cpu

            cpu.enable(training=True)
            # validate_args asks for it with TP or CP > 1 before Blackwell; a CPU has no CUDA
            # connections to limit
            os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    captured = io.StringIO()

    def muted():
        stack = contextlib.ExitStack()
        if dry_run:
            stack.enter_context(assumed.quiet())
            stack.enter_context(contextlib.redirect_stdout(captured))
        return stack

    with muted():
        from megatron.training.argument_utils import core_transformer_config_from_args
        from megatron.training.arguments import validate_args

        try:
            args = _parse(argv)
        except _ParserError as exc:
            return Checked(None, None, device, [f"Megatron-LM's argument parser: {exc}"], notes)
    env = {}
    if dry_run:  # a CPU run sets CUDA_DEVICE_MAX_CONNECTIONS=1 itself when unset
        connections = os.environ.get(
            "CUDA_DEVICE_MAX_CONNECTIONS", "1" if device == "cpu" else None
        )
        env = {} if connections is None else {"CUDA_DEVICE_MAX_CONNECTIONS": connections}
    cluster = assumed.assumed_cluster(notes) if dry_run else contextlib.nullcontext()
    with cluster, muted(), mock.patch.dict(os.environ, env):
        try:
            if args.use_checkpoint_args:
                _load_checkpoint_args(args)
            validate_args(args)
        except Exception as exc:  # AssertionError, ValueError, RuntimeError, ZeroDivisionError
            # (a parallel size of 0): validate_args stops at its first failed check and leaves
            # the arguments half filled in, so the other checks wait
            return Checked(None, None, device, [validation_error(exc)], notes)
        try:
            config = core_transformer_config_from_args(
                assumed.without_te_kernels(args, notes) if dry_run else args
            )
        except (AssertionError, ValueError) as exc:
            return Checked(args, None, device, [validation_error(exc, "TransformerConfig")], notes)
    try:
        problems = launch_problems(
            args, user_argv, device=device, config=config, launch=not dry_run
        )
    except (AssertionError, ValueError) as exc:  # Megatron-LM's batch-size calculator refused
        problems = [validation_error(exc, "batch-size schedule")]
    return Checked(args, config, device, problems, launch_notes(args) + notes)


def parse(argv: Sequence[str]) -> Checked:
    """The launch's :func:`check` of ``argv``; then Megatron-LM's global arguments, tokenizer
    and writers are set (``set_global_variables``, as its ``parse_and_validate_args`` does)
    and the notes are printed on rank 0 (``note: ...``).

    Raises:
        ConfigError: every problem found, one line each.
    """
    from megatron.training.global_vars import set_global_variables

    checked = check(argv)
    if checked.problems:
        raise ConfigError("\n".join(checked.problems))
    if os.environ.get("RANK", "0") == "0":
        for line in checked.notes:
            print(f"note: {line}", flush=True)
    set_global_variables(checked.args)
    return checked
