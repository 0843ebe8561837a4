"""TST rules: the ``--tst-*`` settings, and the Megatron-LM settings phase 1 cannot run with."""

from __future__ import annotations

from typing import Optional


def loss_chunk_problems(args, chunks: int) -> list[str]:
    """What ``--tst-loss-chunks`` > 1 cannot run with, one line each: it replaces the output
    layer's forward and the loss (:class:`~tst_megatron.models.seams.ChunkedOutputLayer`),
    so the settings that need the full logits or another head are refused."""
    if chunks <= 1:
        return []
    why = {
        "cross_entropy_loss_fusion": "--cross-entropy-loss-fusion: the chunked head computes "
        "the cross-entropy itself (the same math); drop one of the two",
        "use_mup": "--use-mup: MuP scales the logits between the output layer and the loss",
        "defer_embedding_wgrad_compute": "--defer-embedding-wgrad-compute: it defers the "
        "output layer's own weight gradient, which the chunked head computes itself",
    }
    lines = [
        f"--tst-loss-chunks {chunks} is not supported with {text}"
        for name, text in why.items()
        if getattr(args, name, None)
    ]
    mxfp8_head = getattr(args, "fp8_output_proj", False) and getattr(args, "fp8", None)
    if mxfp8_head and getattr(args, "fp8_recipe", None) == "mxfp8":
        lines.append(
            f"--tst-loss-chunks {chunks} is not supported with --fp8-output-proj under "
            "--fp8-recipe mxfp8: megatron-core then builds Transformer Engine's LM head "
            "(TELMHeadColumnParallelLinear, megatron-core 0.19.2's is_mxfp8_output_proj_active)"
        )
    return lines


def tst_problems(args, plan, resumed_at: Optional[int] = None) -> list[str]:
    """The settings TST cannot run, one line each naming the flag. ``args``: Megatron-LM's,
    after ``validate_args``; ``plan``: its :class:`~tst_megatron.loop.plan.RunPlan`;
    ``resumed_at``: the iteration of the checkpoint this launch resumes (None: a fresh start).
    FP8's shapes are :mod:`.fp8`'s rule."""
    problems = plan.tst.validate(max(plan.n, 1))
    if not problems:
        problems = loss_chunk_problems(args, plan.tst.loss_chunks)
    if problems or plan.n1 == 0:
        return problems
    bags = "(--tst-bag-size > 1)"
    for flag, on in (
        ("--reset-position-ids", args.reset_position_ids),
        ("--reset-attention-mask", args.reset_attention_mask),
    ):
        if on:
            problems.append(
                f"{flag} is not supported in TST phase 1 {bags}: bags are formed on the packed "
                "token stream; drop the flag or set --tst-bag-size 1"
            )
    if getattr(args, "phase_transition_iterations", None):
        problems.append(
            f"--phase-transition-iterations is not supported with TST {bags}: it restarts "
            "the sampler in each phase; TST switches in-process at N1"
        )
    # a run resumed at or past N1 has only phase 2 left
    past_switch = resumed_at is not None and resumed_at >= plan.n1
    if getattr(args, "cuda_graph_impl", "none") == "full_iteration" and not past_switch:
        problems.append(
            f"--cuda-graph-impl full_iteration is not supported with a TST phase 1 {bags}: "
            "megatron-core 0.19.2's FullCudaGraphWrapper captures one training iteration (a "
            "phase-1 step) and replays it after the switch; use per-layer graphs "
            "(--cuda-graph-impl local or transformer_engine: the same shapes in both phases), "
            "or full-iteration graphs in a run resumed from the switch checkpoint on"
        )
    if args.dataloader_type != "single":
        problems.append(
            f"--dataloader-type {args.dataloader_type} is not supported with TST {bags}: the "
            "phase of a sample is read from its position in the 'single' sampler's order"
        )
    return problems


def problems(launch) -> list[str]:
    """The TST rules of a :class:`~tst_megatron.training.checks.Launch`."""
    resumed_at = launch.resumed[0] if launch.resumed else None
    return tst_problems(launch.args, launch.plan, resumed_at)


def notes(launch) -> list[str]:
    """The TST settings' notes (``TSTConfig.notes``: phase-1 flags without a bag size, a
    phase 1 that fills the run)."""
    return launch.plan.tst.notes(launch.plan.n)
