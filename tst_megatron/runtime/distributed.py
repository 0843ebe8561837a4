"""Start a process: torch.distributed, megatron-core model parallelism, seeds.

One way to start, GPU or CPU: rank and world size come from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or, when a
process is started by ``srun`` without torchrun, from Slurm's (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_LOCALID``; ``MASTER_ADDR``/``MASTER_PORT`` must be exported by
the batch script). CUDA processes use NCCL; CPU processes use gloo and
:func:`tst_megatron.runtime.cpu.enable`.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import random
from typing import Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from tst_megatron.runtime import cpu


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node; the CUDA device index on GPUs."""
    device: torch.device
    """``cuda:<local_rank>`` or ``cpu``."""
    backend: str
    """``nccl`` or ``gloo``."""


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Model-parallel sizes, as megatron-core's ``initialize_model_parallel`` takes them.

    Data parallelism is what is left: ``DP = world_size / (TP * PP * CP)``.
    """

    tensor_model_parallel_size: int = 1
    """TP: ranks a layer's weights are split over (``--tensor-model-parallel-size``)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages (``--pipeline-model-parallel-size``)."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """Model chunks per pipeline rank for the interleaved schedule; None = not interleaved."""
    context_parallel_size: int = 1
    """CP: ranks the sequence is split over (``--context-parallel-size``)."""
    expert_model_parallel_size: int = 1
    """EP: ranks the experts are split over (``--expert-model-parallel-size``)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Expert TP; None = same as TP (``--expert-tensor-parallel-size``)."""

    def validate(self, world_size: int) -> None:
        """Raise ``ValueError`` (one line, naming the flag) if the sizes cannot fit ``world_size``."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        model = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        if world_size % model != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP*CP = {model}; "
                "change --tensor-model-parallel-size/--pipeline-model-parallel-size/"
                "--context-parallel-size or the number of processes"
            )
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert = etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % expert != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by ETP*EP*PP = {expert}; "
                "change --expert-model-parallel-size/--expert-tensor-parallel-size"
            )


def _env_int(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> int:
    for name in names:
        if name in env:
            return int(env[name])
    if default is None:
        raise RuntimeError(f"none of {', '.join(names)} is set: start with torchrun or srun")
    return default


def resolve_process(
    env: Optional[Mapping[str, str]] = None, *, device: str = "auto"
) -> ProcessInfo:
    """Read rank, world size and local rank from torchrun's or Slurm's environment.

    Args:
        env: the environment (default ``os.environ``). torchrun's variables win over Slurm's.
            A process with neither is rank 0 of 1.
        device: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``.

    Returns:
        A :class:`ProcessInfo`. Reads only; sets nothing.

    Raises:
        ValueError: unknown ``device``, or ``"cuda"`` without a CUDA device.
    """
    env = os.environ if env is None else env
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"--device must be auto, cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    rank = _env_int(env, "RANK", "SLURM_PROCID", default=0)
    world_size = _env_int(env, "WORLD_SIZE", "SLURM_NTASKS", default=1)
    local_rank = _env_int(env, "LOCAL_RANK", "SLURM_LOCALID", default=0)
    return ProcessInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=torch.device("cuda", local_rank) if use_cuda else torch.device("cpu"),
        backend="nccl" if use_cuda else "gloo",
    )


def init_distributed(
    *, device: str = "auto", timeout_minutes: int = 30, env: Optional[Mapping[str, str]] = None
) -> ProcessInfo:
    """Initialise ``torch.distributed`` (NCCL on CUDA, gloo on CPU) for this process.

    On CPU, first calls :func:`tst_megatron.runtime.cpu.enable`. Idempotent: when the
    default process group already exists it is kept. ``MASTER_ADDR`` defaults to
    ``127.0.0.1`` and ``MASTER_PORT`` to ``29500`` for single-node runs.

    Raises:
        ValueError: see :func:`resolve_process`.
        RuntimeError: the CPU runtime does not support the installed megatron-core.
    """
    info = resolve_process(env, device=device)
    if info.device.type == "cpu":
        cpu.enable()
    else:
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group(
            backend=info.backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return info


def initialize_model_parallel(config: ParallelConfig) -> None:
    """Create megatron-core's TP/PP/VPP/CP/EP/expert-TP/DP groups (``parallel_state``).

    Raises:
        ValueError: the sizes do not fit the world size (see :meth:`ParallelConfig.validate`).
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if not dist.is_initialized():
        raise RuntimeError("call init_distributed() before initialize_model_parallel()")
    config.validate(dist.get_world_size())
    parallel_state.destroy_model_parallel()
    # The field names are megatron-core's keyword names.
    parallel_state.initialize_model_parallel(**dataclasses.asdict(config))


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and megatron-core's model-parallel RNG tracker.

    As Megatron-LM's ``_set_random_seed``: the seed is offset by ``100 * PP rank`` so that
    pipeline stages draw different numbers, then ``model_parallel_cuda_manual_seed`` sets
    up the data-parallel, tensor-parallel and expert-parallel RNG states (needed even on
    CPU: attention dropout forks the tensor-parallel state). Requires
    :func:`initialize_model_parallel` first.
    """
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear down model parallelism and the default process group (if any)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
