"""Whether a launch runs on the CPU (:func:`pick_device`, from ``--device``), what a CPU run
(``--device cpu``) of the launcher appends to a Megatron-LM command line (:data:`CPU_FLAGS`)
and the settings it refuses, megatron-core 0.19 needing CUDA for them (:func:`cpu_problems`,
:func:`cpu_flag_problems`); the redirections of megatron-core's CUDA
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


def cpu_problems(args) -> list[str]:
    """Settings a CPU run cannot do, megatron-core 0.19 needing CUDA for them, one line each:
    ``--bf16``/``--fp16``, ``--log-memory-to-tensorboard``, ``--record-memory-history``,
    ``--profile`` (CUDA's profiler), PP > 1 with tied embeddings or ``--mtp-num-layers``."""
    problems = []
    if args.profile and not args.use_pytorch_profiler:
        problems.append(
            "--profile starts CUDA's profiler (nsys); drop it for a CPU run (PyTorch's, "
            "--use-pytorch-profiler, is not checked on a CPU)"
        )
    for flag, on in (("--bf16", args.bf16), ("--fp16", args.fp16)):
        if on:
            problems.append(
                f"{flag} needs CUDA (megatron-core's mixed-precision optimizer accepts only CUDA "
                "parameters); a CPU run trains in float32: drop it"
            )
    if getattr(args, "record_memory_history", False):
        problems.append("--record-memory-history records CUDA's allocator; drop it for a CPU run")
    if getattr(args, "log_memory_to_tensorboard", False):
        problems.append(
            "--log-memory-to-tensorboard reads CUDA memory statistics; drop it for a CPU run"
        )
    if args.pipeline_model_parallel_size > 1 and not args.untie_embeddings_and_output_weights:
        problems.append(
            "--pipeline-model-parallel-size > 1 on a CPU needs --untie-embeddings-and-output-"
            "weights (megatron-core's tied-embedding all-reduce calls .cuda())"
        )
    if args.pipeline_model_parallel_size > 1 and getattr(args, "mtp_num_layers", None):
        problems.append(
            "--mtp-num-layers with --pipeline-model-parallel-size > 1 needs CUDA (megatron-core "
            "sets up the last stage's copy of the embedding with .cuda()); drop one for a CPU run"
        )
    return problems


def cpu_flag_problems(argv: Sequence[str]) -> list[str]:
    """The user's own ``--transformer-impl`` / ``--distributed-backend`` in ``argv`` (the
    command line as given) that a CPU run's ``CPU_FLAGS`` (``local`` / ``gloo``) would override."""
    given = flag_values(argv, "--transformer-impl", "--distributed-backend")
    problems = []
    if given.transformer_impl not in (None, "local"):
        problems.append(
            f"--transformer-impl {given.transformer_impl} needs CUDA; a CPU run uses local "
            "(drop the flag or run with --device cuda)"
        )
    if given.distributed_backend not in (None, "gloo"):
        problems.append(
            f"--distributed-backend {given.distributed_backend} needs CUDA; a CPU run uses "
            "gloo (drop the flag or run with --device cuda)"
        )
    return problems


def pick_device(argv: Sequence[str], *, cuda: Optional[bool] = None) -> str:
    """``"cuda"`` or ``"cpu"`` from ``--device`` in ``argv``; ``auto`` is ``"cuda"`` when
    ``cuda`` (default ``torch.cuda.is_available()``). An invalid value is returned as given,
    for the full parser to refuse."""
    device = flag_values(argv, "--device").device
    if device in (None, "auto"):
        return "cuda" if (torch.cuda.is_available() if cuda is None else cuda) else "cpu"
    return device


def flag_values(argv: Sequence[str], *flags: str) -> argparse.Namespace:
    """The values of ``flags`` in ``argv`` as given (None: absent), before Megatron-LM parses
    it; other words are ignored."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in flags:
        pre.add_argument(flag)
    return pre.parse_known_args(list(argv))[0]
