"""The run's counts (training iterations, consumed samples, ``N1``, the switch sample; from
Megatron-LM's batch-size calculator), built once per launch as a :class:`RunPlan`."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

from tst_megatron.superposition.schedule import Schedule, TSTConfig


def _batch_calculator(args):
    """A private Megatron-LM batch-size calculator for ``--step-batch-size-schedule`` (as
    ``set_global_variables`` builds it), or None for a constant global batch."""
    if not getattr(args, "step_batch_size_schedule", None):
        return None
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


def consumed_samples(args, iterations: int, batches: Optional[tuple] = None) -> int:
    """Training samples consumed by the first ``iterations`` steps, as Megatron-LM's
    ``train()`` counts them (with a step schedule, each step's batch is the schedule's at the
    samples consumed before it). ``batches``: ``((first sample, global batch), ...)`` to use
    instead of ``args``'s (a resume that changed the batch: :func:`run_plan`)."""
    if batches is not None:
        consumed = 0
        for _ in range(iterations):
            consumed += [batch for first, batch in batches if first <= consumed][-1]
        return consumed
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


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """The run's counts, computed once from the validated arguments (:func:`run_plan`) and
    read by the launch checks, the dry run's report, the datasets provider and the forward
    step.

    Attributes:
        tst: the ``--tst-*`` settings.
        schedule: ``N``, ``N1`` and each phase's sequence lengths (tokens per sample read,
            positions the model processes).
        switch_sample: training samples consumed by the first ``N1`` steps (Megatron-LM's
            ``consumed_train_samples`` at the switch).
        total_samples: training samples consumed by all ``N`` steps.
        global_batches: ``((first sample, global batch), ...)``: one entry for a constant
            ``--global-batch-size``, the steps of ``--step-batch-size-schedule`` otherwise
            (:attr:`reached_batches`: those the run's training steps reach).
    """

    tst: TSTConfig
    schedule: Schedule
    switch_sample: int
    total_samples: int
    global_batches: tuple

    @property
    def reached_batches(self) -> tuple:
        """The entries of :attr:`global_batches` the run's training steps reach (none when
        it trains none)."""
        return tuple(entry for entry in self.global_batches if entry[0] < self.total_samples)

    @property
    def n(self) -> int:
        """N, the training iterations of the run."""
        return self.schedule.train_iters

    @property
    def n1(self) -> int:
        """N1, the phase-1 iterations (0: no phase 1)."""
        return self.schedule.n1

    def batches_in_phase(self, index: int) -> tuple:
        """The ``(first sample, global batch)`` entries of :attr:`global_batches` in force during
        phase ``index`` (1: samples before :attr:`switch_sample`, 2: from it on)."""
        lo, hi = (0, self.switch_sample) if index == 1 else (self.switch_sample, self.total_samples)
        reached = self.reached_batches
        starts = [first for first, _ in reached] + [self.total_samples]
        return tuple(entry for entry, end in zip(reached, starts[1:]) if entry[0] < hi and end > lo)


def tst_config(args) -> TSTConfig:
    """The :class:`TSTConfig` of parsed Megatron-LM arguments (fields ``tst_*``). A field that
    ``args`` lacks takes its default: the saved args of a checkpoint written before the field
    existed (e.g. ``--tst-loss-chunks``, added 2026-12-06)."""
    return TSTConfig(
        **{f.name: getattr(args, f"tst_{f.name}", f.default) for f in dataclasses.fields(TSTConfig)}
    )


def run_plan(args, resumed: Optional[tuple[int, object]] = None) -> RunPlan:
    """The :class:`RunPlan` of Megatron-LM arguments after ``validate_args`` (or of a
    checkpoint's saved arguments, for the resume checks).

    ``resumed``: ``(iteration, the checkpoint's saved args)`` of the checkpoint this launch
    resumes. When it is past the switch and the run changes a constant ``--global-batch-size``
    (neither uses ``--step-batch-size-schedule``), the checkpoint's steps keep their batch:
    the plan's batches are the checkpoint's up to the samples it consumed, then this run's,
    so the switch sample (which splits the data into phase 1 and phase 2) is the
    checkpoint's. Anything else is planned from ``args`` alone (the resume rules refuse a
    batch change before the switch: ``checks/resume.resume_problems``).

    Raises:
        AssertionError, ValueError: Megatron-LM's batch-size calculator refused
            ``--step-batch-size-schedule``.
    """
    tst, n = tst_config(args), train_iters(args)
    schedule = Schedule.plan(tst, seq_length=args.seq_length, train_iters=n)
    # a checkpoint's saved args record the batches of a run that changed its batch
    batches = _resumed_batches(args, schedule, resumed) or getattr(args, "tst_global_batches", None)
    return RunPlan(
        tst=tst,
        schedule=schedule,
        switch_sample=consumed_samples(args, schedule.n1, batches),
        total_samples=consumed_samples(args, n, batches),
        global_batches=batches or tuple(global_batches(args)),
    )


def _resumed_batches(args, schedule: Schedule, resumed) -> Optional[tuple]:
    """The batches of :func:`run_plan` after a batch change past the switch, else None."""
    if resumed is None:
        return None
    iteration, saved = resumed
    constant = not any(getattr(a, "step_batch_size_schedule", None) for a in (args, saved))
    consumed = getattr(saved, "consumed_train_samples", None)
    was = getattr(saved, "global_batch_size", None)
    if not (constant and was and consumed is not None and iteration >= schedule.n1 > 0):
        return None
    # the checkpoint's own history (recorded by this launcher since a batch change; before,
    # one constant batch), up to the samples it consumed, then this run's batch
    history = getattr(saved, "tst_global_batches", None) or ((0, was),)
    batches = tuple(tuple(entry) for entry in history if entry[0] < consumed) or ((0, was),)
    if batches[-1][1] != args.global_batch_size:
        batches += ((consumed, args.global_batch_size),)
    return None if len(batches) == 1 else batches
