"""The launcher (``examples/pretrain_gpt_tst.py``): Megatron-LM's ``pretrain_gpt.py`` with
Token Superposition Training, run by Megatron-LM's own ``pretrain()``, and its torchrun/Slurm
glue. Every check runs first (:func:`tst_megatron.training.validate.check`); a problem ends the
job before any process group, model or data exists. A CPU run (``--device cpu``) enables
:func:`tst_megatron.runtime.cpu.enable`.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Optional, Sequence

import torch

from tst_megatron.errors import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check ``argv`` (default ``sys.argv[1:]``), then run Megatron-LM's ``pretrain()`` with
    TST's model provider, datasets provider and forward step (and, with MTP, the optimizer
    hook :class:`~tst_megatron.training.switch.FreshAdamForMTP`).

    Raises:
        SystemExit: 2 on every rank after one ``error:`` line per problem from rank 0 (any
            check, or a :class:`ConfigError` inside ``pretrain()``); with ``--dry-run``,
            :func:`tst_megatron.training.dry_run.dry_run`'s status (0 or 2).
    """
    from megatron.core.enums import ModelType
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from tst_megatron.training.datasets import TSTDatasets
    from tst_megatron.training.forward import TSTForwardStep
    from tst_megatron.training.model import model_provider
    from tst_megatron.training.plan import schedule
    from tst_megatron.training.switch import FreshAdamForMTP
    from tst_megatron.training.validate import parse

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:
        from tst_megatron.training.dry_run import dry_run

        raise SystemExit(dry_run(argv))
    try:
        export_torchrun_env()
        alone = one_process_env(os.environ)
        checked = parse(argv)
    except ConfigError as exc:
        _exit_on(exc)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    if _nothing_left_to_train(checked.args):
        return
    os.environ.update(alone)
    _use_prebuilt_dataset_helpers()
    if checked.device == "cpu":
        from tst_megatron.runtime import cpu

        cpu.enable(training=True)  # again: modules imported since
        fork_checkpoint_results_queue()
    cfg = pretrain_cfg_container_from_args(checked.args)
    provider, hook = model_provider, None
    n1 = schedule(checked.args).n1
    if getattr(checked.args, "mtp_num_layers", None) and n1 > 0:
        fresh = FreshAdamForMTP(n1)
        provider = fresh.watch(model_provider)
        hook = register_optimizer_step_pre_hook(fresh)
    try:
        pretrain(
            cfg,
            TSTDatasets(),
            ModelType.encoder_or_decoder,
            TSTForwardStep(),
            model_provider=provider,
        )
    except ConfigError as exc:  # found inside: the datasets provider's data checks
        _exit_on(exc)
    finally:
        if hook is not None:
            hook.remove()


def _nothing_left_to_train(args) -> bool:
    """True (after a ``note:`` on rank 0) when the checkpoint to resume is already at
    ``--train-iters`` and not ``--skip-train``: Megatron-LM 0.19.2's sampler would stop with
    "no samples left to consume"."""
    from tst_megatron.training.plan import checkpoint_to_resume, train_iters

    found = None if args.skip_train else checkpoint_to_resume(args)
    if found is None or found[0] < train_iters(args):
        return False
    if os.environ.get("RANK", "0") == "0":
        print(
            f"note: the checkpoint in --load {args.load} is at iteration {found[0]} of "
            f"--train-iters {train_iters(args)}: nothing left to train",
            flush=True,
        )
    return True


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
    from tst_megatron.runtime.distributed import resolve_process
    from tst_megatron.runtime.slurm import in_srun_step

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


def one_process_env(env: typing.Mapping[str, str]) -> dict:
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
    from tst_megatron.runtime.distributed import free_port

    port = env.get("MASTER_PORT") or str(free_port())
    master = env.get("MASTER_ADDR", "127.0.0.1")
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR=master, MASTER_PORT=port)


def _use_prebuilt_dataset_helpers() -> None:
    """Make ``megatron.core.datasets.utils.compile_helpers`` a no-op when the compiled helper
    imports: the megatron-core 0.19.2 wheel ships it without the Makefile that
    ``initialize_megatron``'s ``make`` needs, so the run would exit."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron-LM compile it
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


def fork_checkpoint_results_queue() -> None:
    """Make megatron-core's torch_dist write-results queue now by ``fork``, as Megatron-LM's
    persistent checkpoint worker does (``megatron.training.async_utils``), for a CPU run: at the
    first save its default ``spawn`` re-imports torch and megatron-core (about 8 s on 2 cores).
    Idempotent."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        get_write_results_queue,
    )

    get_write_results_queue(mp_mode="fork")


def _exit_on(exc: ConfigError) -> typing.NoReturn:
    """Report ``exc`` once for the job (rank 0) and exit with status 2."""
    from tst_megatron.runtime import report_error

    report_error(str(exc))
    raise SystemExit(2) from None
