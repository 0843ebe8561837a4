"""The launchers (``examples/pretrain_gpt_tst.py``, ``examples/pretrain_hybrid_tst.py``):
Megatron-LM's ``pretrain_gpt.py`` and ``pretrain_hybrid.py`` with Token Superposition
Training, run by Megatron-LM's own ``pretrain()`` (the torchrun/Slurm environment:
:mod:`tst_megatron.runtime.distributed`). Every check runs first
(:func:`tst_megatron.training.validate.check`); a problem ends the job before any process
group, model or data exists. A CPU run (``--device cpu``) enables
:func:`tst_megatron.runtime.cpu.enable`.
"""

from __future__ import annotations

import json
import os
import sys
import typing
from typing import Optional, Sequence

from megatron.core.enums import ModelType
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tst_megatron import upstream
from tst_megatron.data.gpt_datasets import use_prebuilt_dataset_helpers
from tst_megatron.errors import ConfigError
from tst_megatron.loop.datasets import TSTDatasets
from tst_megatron.loop.forward import TSTForwardStep
from tst_megatron.loop.switch import FreshAdamForMTP
from tst_megatron.models.family import GPT, ModelFamily
from tst_megatron.runtime import cpu
from tst_megatron.runtime.distributed import (
    export_torchrun_env,
    is_rank_zero,
    one_process_env,
    report_error,
)
from tst_megatron.training.dry_run import dry_run
from tst_megatron.training.validate import check_and_set_up


def main(argv: Optional[Sequence[str]] = None, *, family: ModelFamily = GPT) -> None:
    """Check ``argv`` (default ``sys.argv[1:]``), then run Megatron-LM's ``pretrain()`` with
    ``family``'s model provider (:data:`~tst_megatron.models.family.GPT`:
    ``pretrain_gpt.py``'s ``GPTModel``; :data:`~tst_megatron.models.family.HYBRID`:
    ``pretrain_hybrid.py``'s ``HybridModel``), TST's datasets provider and forward step,
    which share the run plan the checks built (and, with MTP, the optimizer hook
    :class:`~tst_megatron.loop.switch.FreshAdamForMTP`), with megatron-core's
    distributed-optimizer resume mended (:func:`tst_megatron.upstream.distributed_optimizer_resume`).

    Writes :data:`EXIT_MARKER` in ``--save`` when ``pretrain()`` ends without an error
    (:func:`write_exit_marker`: finished, or stopped early to be resumed).

    Raises:
        SystemExit: 2 on every rank after one ``error:`` line per problem from rank 0 (any
            check, or a :class:`ConfigError` inside ``pretrain()``); with ``--dry-run``,
            :func:`tst_megatron.training.dry_run.dry_run`'s status (0 or 2).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--dry-run" in argv:
        raise SystemExit(dry_run(argv, family=family))
    try:
        export_torchrun_env()
        alone = one_process_env(os.environ)
        launch = check_and_set_up(argv, family)
    except ConfigError as exc:
        _exit_on(exc)
    # Megatron-LM's training loop is heavy: imported once the checks passed
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.training import pretrain

    plan = launch.plan
    if _nothing_left_to_train(launch, plan.n):
        return
    os.environ.update(alone)
    use_prebuilt_dataset_helpers()
    if launch.device == "cpu":
        cpu.enable(training=True)  # again: modules imported since
        cpu.fork_checkpoint_results_queue()
    cfg = pretrain_cfg_container_from_args(launch.args)
    provider = family.model_provider
    hook = None
    if getattr(launch.args, "mtp_num_layers", None) and plan.n1 > 0:
        fresh = FreshAdamForMTP(plan.n1)
        provider = fresh.watch(provider)
        hook = register_optimizer_step_pre_hook(fresh)
    try:
        with upstream.distributed_optimizer_resume():
            pretrain(
                cfg,
                TSTDatasets(plan),
                ModelType.encoder_or_decoder,
                TSTForwardStep(plan),
                model_provider=provider,
            )
    except ConfigError as exc:  # found inside: the datasets provider's data checks
        _exit_on(exc)
    except SystemExit as exc:  # train()'s early exit: a signal, --exit-duration-in-mins/-interval
        if exc.code in (0, None):
            write_exit_marker(launch.args, plan.n, finished=False)
        raise
    else:
        write_exit_marker(launch.args, plan.n, finished=True)
    finally:
        if hook is not None:
            hook.remove()


def _nothing_left_to_train(launch, n: int) -> bool:
    """True (after a ``note:`` on rank 0) when the checkpoint to resume (``Launch.resumed``) is
    already at iteration ``n`` (the run's last) and not ``--skip-train``: Megatron-LM 0.19.2's
    sampler would stop with "no samples left to consume"."""
    args = launch.args
    found = None if args.skip_train else launch.resumed
    if found is None or found[0] < n:
        return False
    if is_rank_zero():
        print(
            f"note: the checkpoint in --load {args.load} is at iteration {found[0]} of "
            f"--train-iters {n}: nothing left to train",
            flush=True,
        )
    return True


#: The file the launcher writes in ``--save`` when ``pretrain()`` ends without an error.
EXIT_MARKER = "tst_exit.json"


def write_exit_marker(args, n: int, *, finished: bool) -> None:
    """Write :data:`EXIT_MARKER` in ``--save`` (rank 0; atomically): how the run ended, for a
    wrapper such as the Slurm template. Megatron-LM 0.19.2 exits with status 0 both when the run
    is done and when it saved and stopped early (``--exit-signal-handler`` on SIGTERM,
    ``--exit-duration-in-mins``, ``--exit-interval``: ``sys.exit(0)`` in ``train()``); the status
    stays 0, as torchrun restarts workers that exit otherwise (``--max-restarts``).

    The file holds ``{"status": "finished" | "stopped_early", "iteration": the tracker file's
    latest iteration (None without one), "train_iters": n}``; ``stopped_early``: run the same
    line again to continue from that checkpoint.
    """
    if not args.save or not is_rank_zero():
        return
    try:
        with open(os.path.join(args.save, "latest_checkpointed_iteration.txt")) as f:
            text = f.read().strip()
        latest = int(text) if text.isdigit() else None
    except OSError:
        latest = None
    status = "finished" if finished else "stopped_early"
    marker = os.path.join(args.save, EXIT_MARKER)
    tmp = f"{marker}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"status": status, "iteration": latest, "train_iters": n}, f)
    os.replace(tmp, marker)
    if not finished:
        print(
            f"TST: stopped early at checkpoint iteration {latest} of {n} (a signal, "
            f"--exit-duration-in-mins or --exit-interval): run the same line to continue "
            f"({marker} says stopped_early)",
            flush=True,
        )


def _exit_on(exc: ConfigError) -> typing.NoReturn:
    """Report ``exc`` once for the job (rank 0) and exit with status 2."""
    report_error(str(exc))
    raise SystemExit(2) from None
