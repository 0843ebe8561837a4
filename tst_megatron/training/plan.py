"""The run's counts (training iterations, consumed samples, ``N1``, the switch sample; from
Megatron-LM's batch-size calculator) and the resume checks against the checkpoint to load."""

from __future__ import annotations

import os
import warnings
from typing import Optional

from tst_megatron.errors import ConfigError
from tst_megatron.superposition.schedule import Schedule
from tst_megatron.training.flags import tst_config


def _batch_calculator(args):
    """A private Megatron-LM batch-size calculator for ``--step-batch-size-schedule`` (as
    ``set_global_variables`` builds it), or None for a constant global batch."""
    if not getattr(args, "step_batch_size_schedule", None):
        return None
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    return StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=args.micro_batch_size,
        data_parallel_size=args.data_parallel_size * getattr(args, "gtp_weight_remat_size", 1),
        decrease_batch_size_if_needed=False,
        rank=-1,  # no logging
        schedule=args.step_batch_size_schedule,
        seq_length=args.seq_length,
    )


def global_batches(args) -> list[tuple[int, int]]:
    """``[(first sample, global batch)]`` of the run: one entry for a constant global batch,
    the steps of ``--step-batch-size-schedule`` otherwise."""
    calculator = _batch_calculator(args)
    if calculator is None:
        return [(0, args.global_batch_size)]
    return list(calculator.schedule)


def consumed_samples(args, iterations: int) -> int:
    """Training samples consumed by the first ``iterations`` steps, as Megatron-LM's
    ``train()`` counts them (with a step schedule, each step's batch is the schedule's at the
    samples consumed before it)."""
    calculator = _batch_calculator(args)
    if calculator is None:
        return iterations * args.global_batch_size
    consumed = 0
    for _ in range(iterations):
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_running_global_batch_size()
    return consumed


def train_iters(args) -> int:
    """``--train-iters``, or the steps that consume ``--train-samples`` (Megatron-LM's
    ``update_train_iters``)."""
    if args.train_iters:
        return args.train_iters
    calculator = _batch_calculator(args)
    if calculator is None:
        return (args.train_samples or 0) // args.global_batch_size
    iterations = consumed = 0
    while consumed < args.train_samples:
        calculator.update(consumed, consistency_check=False)
        consumed += calculator.get_current_global_batch_size()
        iterations += 1
    return iterations


def schedule(args) -> Schedule:
    """The TST phase schedule of the run: ``N1`` and the phases' sequence lengths."""
    return Schedule.plan(
        tst_config(args), seq_length=args.seq_length, train_iters=train_iters(args)
    )


def switch_sample(args) -> int:
    """Training samples consumed by the first ``N1`` steps (:func:`consumed_samples`)."""
    return consumed_samples(args, schedule(args).n1)


# --- resuming ------------------------------------------------------------------------------


def checkpoint_to_resume(args) -> Optional[tuple[int, dict]]:
    """``(iteration, common state)`` of the ``torch_dist`` checkpoint Megatron-LM's
    ``load_checkpoint`` would resume (``--load``, ``--ckpt-step`` or the tracker file), read
    without process groups via megatron-core's ``load_common_state_dict``. None when nothing
    would be resumed (or a release or non-``torch_dist`` checkpoint, ``--finetune``).

    Raises:
        ConfigError: a tracker file that holds no iteration.
    """
    if not args.load or getattr(args, "finetune", False):
        return None
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import (
        get_checkpoint_name,
        get_checkpoint_tracker_filename,
    )

    iteration = getattr(args, "ckpt_step", None)
    if iteration is None:
        tracker = get_checkpoint_tracker_filename(args.load)
        if not os.path.isfile(tracker):
            return None
        # not Megatron-LM's read_metadata: on a malformed file it exits with status 0 (0.19.2)
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            return None
        if not text.isdigit():
            raise ConfigError(
                f"--load {args.load}: {os.path.basename(tracker)} holds {text!r}, not an "
                "iteration (give --ckpt-step, or fix or remove the file)"
            )
        iteration = int(text)
    path = get_checkpoint_name(args.load, iteration, return_base_dir=True)
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return iteration, dist_checkpointing.load_common_state_dict(path)


def resume_problems(args, saved, iteration: int) -> list[str]:
    """Why resuming the checkpoint of ``iteration`` (written with arguments ``saved``) under
    ``args`` would not continue its TST run, one line per flag (empty: none, or ``saved`` has
    no ``--tst-*``). ``N1``, the switch sample and the windows per phase-1 sample must match
    (phase 2's order depends on them); before the switch the phase-1 loss flags too.
    """
    if iteration <= 0 or not hasattr(saved, "tst_bag_size"):
        return []
    old, new = schedule(saved), schedule(args)
    if old.n1 == 0 and new.n1 == 0:
        return []
    problems = []
    where = f"the checkpoint of iteration {iteration}"
    if old.n1 != new.n1:
        problems.append(
            f"{where} was written by a run switching at N1 = {old.n1}; this run switches at "
            f"N1 = {new.n1}: give the checkpoint's --tst-phase1-iters / --tst-phase1-fraction "
            "and --train-iters (phase 2 reads the windows phase 1 left)"
        )
    elif switch_sample(saved) != switch_sample(args):
        problems.append(
            f"{where} switched at sample {switch_sample(saved):,}; this run would switch at "
            f"sample {switch_sample(args):,}: give the checkpoint's --global-batch-size"
        )
    old_tst, new_tst = tst_config(saved), tst_config(args)
    fields = ["bag_size", "mode", "bag_weighting"]
    if iteration >= new.n1 and old_tst.windows_per_sample() == new_tst.windows_per_sample():
        fields = []  # phase 1 is over and phase 2 reads the same windows
    for field in fields:
        was, now = getattr(old_tst, field), getattr(new_tst, field)
        if was != now:
            flag = "--tst-" + field.replace("_", "-")
            problems.append(
                f"{where} is part of a TST run with {flag} {was}; this run has {flag} {now}: "
                f"resume with {flag} {was}"
            )
    return problems


def _scheduler_plan(args) -> dict:
    """The values Megatron-LM 0.19.2's ``get_optimizer_param_scheduler`` gives
    ``OptimizerParamScheduler`` that its ``load_state_dict`` compares, by state-dict key."""
    if args.train_iters:
        decay = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_steps = args.train_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        wd_steps, warmup = args.train_samples, args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": args.start_weight_decay,
        "end_wd": args.end_weight_decay,
        "wd_incr_steps": wd_steps,
    }


def scheduler_problems(args, saved_scheduler: Optional[dict], iteration: int) -> list[str]:
    """The schedule values Megatron-LM's ``OptimizerParamScheduler.load_state_dict`` would
    refuse on resuming the checkpoint of ``iteration``, as one line (empty: none, or
    ``--override-opt-param-scheduler``, ``--use-checkpoint-opt_param-scheduler``,
    ``--no-load-optim``)."""
    if (
        not saved_scheduler
        or getattr(args, "override_opt_param_scheduler", False)
        or getattr(args, "use_checkpoint_opt_param_scheduler", False)
        or getattr(args, "no_load_optim", False)
    ):
        return []
    differ = [
        f"{key} {saved_scheduler[key]} -> {value}"
        for key, value in _scheduler_plan(args).items()
        if key in saved_scheduler and saved_scheduler[key] != value
    ]
    if not differ:
        return []
    return [
        f"the checkpoint of iteration {iteration} has another learning-rate schedule "
        f"({', '.join(differ)}; from --train-iters, --lr* or --*weight-decay): Megatron-LM "
        "refuses the change; give the checkpoint's values, or --override-opt-param-scheduler "
        "to take this run's (a new schedule from this iteration on)"
    ]
