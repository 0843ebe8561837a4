"""The run's plan, the one home of its counts: training iterations, samples consumed, ``N1``
and the switch sample (Megatron-LM's own batch-size calculator), and the resume checks that
compare the plan with the checkpoint a run would load."""

from __future__ import annotations

import os
import warnings
from typing import Optional

from tst_megatron.errors import ConfigError
from tst_megatron.superposition.schedule import Schedule
from tst_megatron.training.flags import tst_config


def _batch_calculator(args):
    """A private copy of Megatron-LM's batch-size calculator for ``--step-batch-size-schedule``
    (built as ``megatron.training.global_vars.set_global_variables`` builds the global one),
    or None for a constant global batch."""
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
    """Training samples consumed by the first ``iterations`` steps, as Megatron-LM's ``train()``
    counts them: ``iterations * --global-batch-size``, or with ``--step-batch-size-schedule`` the
    sum of each step's batch, the batch of a step being the schedule's at the samples consumed
    before it (token thresholds count ``--seq-length`` tokens per sample, in phase 1 too)."""
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
    ``update_train_iters``: ``train_samples // global batch``, or with a step schedule the
    first step count whose consumed samples reach ``--train-samples``)."""
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
    """Training samples consumed before the switch: those of the first ``N1`` steps
    (:func:`consumed_samples`), so the switch is right under a batch-size schedule and after
    a resume (Megatron-LM's sampler restarts at its consumed samples)."""
    return consumed_samples(args, schedule(args).n1)


# --- resuming ------------------------------------------------------------------------------


def checkpoint_to_resume(args) -> Optional[tuple[int, dict]]:
    """``(iteration, common state)`` of the ``torch_dist`` checkpoint Megatron-LM's
    ``load_checkpoint`` would resume under ``args`` (``--load``; ``--ckpt-step`` or the tracker
    file ``latest_checkpointed_iteration.txt``), read before any process group exists; the
    common state is megatron-core's ``load_common_state_dict`` (``args``,
    ``opt_param_scheduler``, ...). None when nothing would be resumed: no ``--load``, no
    tracker, a release checkpoint, ``--finetune``, or not a ``torch_dist`` checkpoint.

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
        # read here, not with Megatron-LM's read_metadata: on a malformed file that one
        # prints a line and calls sys.exit() with status 0 (0.19.2)
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
    """Why resuming the checkpoint of ``iteration``, written by a run with arguments ``saved``,
    under the arguments ``args`` would not continue the checkpoint's TST run; one line each
    naming the flag (empty: none). Reads only. A checkpoint without ``--tst-*`` arguments (a
    run of Megatron-LM's ``pretrain_gpt.py``) is not checked.

    Phase 2 reads the windows phase 1 left, in an order drawn from what phase 1 read: the
    windows per phase-1 sample (``--tst-bag-size``; 1 with ``--tst-mode output``) and the
    samples before the switch (``N1`` x the global batch; ``N1`` from ``--tst-phase1-*`` and
    ``--train-iters``). Those must equal the checkpoint's at any iteration of a run with a
    phase 1. Before the switch the phase-1 loss must too (``--tst-mode``,
    ``--tst-bag-weighting``).
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
    """The values Megatron-LM's ``get_optimizer_param_scheduler`` gives
    ``OptimizerParamScheduler`` for ``args`` and that its ``load_state_dict`` compares with a
    checkpoint's, by the checkpoint's key names (Megatron-LM 0.19.2's arithmetic)."""
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
    """The learning-rate schedule values that Megatron-LM's ``OptimizerParamScheduler`` would
    refuse on resuming the checkpoint of ``iteration`` (its ``load_state_dict`` asserts each
    equals the checkpoint's, after building the model), as one line naming them and the
    flags that allow it (empty: none). Not checked with ``--override-opt-param-scheduler``,
    ``--use-checkpoint-opt_param-scheduler`` or ``--no-load-optim``."""
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
