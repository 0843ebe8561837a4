"""Megatron-LM's optional run monitoring: parameter norm, memory scalars, the profiler
window and Weights & Biases. Each piece is what the Megatron-LM flag of the same name does
(``megatron/training/training.py`` and ``utils.py`` of Megatron-LM core_v0.16.1).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from tst_megatron.errors import ConfigError


def params_l2_norm(model_chunks) -> float:
    """``--log-params-norm``: the L2 norm of all trainable parameters of the whole model, as
    Megatron-LM's ``calc_params_l2_norm``: each parameter counted once (no tied copy, no
    tensor-parallel duplicate), dense parameters summed over the model-parallel group and
    expert parameters over the expert-tensor-model-pipeline group. Collective."""
    dense, expert = [], []
    for chunk in model_chunks:
        for param in chunk.parameters():
            if not param.requires_grad or getattr(param, "shared", False):
                continue
            if not param_is_not_tensor_parallel_duplicate(param):
                continue
            (expert if not getattr(param, "allreduce", True) else dense).append(param.detach())
    device = next(iter(model_chunks[0].parameters())).device

    def sum_sq(params, group) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for p in params:
            total += p.double().pow(2).sum()
        dist.all_reduce(total, group=group)
        return total

    total = sum_sq(dense, ps.get_model_parallel_group())
    total += sum_sq(expert, ps.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(total.item())


def memory_scalars(device: torch.device) -> dict:
    """``--log-memory-to-tensorboard``: Megatron-LM's memory scalars (bytes) on a CUDA
    device; empty on a CPU run, where the CUDA allocator is not used."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {
        "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
        "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
        "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
        "mem-allocated-count": stats.get("allocation.all.current", 0),
    }


class Profiler:
    """``--profile``: profile iterations ``[--profile-step-start, --profile-step-end)`` on the
    ranks of ``--profile-ranks``. With ``--use-pytorch-profiler`` the PyTorch profiler writes
    a trace for TensorBoard into ``--tensorboard-dir``; otherwise (CUDA) the CUDA profiler
    API opens and closes an Nsight Systems capture range (``nsys --capture-range=cudaProfilerApi``),
    as Megatron-LM does."""

    def __init__(self, cfg, rank: int, device: torch.device):
        c = cfg.checkpoint
        self.on = c.profile and rank in c.profile_ranks
        self.start, self.end, self.torch = c.profile_step_start, c.profile_step_end, None
        self.device = device
        if self.on and c.use_pytorch_profiler:
            self.torch = torch.profiler.profile(
                schedule=torch.profiler.schedule(
                    wait=max(self.start - 1, 0),
                    warmup=1 if self.start > 0 else 0,
                    active=self.end - self.start,
                    repeat=1,
                ),  # fmt: skip
                on_trace_ready=torch.profiler.tensorboard_trace_handler(c.tensorboard_dir),
                record_shapes=True,
                with_stack=True,
            )
            self.torch.start()

    def before_step(self, iteration: int) -> None:
        """Call with the 0-based iteration about to run."""
        if self.on and self.torch is None and iteration == self.start:
            torch.cuda.cudart().cudaProfilerStart()

    def after_step(self, iteration: int) -> None:
        """Call with the 0-based iteration that just ran."""
        if not self.on:
            return
        if self.torch is not None:
            self.torch.step()
            if iteration + 1 == self.end:
                self.torch.stop()
        elif iteration + 1 == self.end:
            torch.cuda.cudart().cudaProfilerStop()


def open_wandb(cfg, rank: int, world_size: int) -> Optional[object]:
    """``--wandb-project``: a Weights & Biases run on the last rank (where Megatron-LM logs),
    named ``--wandb-exp-name``, files in ``--wandb-save-dir``; None elsewhere or when no
    project is given.

    Raises:
        ConfigError: ``wandb`` is not installed (an optional dependency).
    """
    import importlib.util

    c = cfg.checkpoint
    if not c.wandb_project:
        return None
    if importlib.util.find_spec("wandb") is None:  # the same verdict on every rank
        raise ConfigError(
            "--wandb-project needs the optional package wandb (pip install wandb), or drop "
            "--wandb-project"
        )
    if rank != world_size - 1:
        return None
    import wandb

    return wandb.init(
        project=c.wandb_project,
        name=c.wandb_exp_name,
        dir=c.wandb_save_dir or (c.save and f"{c.save}/wandb"),
        config={"args": str(cfg)},
    )
