"""The launcher's own flags: ``--tst-*`` (from :class:`TSTConfig` through Megatron-LM's
``ArgumentGroupFactory``), ``--dry-run`` and ``--device``; and the flags a CPU run appends."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import typing
from typing import Optional, Sequence

import torch

from tst_megatron.superposition.schedule import TSTConfig

#: Flags appended to the command line of a CPU run: Megatron-LM's defaults assume CUDA
#: kernels (Transformer Engine, fused norms/RoPE/SwiGLU, gradient-accumulation fusion, NCCL).
#: ``--disable-jit-fuser`` keeps the fusions' ``torch.compile`` out of the training steps;
#: ``pretrain()``'s warm-up of them still runs (its decorators ran at import; the tests set
#: ``TORCHDYNAMO_DISABLE=1``). A user's own ``--transformer-impl`` / ``--distributed-backend``
#: other than these is refused (:func:`~tst_megatron.training.megatron_checks.cpu_flag_problems`).
CPU_FLAGS = (
    "--transformer-impl",
    "local",
    "--distributed-backend",
    "gloo",
    "--no-persist-layer-norm",
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion",
    "--disable-jit-fuser",
    # weights drawn on the host whole, then split, as megatron-core does for this flag
    "--use-cpu-initialization",
)

DEVICES = ("auto", "cuda", "cpu")


def _tst_group_factory():
    """Megatron-LM's ``ArgumentGroupFactory`` for :class:`TSTConfig`, with every flag and
    destination prefixed ``tst`` (field ``bag_size``: ``--tst-bag-size``, dest ``tst_bag_size``;
    a boolean defaulting to True: ``--no-tst-...`` and ``--disable-tst-...``). The field types
    are resolved first (the module uses postponed annotations, which the factory reads as
    strings)."""
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
    """Megatron-LM extra-args provider: the ``--tst-*`` group, ``--dry-run`` and ``--device``.
    Returns ``parser``."""
    group = _tst_group_factory().build_group(parser, title="token superposition training (TST)")
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="Run every check of a launch for WORLD_SIZE processes, print the layout, the "
        "model size and the TST plan (or each problem on one line), and exit: 0 without "
        "problems, 2 with. Starts no process, reads no data, needs no GPU.",
    )
    group.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="Where to run: cuda; cpu (gloo, the local layer spec, float32; the launcher adds "
        "the flags a CPU run needs); or auto, cuda when a GPU is visible. Default: auto.",
    )
    _escape_broken_help(parser)
    return parser


def _escape_broken_help(parser: argparse.ArgumentParser) -> None:
    """Make ``--help`` work: double the ``%`` of each help text of ``parser`` that argparse
    cannot expand (Megatron-LM 0.19.2's ``--moe-paged-stash-buffer-size-factor-cuda`` help
    says ``10%)``, so its own ``--help`` stops with ``ValueError: unsupported format
    character``). Only this parser's actions are edited; a text that expands is left as is."""
    formatter = parser._get_formatter()
    for action in parser._actions:
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


def pick_device(argv: Sequence[str], *, cuda: Optional[bool] = None) -> str:
    """``"cuda"`` or ``"cpu"`` from ``--device`` in ``argv``; ``auto`` is ``"cuda"`` when
    ``cuda`` (default: ``torch.cuda.is_available()``; a dry run passes True, checking the line
    for the cluster). An invalid value is left to the full parser, which names it."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--device", default="auto")
    device = pre.parse_known_args(list(argv))[0].device
    if device == "auto":
        return "cuda" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    return device
