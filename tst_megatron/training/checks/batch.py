"""Batch rules: what Megatron-LM's batch-size calculator accepts but ``train()`` asserts only
when the run gets there."""

from __future__ import annotations


def schedule_problems(args, plan) -> list[str]:
    """Each global batch of ``--step-batch-size-schedule`` the run reaches (``plan``'s
    ``reached_batches``, a
    :class:`~tst_megatron.loop.plan.RunPlan`) that micro-batch x DP does not divide:
    Megatron-LM's ``train()`` asserts it only when it gets there."""
    if not getattr(args, "step_batch_size_schedule", None):
        return []
    per_step = args.micro_batch_size * args.data_parallel_size
    return [
        f"--step-batch-size-schedule: global batch {batch} (from sample {first:,}) is not "
        f"divisible by --micro-batch-size {args.micro_batch_size} x data-parallel size "
        f"{args.data_parallel_size}; Megatron-LM asserts it when the run gets there"
        for first, batch in plan.reached_batches
        if batch % per_step
    ]


def problems(launch) -> list[str]:
    """The batch rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return schedule_problems(launch.args, launch.plan)
