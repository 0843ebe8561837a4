"""The launcher's own flags (``--tst-*``, ``--dry-run``, ``--device``) and the Megatron-LM
flags it refuses (:func:`refused_flags`)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import typing

from tst_megatron.runtime.assumed import DEFAULT_GPU, DRY_RUN_SKIPS, GPUS
from tst_megatron.superposition.schedule import TSTConfig

#: Megatron-LM flags for features of ``pretrain_gpt.py`` that this launcher does not have
#: (ignored, or a traceback at the first step), with why: refused before work
#: (:func:`tst_megatron.training.checks.megatron.refused_flag_problems`) and marked in ``--help``.
NOT_WIRED = {
    "hybrid_context_parallel": "it needs SFT batches with document boundaries (cu_seqlens)",
    "inprocess_restart": "it does not wrap pretrain() for in-process restart; a restarted "
    "job resumes exactly from --load",
}


def refused_flags() -> dict:
    """``{argparse dest: why}`` of every Megatron-LM flag the launcher refuses: :data:`NOT_WIRED`
    and the data flags (``tst_megatron.training.checks.data.REFUSED_DATA_FLAGS``)."""
    from tst_megatron.training.checks.data import REFUSED_DATA_FLAGS

    return {**REFUSED_DATA_FLAGS, **NOT_WIRED}


def _tst_group_factory():
    """Megatron-LM's ``ArgumentGroupFactory`` for :class:`TSTConfig`, flags and destinations
    prefixed ``tst`` (``bag_size``: ``--tst-bag-size``, dest ``tst_bag_size``), with the field
    types resolved (the factory would read postponed annotations as strings)."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    hints = typing.get_type_hints(TSTConfig)

    class Factory(ArgumentGroupFactory):
        def _format_arg_name(self, config_attr_name, prefix=None):
            return super()._format_arg_name(f"tst_{config_attr_name}", prefix)

        def _build_argparse_kwargs_from_field(self, attribute):
            attribute = copy.copy(attribute)
            attribute.type = hints[attribute.name]
            kwargs = super()._build_argparse_kwargs_from_field(attribute)
            return {**kwargs, "dest": f"tst_{attribute.name}"}

    return Factory(TSTConfig)


def add_tst_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM extra-args provider: ``--tst-*``, ``--dry-run``, ``--device``; returns
    ``parser``."""
    group = _tst_group_factory().build_group(parser, title="token superposition training (TST)")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Run the checks of a launch for WORLD_SIZE processes, print the layout, the "
        "model size and the TST plan (or each problem on one line), and exit: 0 without "
        "problems, 2 with. Starts no process, needs no GPU. It cannot check what only the "
        f"cluster has: {'; '.join(DRY_RUN_SKIPS.values())} (its assumed: lines say which).",
    )
    group.add_argument(
        "--dry-run-gpu",
        choices=sorted(GPUS),
        default=None,
        help="The GPU --dry-run checks the line for (Megatron-LM's rules that depend on the "
        "architecture, e.g. CUDA_DEVICE_MAX_CONNECTIONS below Blackwell). Default: this "
        f"machine's GPU, or an {DEFAULT_GPU} where there is none.",
    )
    group.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="Where to run: cuda; cpu (gloo, the local layer spec, float32; the launcher adds "
        "the flags a CPU run needs); or auto, cuda when a GPU is visible. Default: auto.",
    )
    _fix_help(parser)
    return parser


def _fix_help(parser: argparse.ArgumentParser) -> None:
    """Megatron-LM's help texts as ``--help`` shows them: each flag the launcher refuses says
    so (:func:`refused_flags`), and each ``%`` argparse cannot expand is
    doubled (Megatron-LM 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help,
    ``10%)``, makes ``--help`` raise ``ValueError: unsupported format character``)."""
    refused = refused_flags()
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and action.dest in refused:
            action.help = (
                f"{action.help.rstrip('. ')}. Refused by this launcher: {refused[action.dest]}."
            )
        if action.help:
            try:
                formatter._expand_help(action)
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def tst_config(args) -> TSTConfig:
    """The :class:`TSTConfig` of parsed Megatron-LM arguments (fields ``tst_*``)."""
    return TSTConfig(
        **{f.name: getattr(args, f"tst_{f.name}") for f in dataclasses.fields(TSTConfig)}
    )
