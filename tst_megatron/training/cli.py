"""The launcher (``examples/pretrain_gpt_tst.py``): Megatron-LM's ``pretrain_gpt.py`` with
Token Superposition Training, run by Megatron-LM's own ``pretrain()``.

:func:`main` runs every check first (:func:`tst_megatron.training.validate.check`: Megatron-LM's
parser and ``validate_args``, the model's ``TransformerConfig``, the launcher's rules); any
problem ends the job with one ``error:`` line per problem from rank 0 and exit status 2 on
every rank, before any process group, model or data exists. ``--dry-run`` is the same path
plus a report (:mod:`tst_megatron.training.dry_run`). Then ``pretrain()`` gets TST's
extension points: the model provider (:func:`~tst_megatron.training.model.model_provider`),
the datasets provider (:class:`~tst_megatron.training.datasets.TSTDatasets`) and the forward
step (:class:`~tst_megatron.training.forward.TSTForwardStep`), which also makes Megatron-LM
save, validate and log the switch (:mod:`tst_megatron.training.switch`).

Device: Megatron-LM has no ``--device`` flag; this launcher adds ``--device {auto,cuda,cpu}``
(``auto``: CUDA when ``torch.cuda.is_available()``). A CPU run enables
:func:`tst_megatron.runtime.cpu.enable` and appends
:data:`~tst_megatron.training.flags.CPU_FLAGS`.
"""

from __future__ import annotations

import os
import sys
import typing
from typing import Optional, Sequence

import torch

from tst_megatron.errors import ConfigError


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check, then run Megatron-LM's ``pretrain()`` with TST's extension points.

    ``argv`` defaults to ``sys.argv[1:]``. On a problem (any check before work, or a
    :class:`ConfigError` raised inside ``pretrain()``: a data file the datasets provider
    refuses) the job prints one ``error:`` line per problem, once
    (:func:`tst_megatron.runtime.report_error`: rank 0, and every other rank returns only
    after it printed, so a launcher that stops all ranks when one exits does not lose the
    line), and every rank exits with status 2. With ``--dry-run`` it exits with
    :func:`tst_megatron.training.dry_run.dry_run`'s status (0 or 2) instead of training.
    """
    from megatron.core.enums import ModelType

    from tst_megatron.training.datasets import TSTDatasets
    from tst_megatron.training.forward import TSTForwardStep
    from tst_megatron.training.model import model_provider
    from tst_megatron.training.validate import parse

    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:
        from tst_megatron.training.dry_run import dry_run

        raise SystemExit(dry_run(argv))
    try:
        export_torchrun_env()
        checked = parse(argv)
    except ConfigError as exc:
        _exit_on(exc)
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    if _nothing_left_to_train(checked.args):
        return
    os.environ.update(one_process_env(os.environ))
    _use_prebuilt_dataset_helpers()
    if checked.device == "cpu":
        from tst_megatron.runtime import cpu

        cpu.enable(training=True)  # again: modules imported since
        fork_checkpoint_results_queue()
    cfg = pretrain_cfg_container_from_args(checked.args)
    try:
        pretrain(
            cfg,
            TSTDatasets(),
            ModelType.encoder_or_decoder,
            TSTForwardStep(),
            model_provider=model_provider,
        )
    except ConfigError as exc:  # found inside: the datasets provider's data checks
        _exit_on(exc)


def _nothing_left_to_train(args) -> bool:
    """True (after a ``note:`` on rank 0) when the checkpoint ``--load`` would resume is already
    at ``--train-iters``: Megatron-LM's sampler would stop on it with "no samples left to
    consume" (0.19.2), as the dataset holds exactly the run's samples. A run with
    ``--skip-train`` (evaluation only) goes on."""
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
    """Make a task of an ``srun`` step look like a torchrun worker to Megatron-LM.

    Megatron-LM's ``parse_args`` and ``initialize_megatron`` read torchrun's variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; init method
    ``env://``). A task started by ``srun`` without torchrun has Slurm's instead; they are read
    by :func:`tst_megatron.runtime.distributed.resolve_process` (rank ``SLURM_PROCID``, world
    ``SLURM_STEP_NUM_TASKS``, local rank ``SLURM_LOCALID``, rendezvous on the step's first host
    at a port derived from the job id: :func:`tst_megatron.runtime.slurm.slurm_rendezvous`) and
    exported under torchrun's names. torchrun's variables win (nothing is changed when ``RANK``
    is set), and outside an ``srun`` step nothing is set. Megatron-LM calls
    ``torch.cuda.set_device(LOCAL_RANK)``: when Slurm binds fewer GPUs to the task than there
    are tasks on the node (``--gpus-per-task=1``: each task sees one GPU, device 0),
    ``LOCAL_RANK`` is ``SLURM_LOCALID`` modulo the visible GPUs, the task's own GPU.

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
    """The variables that make a process started by neither torchrun nor ``srun`` (``python
    examples/pretrain_gpt_tst.py ...`` in a shell or a batch script) a world of one, as
    ``torchrun --nproc_per_node 1`` would: rank 0 of 1, rendezvous on ``MASTER_ADDR`` (default
    127.0.0.1) at ``MASTER_PORT`` (default a free port). Megatron-LM alone stops there with a
    traceback ("MASTER_ADDR expected, but not set"). Empty when ``RANK`` is set (torchrun, or
    :func:`export_torchrun_env` in an ``srun`` step)."""
    if "RANK" in env:
        return {}
    from tst_megatron.runtime.distributed import free_port

    port = env.get("MASTER_PORT") or str(free_port())
    master = env.get("MASTER_ADDR", "127.0.0.1")
    return {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": master,
        "MASTER_PORT": port,
    }


def _use_prebuilt_dataset_helpers() -> None:
    """Megatron-LM's ``initialize_megatron`` runs ``make`` in megatron-core's datasets folder
    (``megatron.core.datasets.utils.compile_helpers``); the wheel ships the compiled helper
    and no Makefile, so ``make`` fails and the run exits. When the compiled helper imports,
    that function is replaced (in its module only) by one that does nothing."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return  # a source checkout: let Megatron-LM compile it
    import megatron.core.datasets.utils as dataset_utils

    def compile_helpers():
        """The compiled dataset helper is already installed (megatron-core wheel)."""

    dataset_utils.compile_helpers = compile_helpers


def fork_checkpoint_results_queue() -> None:
    """Start megatron-core's torch_dist write-results queue now, by ``fork`` (a CPU run).

    megatron-core's ``FileSystemWriterAsync`` makes the queue at a process's first torch_dist
    save (``filesystem_async.get_write_results_queue``) with a multiprocessing ``Manager``
    started by ``spawn``, whose server process re-imports the launcher and with it torch and
    megatron-core: about 8 s at each process's first save on a 2-core machine. Megatron-LM makes the same queue with ``mp_mode="fork"`` when it starts its
    persistent checkpoint worker (``megatron.training.async_utils``); this does what that does,
    through the same public function, before ``pretrain()``. Only for a CPU run: on a GPU the
    launcher keeps megatron-core's default (no fork of a process that holds a CUDA context).
    Idempotent (the queue is made once per process).
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        get_write_results_queue,
    )

    get_write_results_queue(mp_mode="fork")


def _exit_on(exc: ConfigError) -> typing.NoReturn:
    """Report ``exc`` once for the job (:func:`tst_megatron.runtime.report_error`) and exit
    with status 2."""
    from tst_megatron.runtime import report_error

    report_error(str(exc))
    raise SystemExit(2) from None
