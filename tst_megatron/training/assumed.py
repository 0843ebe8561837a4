"""What a dry run answers for the cluster's GPU and Transformer Engine when this machine lacks
them, so that Megatron-LM's validation checks the launch line as the cluster would run it.

Without CUDA, ``validate_args`` (``--moe-grouped-gemm``: compute capability >= 8; TP or CP > 1:
below Blackwell, ``CUDA_DEVICE_MAX_CONNECTIONS=1``) sees :data:`ASSUMED_GPU` through the CPU
runtime's stand-in ``torch`` (:mod:`tst_megatron.runtime.cpu`). Without TE, its version checks
answer for :data:`ASSUMED_TE_VERSION` and its kernel switches are not checked. Only for the
duration of the check; a real launch uses none of this.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import logging
import types
import warnings
from unittest import mock

import torch
from packaging.version import Version

from tst_megatron.runtime.cpu_torch import _CpuTorch

#: The GPUs ``--dry-run-gpu`` names, as ``torch.cuda.get_device_properties`` describes them
#: (compute capability, memory, SMs): what Megatron-LM's architecture rules read.
GPUS = {
    name: types.SimpleNamespace(
        name=f"NVIDIA {name} (assumed by --dry-run)",
        major=major,
        minor=minor,
        total_memory=gib * 2**30,
        multi_processor_count=sms,
    )
    for name, major, minor, gib, sms in (
        ("A100", 8, 0, 80, 108),
        ("H100", 9, 0, 80, 132),
        ("H200", 9, 0, 141, 132),
        ("B200", 10, 0, 180, 148),
        ("GB200", 10, 0, 186, 152),
        ("B300", 10, 3, 270, 148),
        ("GB300", 10, 3, 279, 152),
    )
}
#: The GPU a dry run without CUDA answers for unless ``--dry-run-gpu`` names another.
DEFAULT_GPU = "H100"
ASSUMED_GPU = GPUS[DEFAULT_GPU]

#: What a dry run leaves unchecked because the machine running it need not hold the
#: cluster's files and packages: ``{key: words}``. Its ``assumed:`` lines say which applied
#: (``training.checks.dry_run_assumptions``); ``--dry-run``'s help and the README name each
#: (``tests/unit/test_dry_run.py`` holds them together).
DRY_RUN_SKIPS = {
    "files": "the data and tokenizer files, where they are not on this machine",
    "packages": "whether Transformer Engine, Apex and grouped_gemm are installed",
    "kernels": "whether mamba_ssm and fla (hybrid M and G layers) are installed",
}


#: The TE version answered when TE is not installed (the highest megatron-core 0.19 asks about).
ASSUMED_TE_VERSION = "2.14.0"

#: Switches whose ``TransformerConfig`` check is "is TE's kernel importable here" (RoPE fusion,
#: on by default; ``--moe-permute-fusion``), not a check of the settings.
_TE_KERNEL_SWITCHES = ("apply_rope_fusion", "moe_permute_fusion")


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _assumed_te_min_version(version: str, check_equality: bool = True) -> bool:
    """megatron-core's ``is_te_min_version`` answered for :data:`ASSUMED_TE_VERSION`."""
    have, want = Version(ASSUMED_TE_VERSION), Version(version)
    return have >= want if check_equality else have > want


@contextlib.contextmanager
def assumed_cluster(notes: list, gpu: str | None = None):
    """During the block, Megatron-LM's validation sees the GPU ``gpu`` (a key of
    :data:`GPUS`; when None, :data:`DEFAULT_GPU` where this machine has no CUDA, else this
    machine's own), and TE :data:`ASSUMED_TE_VERSION` when TE is not installed; ``notes`` gets
    a line for each. Only module globals of the modules that ask are swapped, restored on
    exit."""
    with contextlib.ExitStack() as stack:
        if gpu is not None or not torch.cuda.is_available():
            name = gpu or DEFAULT_GPU
            stand_in = _CpuTorch(gpu=GPUS[name])
            for module_name in (
                "megatron.training.arguments",
                "megatron.training.utils.common_utils",
            ):
                module = importlib.import_module(module_name)
                stack.enter_context(mock.patch.object(module, "torch", stand_in))
            why = "--dry-run-gpu" if gpu else "no GPU here (--dry-run-gpu names another)"
            notes.append(
                f"{why}: validated as for the {name} (compute capability "
                f"{GPUS[name].major}.{GPUS[name].minor})"
            )
        if not _te_installed():
            for name in (
                "megatron.training.arguments",
                "megatron.core.transformer.transformer_config",
            ):
                module = importlib.import_module(name)
                patch = {"is_te_min_version": _assumed_te_min_version}
                if hasattr(module, "get_te_version"):
                    patch["get_te_version"] = lambda: Version(ASSUMED_TE_VERSION)
                stack.enter_context(mock.patch.multiple(module, **patch))
            notes.append(
                f"Transformer Engine not installed here: its version checks answered as "
                f"for TE {ASSUMED_TE_VERSION}"
            )
        yield


def without_te_kernels(args, notes: list):
    """``args``, or without TE installed a copy with :data:`_TE_KERNEL_SWITCHES` off (a note
    names those that were on): this machine cannot say whether the cluster's TE has them."""
    if _te_installed():
        return args
    on = [name for name in _TE_KERNEL_SWITCHES if getattr(args, name, False)]
    if not on:
        return args
    notes.append(f"Transformer Engine kernels not checked ({', '.join(on)}): TE not installed here")
    return argparse.Namespace(**{**vars(args), **dict.fromkeys(on, False)})


@contextlib.contextmanager
def quiet():
    """Python warnings, log records below ERROR and ``print`` off for the block (restored
    after): megatron-core warns at import that TE and Apex are missing, torch that CUDA is."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
