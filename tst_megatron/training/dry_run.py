"""``--dry-run``: the launch's own checks (:func:`tst_megatron.training.validate.check`, run
with ``dry_run=True``) plus a report of what the launch line would do at ``WORLD_SIZE=N``:
the layout, the batch, the model and Megatron-LM's parameter count
(:mod:`tst_megatron.models.report`) and the TST plan; or every problem found, one
``error: ...`` line each. Exit status 0 or 2. Nothing is started: no process group, no model,
no data, no GPU (a launch line for CUDA is checked as for an H100 with Transformer Engine when
this machine has neither: :mod:`tst_megatron.training.assumed`).
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from tst_megatron.models.family import GPT, ModelFamily
from tst_megatron.models.pattern import gpt_arguments
from tst_megatron.models.report import model_report
from tst_megatron.runtime.distributed import is_rank_zero
from tst_megatron.training.checks import outputs
from tst_megatron.training.validate import check


def _batch_lines(args, plan, dp: int) -> list[str]:
    """The batch, or the batch-size schedule step by step (``plan.global_batches``, from
    Megatron-LM's calculator)."""

    per_micro = args.micro_batch_size * dp
    if not getattr(args, "step_batch_size_schedule", None):
        return [
            f"batch: global batch {args.global_batch_size} = micro-batch "
            f"{args.micro_batch_size} x DP {dp} x {args.global_batch_size // per_micro} "
            f"micro-batches per step; samples of --seq-length {args.seq_length}"
        ]
    steps = ", ".join(
        f"from sample {threshold:,}: {batch} ({batch // per_micro} micro-batches)"
        for threshold, batch in plan.global_batches
    )
    return [
        f"batch: --step-batch-size-schedule, micro-batch {args.micro_batch_size} x DP {dp}; "
        f"global batch {steps}; samples of --seq-length {args.seq_length}"
    ]


def describe(args, plan, model_lines: list[str]) -> list[str]:
    """The run as lines of text (layout, batch, the model's ``model_lines``, TST plan) from
    validated Megatron-LM arguments with the launcher's ``--tst-*`` flags and their ``plan`` (a
    :class:`~tst_megatron.loop.plan.RunPlan`), both from
    :func:`~tst_megatron.training.validate.check`, and the model's lines
    (:func:`~tst_megatron.models.report.model_report`).
    """
    tp, pp, cp = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        args.context_parallel_size,
    )
    dp = args.data_parallel_size
    vpp = args.virtual_pipeline_model_parallel_size or 1
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
    lines = [
        f"layout: world {args.world_size} = TP {tp} x CP {cp} x PP {pp} x DP {dp}; VPP {vpp}; "
        f"EP {ep}, ETP {etp}, expert DP {args.world_size // (ep * etp * pp)}; "
        f"sequence parallel {'on' if args.sequence_parallel else 'off'}"
    ]
    return lines + _batch_lines(args, plan, dp) + model_lines + _tst_lines(args, plan)


def _tst_lines(args, plan) -> list[str]:
    """The TST plan: N1 of N, the switch sample, each phase's sample and sequence lengths."""
    tst, n1, n = plan.tst, plan.n1, plan.n
    given = f" (from --train-samples {args.train_samples:,})" if args.train_samples else ""
    if n1 == 0:
        return [
            f"TST: no phase 1 (bag size {tst.bag_size}): next-token training for {n:,} "
            f"iterations{given}, samples of {plan.schedule.phase2.data_seq_length} + 1 tokens"
        ]
    phase1, phase2 = plan.schedule.phase1, plan.schedule.phase2
    return [
        f"TST: bag size {tst.bag_size}, mode {tst.mode}, weighting {tst.bag_weighting}; "
        f"N1 = {n1:,} of {n:,} iterations{given}; switch at sample {plan.switch_sample:,}; "
        f"phase 1: samples of {phase1.data_seq_length} + 1 tokens, {phase1.model_seq_length} "
        f"positions; phase 2: samples of {phase2.data_seq_length} + 1 tokens"
    ]


def dry_run(argv: Sequence[str], *, out=None, err=None, family: ModelFamily = GPT) -> int:
    """``--dry-run`` of ``family``'s launcher: :func:`~tst_megatron.training.validate.check`
    ``argv`` for ``WORLD_SIZE`` processes (default 1) as the launch does, and print the run
    (stdout) or every problem (``error: ...`` lines on stderr). Prints from rank 0 only
    (:func:`~tst_megatron.runtime.distributed.is_rank_zero`).

    Returns:
        0 when no problem was found, else 2.
    """
    out, err = out or sys.stdout, err or sys.stderr
    launch = check(argv, dry_run=True, family=family)
    rank0 = is_rank_zero()
    problems, notes, assumed = list(launch.problems), launch.notes, launch.assumed
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not problems:
        gpt = gpt_arguments(launch.args, launch.pattern)  # what Megatron-LM's arithmetic counts
        model = model_report(launch.args, launch.pattern, gpt)
        lines = describe(launch.args, launch.plan, model.lines)
        notes = notes + outputs.space_notes(launch.args, model.checkpoint_bytes)
    if not rank0:
        return 2 if problems else 0
    if problems:
        for line in problems:
            print(f"error: {line}", file=err, flush=True)
        for line in notes:
            print(f" note: {line}", file=err)
        for line in assumed:
            print(f" assumed: {line}", file=err)
        print(f"dry run: {len(problems)} problem(s) for world size {world}", file=err, flush=True)
        return 2
    device = "CPU" if launch.device == "cpu" else "CUDA"
    print(f"dry run: world size {world}, checked as a {device} run", file=out)
    for line in notes:
        print(f" note: {line}", file=out)
    for line in assumed:
        print(f" assumed: {line}", file=out)
    for line in lines:
        print(f" {line}", file=out)
    print("dry run: no problems found", file=out, flush=True)
    return 0
