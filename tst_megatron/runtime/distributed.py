"""Start a process: torch.distributed, megatron-core model parallelism, seeds.

The launcher's processes start in Megatron-LM's ``pretrain()``; this module's
:func:`init_distributed`, :func:`initialize_model_parallel` and :class:`ParallelConfig` serve
the tools (checkpoint conversion), benchmarks and tests that run megatron-core without
Megatron-LM's loop. The launcher uses its environment readers (:func:`resolve_process`,
:func:`is_rank_zero`, :func:`export_torchrun_env`).

One way to start, GPU or CPU: rank and world size come from torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) or, when a
process is a task of an ``srun`` step without torchrun, from Slurm's (``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``, ``SLURM_LOCALID``; the rendezvous is the first
host of the step's node list, see :mod:`tst_megatron.runtime.slurm`). CUDA processes use
NCCL; CPU processes use gloo and :func:`tst_megatron.runtime.cpu.enable`.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import random
import socket
import sys
from typing import Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from tst_megatron.errors import ConfigError
from tst_megatron.runtime import cpu
from tst_megatron.runtime.slurm import in_srun_step, slurm_rendezvous


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """Where this process sits in the job."""

    rank: int
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Rank on this node."""
    device: torch.device
    """``cuda:<local_rank % visible GPUs>`` or ``cpu``: ``cuda:<local_rank>`` when the task sees
    all the node's GPUs, ``cuda:0`` when Slurm binds one GPU per task (``--gpus-per-task=1``)."""
    backend: str
    """``nccl`` or ``gloo``."""
    launcher: str = "none"
    """Whose environment gave the rank: ``torchrun``, ``srun`` or ``none`` (rank 0 of 1)."""
    master_addr: str = "127.0.0.1"
    """Rendezvous host (rank 0's node): ``MASTER_ADDR``, or the step's first Slurm node."""
    master_port: int = 29500
    """Rendezvous TCP port: ``MASTER_PORT``, or derived from ``SLURM_JOB_ID`` under srun."""


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
        """Raise ``ConfigError`` (one line, naming the flag) if the sizes cannot fit ``world_size``."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                flag = "--" + field.name.replace("_", "-")
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        model = (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.context_parallel_size
        )
        if world_size % model != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by TP*PP*CP = {model}; "
                "change --tensor-model-parallel-size/--pipeline-model-parallel-size/"
                "--context-parallel-size or the number of processes"
            )
        etp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert = etp * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % expert != 0:
            raise ConfigError(
                f"world size {world_size} is not divisible by ETP*EP*PP = {expert}; "
                "change --expert-model-parallel-size/--expert-tensor-parallel-size"
            )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now (the OS's pick for port 0), e.g. for a 1-node
    rendezvous (``MASTER_PORT``). Another process may take it before it is used."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _env_int(env: Mapping[str, str], *names: str, default: Optional[int] = None) -> int:
    for name in names:
        if name in env:
            return int(env[name])
    if default is None:
        raise RuntimeError(f"none of {', '.join(names)} is set: start with torchrun or srun")
    return default


def is_rank_zero(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is the job's rank 0, by :func:`resolve_process`'s rule without
    its checks: ``RANK`` (torchrun's) when set, else ``SLURM_PROCID`` in an ``srun`` step, else
    rank 0 of 1."""
    env = os.environ if env is None else env
    if "RANK" in env:
        return env["RANK"].strip() == "0"
    if in_srun_step(env):
        return env.get("SLURM_PROCID", "0").strip() == "0"
    return True


def resolve_process(
    env: Optional[Mapping[str, str]] = None, *, device: str = "auto"
) -> ProcessInfo:
    """Read rank, world size, local rank and the rendezvous from torchrun's or Slurm's environment.

    In order:
      1. ``RANK`` set (torchrun, or exported by hand): ``RANK``, ``WORLD_SIZE``,
         ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``; torchrun wins over Slurm.
      2. a task of an ``srun`` step (``SLURM_PROCID`` and ``SLURM_STEP_ID`` set): rank
         ``SLURM_PROCID``, world ``SLURM_STEP_NUM_TASKS`` (else ``SLURM_NTASKS``), local rank
         ``SLURM_LOCALID``, rendezvous from :func:`~tst_megatron.runtime.slurm.slurm_rendezvous`.
      3. otherwise (including a batch script's own shell, which has ``SLURM_PROCID`` but is one
         process): rank 0 of 1 on ``127.0.0.1:29500``.

    Args:
        env: the environment (default ``os.environ``).
        device: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``.

    Returns:
        A :class:`ProcessInfo`. Reads only; sets nothing.

    Raises:
        ConfigError: unknown ``device``, ``"cuda"`` without a CUDA device, a rank outside
            ``[0, world size)``, or a malformed Slurm node list.
    """
    env = os.environ if env is None else env
    if device not in ("auto", "cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was given but no CUDA device is available")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    addr, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
    if "RANK" in env:
        launcher = "torchrun"
        rank = _env_int(env, "RANK")
        world_size = _env_int(env, "WORLD_SIZE", default=1)
        local_rank = _env_int(env, "LOCAL_RANK", default=0)
    elif in_srun_step(env):
        launcher = "srun"
        rank = _env_int(env, "SLURM_PROCID")
        world_size = _env_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", default=1)
        local_rank = _env_int(env, "SLURM_LOCALID", default=0)
        addr, port = slurm_rendezvous(env)
    else:
        launcher, rank, world_size, local_rank = "none", 0, 1, 0
    if not 0 <= rank < world_size:
        raise ConfigError(
            f"rank {rank} is outside [0, world size {world_size}) ({launcher} environment)"
        )
    return ProcessInfo(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=(
            torch.device("cuda", local_rank % torch.cuda.device_count())
            if use_cuda
            else torch.device("cpu")
        ),
        backend="nccl" if use_cuda else "gloo",
        launcher=launcher,
        master_addr=addr,
        master_port=port,
    )


def export_torchrun_env(env: Optional[dict] = None, *, gpus: Optional[int] = None) -> dict:
    """Export a ``srun`` task's rank, world and rendezvous
    (:func:`tst_megatron.runtime.distributed.resolve_process`) under torchrun's names (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), which Megatron-LM reads.
    Nothing is set when ``RANK`` is or outside an ``srun`` step. ``LOCAL_RANK`` is
    ``SLURM_LOCALID`` modulo the visible GPUs (``--gpus-per-task=1``: the task's own GPU 0).

    Args:
        env: the environment to update (default ``os.environ``).
        gpus: the CUDA devices this task sees (default ``torch.cuda.device_count()``; 0 on a
            CPU, where ``LOCAL_RANK`` is ``SLURM_LOCALID``).

    Returns:
        The variables set (empty when none).

    Raises:
        ConfigError: a malformed Slurm node list or a rank outside the world.
    """
    env = os.environ if env is None else env
    if "RANK" in env or not in_srun_step(env):
        return {}
    gpus = torch.cuda.device_count() if gpus is None else gpus
    try:
        process = resolve_process(env, device="cpu")  # the device is not read here
    except ValueError as exc:  # a malformed node list
        raise ConfigError(str(exc)) from None
    exported = {
        "RANK": str(process.rank),
        "WORLD_SIZE": str(process.world_size),
        "LOCAL_RANK": str(process.local_rank % gpus if gpus else process.local_rank),
        "MASTER_ADDR": process.master_addr,
        "MASTER_PORT": str(process.master_port),
    }
    env.update(exported)
    return exported


def one_process_env(env: Mapping[str, str]) -> dict:
    """The variables that make a process started by neither torchrun nor ``srun`` a world of
    one (rank 0 of 1 on ``MASTER_ADDR``, default 127.0.0.1, at ``MASTER_PORT``, default a free
    port); Megatron-LM alone stops with "MASTER_ADDR expected, but not set". Empty when ``RANK``
    is set.

    Raises:
        ConfigError: ``WORLD_SIZE`` > 1 without ``RANK`` (the checks validated that world, but
            this process would train alone).
    """
    if "RANK" in env:
        return {}
    world = env.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "1"):
        raise ConfigError(
            f"WORLD_SIZE={world} is set but RANK is not: start the {world} processes with "
            "torchrun (or srun), which gives each its rank, or unset WORLD_SIZE for one process"
        )
    port = env.get("MASTER_PORT") or str(free_port())
    master = env.get("MASTER_ADDR", "127.0.0.1")
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=master, MASTER_PORT=port)


def init_distributed(
    *, device: str = "auto", timeout_minutes: int = 30, env: Optional[Mapping[str, str]] = None
) -> ProcessInfo:
    """Initialise ``torch.distributed`` (NCCL on CUDA, gloo on CPU) for this process.

    On CPU, first calls :func:`tst_megatron.runtime.cpu.enable`. Idempotent: when the
    default process group already exists it is kept. The rendezvous is
    :attr:`ProcessInfo.master_addr`/``master_port`` (exported as ``MASTER_ADDR``/``MASTER_PORT``
    for ``env://``): torchrun's, the first node of an ``srun`` step, or ``127.0.0.1:29500``.

    Raises:
        ConfigError: see :func:`resolve_process`.
        RuntimeError: the CPU runtime does not support the installed megatron-core.
    """
    info = resolve_process(env, device=device)
    if info.device.type == "cpu":
        cpu.enable()
    else:
        torch.cuda.set_device(info.device)
    if not dist.is_initialized():
        os.environ["MASTER_ADDR"] = info.master_addr
        os.environ["MASTER_PORT"] = str(info.master_port)
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
        ConfigError: the sizes do not fit the world size (see :meth:`ParallelConfig.validate`).
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


#: How long a rank waits for the others while an error is reported (:func:`report_error`).
ERROR_REPORT_TIMEOUT_S = 60.0

_reports = itertools.count()  # the same sequence on every rank that reports in step


def _print_error(lines: list[str]) -> None:
    for line in lines:
        print(f"error: {line}", file=sys.stderr, flush=True)


def report_error(message: str, *, timeout_s: float = ERROR_REPORT_TIMEOUT_S) -> None:
    """Print ``message`` to stderr, one ``error: <line>`` per line, once for the whole job;
    returns only when it is out. Call it on every rank that stops on the error, then exit.

    torchrun (and ``srun --kill-on-bad-exit``) stops every rank as soon as one exits with an
    error, so a rank that exits before the line is printed can take it with it. Here:

    - rank 0 prints at once, then passes the message through the default process group's
      store and waits until every other rank has read it (or ``timeout_s``);
    - every other rank waits for that message (or ``timeout_s``) and only then returns: it
      prints nothing when rank 0 reported the same message, else its own lines tagged
      ``[rank N]`` (a problem found on some ranks only, while rank 0 waits elsewhere).

    So a rank exits only after the error line is out. When the error came before
    :func:`init_distributed`, the reporting ranks rendezvous on gloo first (CPU; rank 0 has
    printed already). A single process, or a rank whose launcher environment is unreadable,
    just prints. Costs nothing when no error is reported.

    Args:
        message: the error, one problem per line (a :class:`~tst_megatron.errors.ConfigError`).
        timeout_s: the longest wait for the other ranks (the rendezvous included).
    """
    lines = message.splitlines() or [""]
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        try:
            info = resolve_process(device="cpu")
        except ConfigError:
            info = None
        rank, world = (info.rank, info.world_size) if info else (0, 1)
    if rank == 0:
        _print_error(lines)
    if world == 1:
        return
    seen = None
    try:
        if not dist.is_initialized():
            os.environ["MASTER_ADDR"] = info.master_addr
            os.environ["MASTER_PORT"] = str(info.master_port)
            dist.init_process_group(
                backend="gloo",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        store = dist.distributed_c10d._get_default_store()
        key = f"tst_megatron/error/{next(_reports)}"
        wait = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            store.set(key, message)
            store.wait([f"{key}/read/{r}" for r in range(1, world)], wait)
        else:
            store.wait([key], wait)
            seen = store.get(key).decode()
            store.set(f"{key}/read/{rank}", "1")
    except Exception:  # a rank that never reports, no rendezvous, no store: print, not hang
        pass
    if rank != 0 and seen != message:
        _print_error([f"[rank {rank}] {line}" for line in lines])


def destroy() -> None:
    """Tear down model parallelism and the default process group (if any)."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
