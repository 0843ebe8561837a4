"""What a dry run on a machine without the cluster's GPU or Transformer Engine answers for
them, so that Megatron-LM's validation checks the launch line as the cluster would run it.

``validate_args`` asks the GPU two things; on a machine without CUDA they are answered as
for :data:`ASSUMED_GPU` (an H100, compute capability 9.0, the machine the public launch
scripts are written for) through a stand-in ``torch`` given to the two Megatron-LM modules
that ask (``megatron.training.arguments``, ``megatron.training.utils.common_utils``) for the
duration of the check only, then restored:

- ``torch.cuda.get_device_capability()`` with ``--moe-grouped-gemm`` (needs >= 8);
- ``get_device_arch_version()`` (``torch.cuda.get_device_properties``) with TP or CP > 1:
  below Blackwell Megatron-LM asserts ``CUDA_DEVICE_MAX_CONNECTIONS=1``.

Without Transformer Engine installed, the TE version checks of ``validate_args`` and
``TransformerConfig`` (``is_te_min_version`` / ``get_te_version``) are answered for
:data:`ASSUMED_TE_VERSION`, and the TE-kernel switches are not checked
(:func:`without_te_kernels`). A real launch uses none of this: it asks the real machine
(or, on a CPU, the CPU runtime's stand-in, :mod:`tst_megatron.runtime.cpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import types
import warnings

import torch

#: What a dry run on a machine without CUDA answers for the GPU (``validate_args`` reads
#: ``major``/``minor``): an H100 (Hopper, compute capability 9.0).
ASSUMED_GPU = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3 (assumed by --dry-run)",
    major=9,
    minor=0,
    total_memory=80 * 2**30,
    multi_processor_count=132,
)

#: The Transformer Engine version the version checks of ``validate_args`` and
#: ``TransformerConfig`` are answered for when TE is not installed (the highest version
#: megatron-core 0.19's checks ask about).
ASSUMED_TE_VERSION = "2.14.0"

#: The Megatron-LM modules whose ``torch`` global is the stand-in during validation.
_GPU_ASKING_MODULES = ("megatron.training.arguments", "megatron.training.utils.common_utils")

#: The modules whose ``is_te_min_version`` (and ``get_te_version``) answer for
#: :data:`ASSUMED_TE_VERSION` during validation when TE is not installed.
_TE_ASKING_MODULES = ("megatron.training.arguments", "megatron.core.transformer.transformer_config")


class _AssumedCuda(types.ModuleType):
    """``torch.cuda`` as the two GPU-asking Megatron-LM modules see it in a dry run without
    CUDA: device properties and capability of :data:`ASSUMED_GPU`, the rest torch's."""

    def __init__(self):
        super().__init__("torch.cuda (tst_megatron dry-run stand-in)")

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def get_device_properties(device=None):
        return ASSUMED_GPU

    @staticmethod
    def get_device_capability(device=None):
        return (ASSUMED_GPU.major, ASSUMED_GPU.minor)


class _AssumedTorch(types.ModuleType):
    """``torch`` with :class:`_AssumedCuda` as ``torch.cuda``; every other name torch's."""

    def __init__(self):
        super().__init__("torch (tst_megatron dry-run stand-in)")
        self.cuda = _AssumedCuda()

    def __getattr__(self, name):
        return getattr(torch, name)


def _te_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def _assumed_te_version():
    """``get_te_version`` answered: :data:`ASSUMED_TE_VERSION`."""
    from packaging.version import Version

    return Version(ASSUMED_TE_VERSION)


def _assumed_te_min_version(version: str, check_equality: bool = True) -> bool:
    """``is_te_min_version`` answered for :data:`ASSUMED_TE_VERSION`."""
    from packaging.version import Version

    have, want = Version(ASSUMED_TE_VERSION), Version(version)
    return have >= want if check_equality else have > want


@contextlib.contextmanager
def assumed_cluster(notes: list):
    """During the block, the GPU questions of ``validate_args`` are answered for
    :data:`ASSUMED_GPU` when this machine has no CUDA, and its TE version checks for
    :data:`ASSUMED_TE_VERSION` when TE is not installed; ``notes`` gets a line for each.
    Only the ``torch`` / ``is_te_min_version`` globals of the modules in
    :data:`_GPU_ASKING_MODULES` are swapped, and restored on exit."""
    import importlib

    saved = []
    try:
        if not torch.cuda.is_available():
            stand_in = _AssumedTorch()
            for name in _GPU_ASKING_MODULES:
                module = importlib.import_module(name)
                saved.append((module, "torch", module.torch))
                module.torch = stand_in
            notes.append(
                f"no GPU here: validated as for compute capability {ASSUMED_GPU.major}."
                f"{ASSUMED_GPU.minor} (H100)"
            )
        if not _te_installed():
            for name in _TE_ASKING_MODULES:
                module = importlib.import_module(name)
                saved.append((module, "is_te_min_version", module.is_te_min_version))
                module.is_te_min_version = _assumed_te_min_version
                if hasattr(module, "get_te_version"):
                    saved.append((module, "get_te_version", module.get_te_version))
                    module.get_te_version = _assumed_te_version
            notes.append(
                f"Transformer Engine not installed here: its version checks answered as "
                f"for TE {ASSUMED_TE_VERSION}"
            )
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


#: Switches whose ``TransformerConfig`` check is "is Transformer Engine's kernel importable
#: here" (``apply_rope_fusion``: RoPE fusion, on by default; ``moe_permute_fusion``:
#: ``--moe-permute-fusion``), not a check of the settings.
_TE_KERNEL_SWITCHES = ("apply_rope_fusion", "moe_permute_fusion")


def without_te_kernels(args, notes: list):
    """``args``, or without Transformer Engine installed a copy with
    :data:`_TE_KERNEL_SWITCHES` off (a note names those that were on): a machine without TE
    cannot say whether the cluster's has the kernels."""
    if _te_installed():
        return args
    on = [name for name in _TE_KERNEL_SWITCHES if getattr(args, name, False)]
    if not on:
        return args
    notes.append(f"Transformer Engine kernels not checked ({', '.join(on)}): TE not installed here")
    return argparse.Namespace(**{**vars(args), **dict.fromkeys(on, False)})


@contextlib.contextmanager
def quiet():
    """Python warnings and log records below ERROR off for the block (restored after):
    megatron-core warns at import that Transformer Engine and Apex are missing, and torch
    logs that no CUDA runtime is found."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
