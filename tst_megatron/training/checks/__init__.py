"""The launcher's rules, one module per subject, on top of Megatron-LM's ``validate_args`` and
``TransformerConfig`` (which stay Megatron-LM's): :mod:`.layout`, :mod:`.batch`, :mod:`.model`
(with each model family's own, ``FAMILY_RULES``), :mod:`.data`, :mod:`.tst`, :mod:`.fp8` (the
GEMM shapes FP8 needs), :mod:`.unsupported` (settings Megatron-LM 0.19 accepts but cannot run,
and the flags this launcher refuses), :mod:`.deprecated` (flags Megatron-LM 0.19 parses but no
longer runs as written), :mod:`.hardware` (TE, Apex, GPU, CPU), :mod:`.outputs` (the folders
it writes), :mod:`.resume` and :mod:`.architecture` (a checkpoint this run would not
continue). Each rule is a function of the :class:`Launch` returning one line per problem
naming the flag (empty: none). :data:`RULES` and :data:`NOTES` are the one list of errors and
the one list of notes that the real launch and the dry run both print
(:func:`tst_megatron.training.validate.check`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import traceback
from typing import Any, Optional, Sequence

from tst_megatron.data.gpt_datasets import DataSettings
from tst_megatron.loop.plan import RunPlan
from tst_megatron.models.pattern import HybridPattern
from tst_megatron.training import assumed
from tst_megatron.training.checks import (
    batch,
    data,
    deprecated,
    fp8,
    hardware,
    layout,
    model,
    outputs,
    reads,
    resume,
    tst,
    unsupported,
)


@dataclasses.dataclass
class Launch:
    """One launch line and what its checks found: the record the rules read and
    :func:`tst_megatron.training.validate.check` returns (to the launch and the dry run).

    Attributes:
        argv: the command line as given, before a CPU run's ``CPU_FLAGS`` are appended.
        family: the :class:`~tst_megatron.models.family.ModelFamily` the launcher builds.
        device: ``"cpu"`` or ``"cuda"``.
        launch: a real launch, which checks this machine (a GPU, installed packages, data
            files); False: a dry run, which assumes the cluster's.
        args: Megatron-LM's arguments after ``validate_args`` (None until then, or when the
            parser or ``validate_args`` refused).
        config: the model's ``TransformerConfig`` (None until built).
        plan: the run's :class:`~tst_megatron.loop.plan.RunPlan` (None until planned).
        pattern: ``--hybrid-layer-pattern`` parsed once
            (:class:`~tst_megatron.models.pattern.HybridPattern`), after ``validate_args``
            accepted it; None for a ``GPTModel`` (or until then).
        given: the flags of ``argv`` as given, in order
            (:func:`~tst_megatron.training.argv.given`).
        resumed: ``(iteration, common state)`` of the checkpoint this launch resumes
            (:func:`~tst_megatron.data.resume.read_resume`), read once after ``validate_args``;
            None: nothing to resume, or ``resume_error``.
        resume_error: the one line saying why that checkpoint cannot be read (the resume rules
            print it), else None.
        data: the :class:`~tst_megatron.data.gpt_datasets.DataSettings` of ``args``, read once
            after ``validate_args``; None until then, or when ``--data-args-path`` cannot be
            read (the data rules say so).
        problems: one line each; empty: the launch may start.
        notes: ``note:`` lines for the user (the launch and the dry run print the same).
        assumed: in a dry run, what it assumed of the cluster
            (:mod:`tst_megatron.training.assumed`).
    """

    argv: tuple
    family: Any
    device: str
    launch: bool = False
    args: Optional[argparse.Namespace] = None
    config: Optional[Any] = None
    plan: Optional[RunPlan] = None
    pattern: Optional[HybridPattern] = None
    given: tuple = ()
    resumed: Optional[tuple[int, dict]] = None
    resume_error: Optional[str] = None
    data: Optional[DataSettings] = None
    problems: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)
    assumed: list = dataclasses.field(default_factory=list)


#: Every rule, in the order its lines are printed.
RULES = (
    batch.problems,
    layout.problems,
    model.problems,
    unsupported.problems,
    deprecated.problems,
    data.problems,
    hardware.problems,
    tst.problems,
    fp8.problems,
)

#: Rules that run only when :data:`RULES` found nothing: they read files (the data, the
#: checkpoint to resume) and probe the output folders, which a wrong line need not reach.
LAST_RULES = (data.file_problems, outputs.problems, resume.problems)

#: What the user should know before the run starts (``note:`` lines, printed by the launch on
#: rank 0 and by the dry run).
NOTES = (
    tst.notes,
    reads.notes,
    model.notes,
    unsupported.notes,
    deprecated.notes,
    hardware.notes,
    resume.notes,
)


def argv_problems(argv: Sequence[str], family, flags: Sequence[str]) -> list[str]:
    """Flags refused in the command line as given, before Megatron-LM parses it, one line each:
    ``--yaml-cfg`` (its YAML config replaces the whole parsed namespace, ``--tst-*`` included),
    the flags on which ``validate_args`` exits with status 0 (:func:`.deprecated.stop_problems`)
    and ``family``'s own (:data:`.model.FAMILY_RULES`: the GPT
    launcher refuses ``pretrain_hybrid.py``'s flags, the hybrid launcher a missing or empty
    pattern). ``flags``: those of ``argv`` as given (:attr:`Launch.given`)."""
    problems = []
    if "--yaml-cfg" in flags:
        problems.append(
            "--yaml-cfg is not supported by this launcher: Megatron-LM's experimental YAML "
            "config replaces the whole command line, --tst-* flags included; pass the flags"
        )
    return problems + deprecated.stop_problems(flags) + model.family_argv_problems(family, argv)


def launch_problems(launch: Launch) -> list[str]:
    """Every rule of :data:`RULES`, then, when none found a problem, :data:`LAST_RULES`."""
    problems = [line for rule in RULES for line in rule(launch)]
    if problems:
        return problems
    for rule in LAST_RULES:
        if problems := rule(launch):
            return problems
    return []


def dry_run_assumptions(launch: Launch) -> list[str]:
    """The ``assumed:`` lines of a dry run for
    :data:`~tst_megatron.training.assumed.DRY_RUN_SKIPS`: each check it could not run here, and
    why."""
    lines = []
    if missing := data.files_not_here(launch.args, launch.data):
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        lines.append(f"not here, so not checked: {shown} ({assumed.DRY_RUN_SKIPS['files']})")
    if hub := data.hub_tokenizer(launch.args):
        lines.append(
            f"--tokenizer-model {hub} is not here: taken as a Hugging Face hub name, which the "
            "cluster must download or find in its Hugging Face cache (HF_HOME)"
        )
    if away := outputs.not_here(launch.args):
        lines.append(f"not here, so not probed for writing: {', '.join(away)}")
    if launch.device == "cuda":
        absent = [
            name
            for name, module in hardware.CLUSTER_PACKAGES.items()
            if importlib.util.find_spec(module) is None
        ]
        if absent:
            lines.append(
                f"{', '.join(absent)} not installed here: assumed installed on the cluster"
            )
        kernels = [package for _, package in model.missing_packages(launch.pattern)]
        if kernels:
            lines.append(
                f"{', '.join(kernels)} not installed here: assumed installed on the cluster"
            )
    return lines


def launch_notes(launch: Launch) -> list[str]:
    """Every note of :data:`NOTES`, one line each."""
    return [line for note in NOTES for line in note(launch)]


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
