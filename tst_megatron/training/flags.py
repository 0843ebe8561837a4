"""The launcher's own flags (``--tst-*``, ``--dry-run``, ``--dry-run-gpu``, ``--device``) and
the Megatron-LM flags it refuses (:data:`REFUSED_FLAGS`)."""

from __future__ import annotations

import argparse
import copy
import typing

from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training.assumed import DEFAULT_GPU, DRY_RUN_SKIPS, GPUS

#: Every Megatron-LM flag the launcher refuses, ``{argparse dest: why}``: refused before work
#: (:func:`tst_megatron.training.checks.unsupported.refused_flag_problems`) and marked in
#: ``--help``. Data flags it does not honour (never ignored: per-split paths would have trained
#: on mock data), then features of ``pretrain_gpt.py`` it does not have (ignored, or a
#: traceback at the first step).
REFUSED_FLAGS = {
    "train_data_path": "use --data-path (or --data-args-path) with --split, or --mock-data",
    "valid_data_path": "use --data-path (or --data-args-path) with --split, or --mock-data",
    "test_data_path": "use --data-path (or --data-args-path) with --split, or --mock-data",
    "per_split_data_args_path": "use --data-path (or --data-args-path) with --split",
    "multiple_validation_sets": "its validation sets come from per-split paths (above)",
    "sft": "TST trains on megatron-core's GPTDataset (pretraining), not SFT conversations",
    "fim_data": "TST trains on megatron-core's GPTDataset; its FIM samples are not supported",
    "object_storage_cache_path": "the launcher checks and reads local .bin/.idx files only",
    "dataloader_inter_document_masking": "the forward step passes no document boundaries",
    "per_dataset_sequences_path": "the launcher reads every .idx at start-up (its checks)",
    "dataloader_fast_cache_load": "the launcher builds and loads the index caches itself",
    "dataloader_defer_npy_index_mmap": "the launcher builds and loads the index caches itself",
    "hybrid_context_parallel": "it needs SFT batches with document boundaries (cu_seqlens)",
    "inprocess_restart": "it does not wrap pretrain() for in-process restart; a restarted "
    "job resumes exactly from --load",
}


def _tst_group_factory():
    """Megatron-LM's ``ArgumentGroupFactory`` for :class:`TSTConfig`, flags and destinations
    prefixed ``tst`` (``bag_size``: ``--tst-bag-size``, dest ``tst_bag_size``), with the field
    types resolved (the factory would read postponed annotations as strings)."""
    # megatron.training (Megatron-LM) is heavy and optional for megatron-core users
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
    """Megatron-LM extra-args provider: ``--tst-*``, ``--dry-run``, ``--trust-checkpoint``,
    ``--device``; returns
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
        "--trust-checkpoint",
        action="store_true",
        help="Read --load's and --pretrained-checkpoint's pickles without the restricted "
        "unpickler that refuses any global a Megatron-LM checkpoint does not hold. Such a "
        "pickle can run any code: only for checkpoints you made yourself. Default: off.",
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
    so (:data:`REFUSED_FLAGS`), and each ``%`` argparse cannot expand is
    doubled (Megatron-LM 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help,
    ``10%)``, makes ``--help`` raise ``ValueError: unsupported format character``)."""
    refused = REFUSED_FLAGS
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
