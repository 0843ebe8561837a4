"""``--dry-run``: the launch's own checks (:func:`tst_megatron.training.validate.check`, run
with ``dry_run=True``) plus a report of what the launch line would do at ``WORLD_SIZE=N``:
the layout, the batch, the model, Megatron-LM's parameter count and the TST plan; or every
problem found, one ``error: ...`` line each. Exit status 0 or 2. Nothing is started: no process group, no model, no data, no GPU (a launch
line for CUDA is checked as for an H100 with Transformer Engine when this machine has
neither: :mod:`tst_megatron.training.assumed`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import sys
from typing import Optional, Sequence

from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)

from tst_megatron.models.family import GPT, ModelFamily
from tst_megatron.models.pattern import LAYER_KINDS, HybridPattern, gpt_equivalent
from tst_megatron.runtime.distributed import is_rank_zero
from tst_megatron.training.checks import outputs
from tst_megatron.training.validate import check


def _countable(args):
    """A copy of ``args`` that Megatron-LM's memory arithmetic can count: its padded
    vocabulary from ``--vocab-size`` (NullTokenizer), else 0 (a tokenizer file's vocabulary: a
    dry run reads none)."""
    counted = copy.copy(args)
    counted.padded_vocab_size = 0
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size:  # given by --vocab-size
        # megatron.training (Megatron-LM) is heavy: imported once the line is known good
        from megatron.training.vocab_utils import calculate_padded_vocab_size

        counted.padded_vocab_size = calculate_padded_vocab_size(
            args.vocab_size,
            args.make_vocab_size_divisible_by,
            args.tensor_model_parallel_size,
            logging_enabled=False,
        )
    return counted


def parameter_lines(args) -> list[str]:
    """Megatron-LM's own parameter counts (in billions) and the weight-and-optimizer memory of
    the most loaded rank, by ``compute_weight_and_optimizer_memory`` (Megatron-LM 0.19.2,
    ``megatron/training/theoretical_memory_usage.py``; what Megatron-LM prints at its first
    log line). Its arithmetic leaves out biases, q/k norms and learnable softmax offsets; the
    embeddings count as 0 when the vocabulary comes from a tokenizer file (a dry run reads
    none). Runs on a copy of ``args`` (the function writes ``num_query_groups``).

    Returns:
        ``["parameters (Megatron-LM): ...", ...]``, or one line saying why it could not count.
    """
    # megatron.training (Megatron-LM) is heavy: imported once the line is known good
    from megatron.training.theoretical_memory_usage import (
        NUM_BYTES_IN_MEGABYTE,
        compute_weight_and_optimizer_memory,
    )

    counted = _countable(args)
    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            memory = compute_weight_and_optimizer_memory(counted, verbose=True)
    except Exception as exc:  # a model its arithmetic does not cover (hybrid, MLA + GQA, ...)
        return [f"parameters: not counted by Megatron-LM ({type(exc).__name__}: {exc})"]
    lines = [f"parameters (Megatron-LM): {x.strip()}" for x in text.getvalue().splitlines()]
    if counted.padded_vocab_size:
        lines.append(f"parameters (Megatron-LM): padded vocabulary {counted.padded_vocab_size}")
    else:
        lines.append(
            "parameters (Megatron-LM): embeddings not counted: the vocabulary comes from the "
            "tokenizer, which a dry run does not read"
        )
    lines.append(
        "memory (Megatron-LM): weights and optimizer state on the most loaded rank "
        f"{memory / NUM_BYTES_IN_MEGABYTE:,.0f} MB"
    )
    return lines


def checkpoint_bytes(args, pattern: Optional[HybridPattern]) -> Optional[float]:
    """One checkpoint's size in bytes, estimated from Megatron-LM's parameter count
    (``compute_weight_and_optimizer_memory`` of the whole model as one shard, 18 bytes per
    parameter without the distributed optimizer): the weights in their dtype (2 bytes in
    bf16/fp16, else 4) plus the fp32 main weights (mixed precision only) and Adam's two fp32
    moments; gradients are not saved (embeddings counted as :func:`parameter_lines` does; a
    GPT-shaped ``HybridModel`` as its ``GPTModel``; ``pattern``: the launch's parsed
    ``--hybrid-layer-pattern``, None for a ``GPTModel``). None when Megatron-LM's arithmetic
    cannot count the model (a hybrid's non-GPT layers, MLA + GQA, ...)."""
    # megatron.training (Megatron-LM) is heavy: imported once the line is known good
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    if pattern is not None and not pattern.gpt_shaped:  # Mamba, gated delta net layers
        return None
    whole = _countable(gpt_equivalent(args, pattern))
    whole.tensor_model_parallel_size = whole.pipeline_model_parallel_size = 1
    whole.expert_model_parallel_size = whole.data_parallel_size = 1
    whole.use_distributed_optimizer = False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parameters = compute_weight_and_optimizer_memory(whole, verbose=False) / 18
    except Exception:  # a model its arithmetic does not cover: no estimate, no note
        return None
    mixed = getattr(args, "bf16", False) or getattr(args, "fp16", False)
    return parameters * ((2 + 4) + 8 if mixed else 4 + 8)


# --- the dry run ---------------------------------------------------------------------------


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


def describe(args, plan, pattern: Optional[HybridPattern]) -> list[str]:
    """The run as lines of text (layout, batch, model, parameters, TST plan; a ``HybridModel``'s
    layers by kind) from validated
    Megatron-LM arguments with the launcher's ``--tst-*`` flags, their ``plan`` (a
    :class:`~tst_megatron.training.plan.RunPlan`) and their parsed ``--hybrid-layer-pattern``
    (``Launch.pattern``; None for a ``GPTModel``), all from
    :func:`~tst_megatron.training.validate.check`.
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
    lines += _batch_lines(args, plan, dp)
    if pattern is not None:
        return lines + _hybrid_lines(args, pattern) + _tst_lines(args, plan)
    if args.num_experts:
        n_moe = sum(get_moe_layer_pattern(args))
        kind = (
            f"MoE {n_moe} of {args.num_layers} layers: {args.num_experts} experts of "
            f"{args.moe_ffn_hidden_size}, top-{args.moe_router_topk}"
        )
        if args.moe_shared_expert_intermediate_size:
            kind += f", shared expert {args.moe_shared_expert_intermediate_size}"
    else:
        kind = "dense"
    if args.multi_latent_attention:
        q_rank = args.q_lora_rank if args.q_lora_rank else "none: no q compression"
        attention = (
            f"MLA, {args.num_attention_heads} heads (q rank {q_rank}, kv rank {args.kv_lora_rank})"
        )
    else:
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        attention = (
            f"{args.num_attention_heads} heads / {groups} query groups of {args.kv_channels}"
        )
    variant = getattr(args, "experimental_attention_variant", None)
    if variant:
        attention += f", {_variant_layers(args, variant)}"
    if getattr(args, "softmax_type", "vanilla") != "vanilla":
        attention += f", softmax {args.softmax_type}"
    if getattr(args, "window_size", None):
        attention += f", window {args.window_size}"
    mtp = f", MTP {args.mtp_num_layers} layer(s)" if getattr(args, "mtp_num_layers", None) else ""
    lines.append(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, FFN "
        f"{args.ffn_hidden_size}{' (gated)' if args.swiglu else ''}, {attention}; {kind}{mtp}; "
        f"{args.normalization}, {args.position_embedding_type} positions, "
        f"{args.transformer_impl}, {args.params_dtype}"
    )
    if variant:  # Megatron-LM's arithmetic counts every layer as standard attention
        counted = [
            f"parameters: not counted (Megatron-LM 0.19's arithmetic counts every layer as "
            f"standard attention; this model has {variant} layers)"
        ]
        return lines + counted + _tst_lines(args, plan)
    return lines + parameter_lines(args) + _tst_lines(args, plan)


def _variant_layers(args, variant: str) -> str:
    """Which layers are ``--experimental-attention-variant``'s: for gated delta net, those of
    ``--linear-attention-freq`` (megatron-core's ``get_linear_attention_pattern``: an int N
    keeps every N-th layer standard attention, a list marks each layer), else all."""
    if variant != "gated_delta_net" or args.linear_attention_freq is None:
        return f"{variant} attention in every layer"
    pattern = get_linear_attention_pattern(args)
    return f"gated delta net in {sum(pattern)} of {args.num_layers} layers (the rest standard)"


def _hybrid_lines(args, pattern: HybridPattern) -> list[str]:
    """A ``HybridModel``'s layers by family, its widths and experts, and its parameters:
    Megatron-LM 0.19's arithmetic (:func:`parameter_lines`) covers GPT models only, so a
    pattern :attr:`~tst_megatron.models.pattern.HybridPattern.counted_as_gpt` (``*-``/``*E``
    pairs, no MTP, pipeline segments of equal length) is counted as the ``GPTModel`` it
    equals (:func:`~tst_megatron.models.pattern.gpt_equivalent`), any other not at all."""
    kinds = ", ".join(
        f"{pattern.count(symbol)} {kind.name} ({symbol})"
        for symbol, kind in LAYER_KINDS.items()
        if pattern.count(symbol)
    )
    mtp = f"; MTP {pattern.mtp_depths} x '{pattern.mtp}'" if pattern.mtp_depths else ""
    experts = ""
    if args.num_experts:
        experts = (
            f"; {args.num_experts} experts of {args.moe_ffn_hidden_size}, "
            f"top-{args.moe_router_topk}"
        )
        if args.moe_shared_expert_intermediate_size:
            experts += f", shared expert {args.moe_shared_expert_intermediate_size}"
    lines = [
        f"model: HybridModel '{pattern.text}': {kinds}{mtp}; hidden {args.hidden_size}, FFN "
        f"{args.ffn_hidden_size}{' (gated)' if args.swiglu else ''}, "
        f"{args.num_attention_heads} heads{experts}; {args.normalization}, "
        f"{args.position_embedding_type} positions, {args.transformer_impl}, "
        f"{args.params_dtype}"
    ]
    if not pattern.counted_as_gpt:
        return lines + [
            "parameters: not counted (Megatron-LM 0.19's arithmetic covers GPT models; this "
            "pattern is not '*-'/'*E' pairs split evenly, without MTP)"
        ]
    return lines + [  # its parameter and memory lines
        line.replace("(Megatron-LM)", "(Megatron-LM, as the equivalent GPT)", 1)
        for line in parameter_lines(gpt_equivalent(args, pattern))
    ]


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
        lines = describe(launch.args, launch.plan, launch.pattern)
        notes = notes + outputs.space_notes(
            launch.args, checkpoint_bytes(launch.args, launch.pattern)
        )
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
