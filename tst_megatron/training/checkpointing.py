"""``torch_dist`` checkpoints through megatron-core ``dist_checkpointing``.

A checkpoint is named parts plus the config (Megatron-LM's layout, so its tools find it):
``<dir>/iter_0000042/`` holds ``model`` (``model0``, ``model1``... with virtual pipelines),
``optimizer``, ``opt_param_scheduler``, ``loop`` (iteration, tokens consumed), ``tst``
(the TST settings) and each rank's RNG states; ``<dir>/latest_checkpointed_iteration.txt``
names the newest. Each checkpoint is written to ``iter_XXXXXXX.tmp`` and renamed when every
rank has finished, and the tracker file is replaced atomically, so a crash never leaves a
checkpoint that looks complete but is not. The data position is a function of the
iteration (see :mod:`.data`), so it needs no separate state.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from tst_megatron.superposition.schedule import TSTConfig
from tst_megatron.training.forward import unwrap

TRACKER = "latest_checkpointed_iteration.txt"
# Key optimizer state by parameter only, so a checkpoint reshards across TP/PP/EP/DP layouts
# (megatron-core ChainedOptimizer otherwise prefixes "chained_<i>." by optimizer count).
_OPTIMIZER_METADATA = {"chained_optim_avoid_prefix": True}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> Optional[int]:
    """The iteration named by the tracker file, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(f.read().strip())


def _model_sharded(model_chunks):
    if len(model_chunks) == 1:
        return {"model": unwrap(model_chunks[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(c).sharded_state_dict() for i, c in enumerate(model_chunks)}


def _rng_object() -> ShardedObject:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject("rng_state", state, (world,), (rank,), replica_id=0)


def _restore_rng(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def save_checkpoint(root, iteration, model_chunks, optimizer, scheduler, *, loop: dict,
                    tst: TSTConfig) -> str:  # fmt: skip
    """Write the checkpoint of ``iteration`` under ``root``; return its directory."""
    final = checkpoint_dir(root, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    sharded = _model_sharded(model_chunks)
    state = dict(sharded)
    state["optimizer"] = optimizer.sharded_state_dict(sharded, metadata=_OPTIMIZER_METADATA)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["loop"] = dict(loop, iteration=iteration, world_size=dist.get_world_size())
    state["tst"] = dataclasses.asdict(tst)
    state["rng_state"] = _rng_object()
    dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tracker_tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return final


_RUN_CHANGING = ("bag_size", "bag_weighting")


def _optimizer_count(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def load_checkpoint(root, model_chunks, optimizer, scheduler, *, tst: TSTConfig,
                    train_iters: int, load_optim: bool = True,
                    load_rng: bool = True) -> Optional[dict]:  # fmt: skip
    """Restore the newest checkpoint under ``root`` into the given objects.

    Returns:
        The saved ``loop`` dict (with ``iteration``), or None when ``root`` has no checkpoint.

    The model always loads into any TP/PP/EP/DP layout (``torch_dist`` reshards). The
    optimizer state does too, except between layouts whose megatron-core optimizer is split
    differently (expert parallelism on vs off gives a separate expert optimizer); such a
    load stops with a message suggesting ``--no-load-optim``.

    Raises:
        ValueError: the checkpoint's TST settings differ from this run's in a way that would
            change the run (bag size, weighting, phase-1 length), naming the field; or the
            optimizer layouts differ (see above).
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return None
    path = checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    saved_tst = TSTConfig(**common["tst"])
    for name in _RUN_CHANGING:
        if getattr(saved_tst, name) != getattr(tst, name):
            raise ValueError(
                f"checkpoint {path} was saved with tst {name}={getattr(saved_tst, name)!r} but this "
                f"run has {getattr(tst, name)!r}; use the same --tst-{name.replace('_', '-')}"
            )
    if saved_tst.phase1_steps(train_iters) != tst.phase1_steps(train_iters):
        raise ValueError(
            f"checkpoint {path} has {saved_tst.phase1_steps(train_iters)} phase-1 iterations but "
            f"this run has {tst.phase1_steps(train_iters)}; use the same --tst-phase1-iters/fraction"
        )
    saved_optim = common.get("optimizer", {})
    saved_count = sum(1 for k in saved_optim if isinstance(k, int)) or 1
    if load_optim and saved_count != _optimizer_count(optimizer):
        raise ValueError(
            f"checkpoint {path} holds {saved_count} optimizer(s) but this layout builds "
            f"{_optimizer_count(optimizer)} (expert parallelism on one side only); resume with "
            "the same --expert-model-parallel-size or pass --no-load-optim"
        )
    sharded = _model_sharded(model_chunks)
    request = dict(sharded)
    if load_optim:
        request["optimizer"] = optimizer.sharded_state_dict(
            sharded, is_loading=True, metadata=_OPTIMIZER_METADATA
        )
    # RNG states are per rank: restored only when the layout's world size is unchanged.
    same_world = load_rng and common["loop"].get("world_size") == dist.get_world_size()
    if same_world:
        request["rng_state"] = _rng_object()
    state = dist_checkpointing.load(request, path)
    if len(model_chunks) == 1:
        unwrap(model_chunks[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            unwrap(chunk).load_state_dict(state[f"model{i}"])
    if load_optim:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_world:
        _restore_rng(state["rng_state"])
    return state["loop"]
