"""The command line as given, before Megatron-LM parses it: the one reader of its flags
(:func:`given`, :func:`flag_values`), whether the launch runs on the CPU (:func:`pick_device`,
from ``--device``) and what a CPU run (``--device cpu``) of the launcher appends to it
(:data:`CPU_FLAGS`). The settings a CPU run refuses are
:mod:`tst_megatron.training.checks.hardware`'s; the redirections of megatron-core's CUDA
assumptions are :mod:`tst_megatron.runtime.cpu`'s.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

import torch

#: Flags appended to a CPU run's command line: Megatron-LM's defaults assume CUDA kernels (TE,
#: fusions, NCCL). ``--disable-jit-fuser`` keeps ``torch.compile`` out of the training steps.
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
    "--use-cpu-initialization",
)


def pick_device(argv: Sequence[str], *, cuda: Optional[bool] = None) -> str:
    """``"cuda"`` or ``"cpu"`` from ``--device`` in ``argv``; ``auto`` is ``"cuda"`` when
    ``cuda`` (default ``torch.cuda.is_available()``). An invalid value is returned as given,
    for the full parser to refuse."""
    device = flag_values(argv, "--device").device
    if device in (None, "auto"):
        return "cuda" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    return device


def given(argv: Sequence[str]) -> list[str]:
    """The flags of the command line as given (``--flag`` or ``--flag=value``), in order;
    Megatron-LM's parser takes no abbreviations (``allow_abbrev=False``)."""
    return [word.split("=", 1)[0] for word in argv if word.startswith("--")]


def flag_values(argv: Sequence[str], *flags: str) -> argparse.Namespace:
    """The values of ``flags`` in ``argv`` as given, each flag's last (None: absent), before
    Megatron-LM parses it; other words are ignored."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in flags:
        pre.add_argument(flag)
    return pre.parse_known_args(list(argv))[0]
