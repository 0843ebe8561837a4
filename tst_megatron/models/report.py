"""What a dry run says about the model of a launch line, from Megatron-LM's arguments after
``validate_args`` and the parsed ``--hybrid-layer-pattern``: its layers, widths, attention and
experts (the ``model:`` line), Megatron-LM's own parameter count and weight-and-optimizer memory
(``megatron/training/theoretical_memory_usage.py``), and one checkpoint's size. Builds no
model; :mod:`tst_megatron.training.dry_run` prints it (:func:`model_report`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
from typing import Optional

from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_linear_attention_pattern,
    get_moe_layer_pattern,
)

from tst_megatron.models.pattern import LAYER_KINDS, HybridPattern


@dataclasses.dataclass(frozen=True)
class ModelReport:
    """The model's lines (``model: ...``, ``parameters ...``, ``memory ...``) and one
    checkpoint's estimated size in bytes (:func:`checkpoint_bytes`; None: not estimated)."""

    lines: list
    checkpoint_bytes: Optional[float]


def model_report(args, pattern: Optional[HybridPattern], gpt) -> ModelReport:
    """The :class:`ModelReport` of validated Megatron-LM ``args``, their parsed
    ``--hybrid-layer-pattern`` (``Launch.pattern``; None for a ``GPTModel``) and ``gpt``, the
    arguments of the ``GPTModel`` the model equals, which Megatron-LM's arithmetic counts
    (:func:`~tst_megatron.models.pattern.gpt_arguments`: ``args`` for a ``GPTModel``; None: a
    hybrid with other layers)."""
    return ModelReport(model_lines(args, pattern, gpt), checkpoint_bytes(args, gpt))


def model_lines(args, pattern: Optional[HybridPattern], gpt) -> list[str]:
    """The ``model:`` line (a ``HybridModel``'s layers by kind: :func:`_hybrid_lines`) and
    Megatron-LM's parameter and memory lines (:func:`parameter_lines`; of ``gpt``, as in
    :func:`model_report`), or one line saying why it could not count them."""
    if pattern is not None:
        return _hybrid_lines(args, pattern, gpt)
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
    lines = [
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, FFN "
        f"{args.ffn_hidden_size}{' (gated)' if args.swiglu else ''}, {attention}; {kind}{mtp}; "
        f"{args.normalization}, {args.position_embedding_type} positions, "
        f"{args.transformer_impl}, {args.params_dtype}"
    ]
    if variant:  # Megatron-LM's arithmetic counts every layer as standard attention
        counted = [
            f"parameters: not counted (Megatron-LM 0.19's arithmetic counts every layer as "
            f"standard attention; this model has {variant} layers)"
        ]
        return lines + counted
    return lines + parameter_lines(args)


def _variant_layers(args, variant: str) -> str:
    """Which layers are ``--experimental-attention-variant``'s: for gated delta net, those of
    ``--linear-attention-freq`` (megatron-core's ``get_linear_attention_pattern``: an int N
    keeps every N-th layer standard attention, a list marks each layer), else all."""
    if variant != "gated_delta_net" or args.linear_attention_freq is None:
        return f"{variant} attention in every layer"
    pattern = get_linear_attention_pattern(args)
    return f"gated delta net in {sum(pattern)} of {args.num_layers} layers (the rest standard)"


def _hybrid_lines(args, pattern: HybridPattern, gpt) -> list[str]:
    """A ``HybridModel``'s layers by family, its widths and experts, and its parameters:
    Megatron-LM 0.19's arithmetic (:func:`parameter_lines`) covers GPT models only, so a
    pattern :attr:`~tst_megatron.models.pattern.HybridPattern.counted_as_gpt` (``*-``/``*E``
    pairs, no MTP, pipeline segments of equal length) is counted as the ``GPTModel`` it
    equals (``gpt``: its arguments, :func:`~tst_megatron.models.pattern.gpt_arguments`), any
    other not at all."""
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
        for line in parameter_lines(gpt)
    ]


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


def checkpoint_bytes(args, gpt) -> Optional[float]:
    """One checkpoint's size in bytes, estimated from Megatron-LM's parameter count
    (``compute_weight_and_optimizer_memory`` of the whole model as one shard, 18 bytes per
    parameter without the distributed optimizer): the weights in their dtype (2 bytes in
    bf16/fp16, else 4) plus the fp32 main weights (mixed precision only) and Adam's two fp32
    moments; gradients are not saved (embeddings counted as :func:`parameter_lines` does; a
    GPT-shaped ``HybridModel`` as its ``GPTModel``, whose arguments ``gpt`` are, as in
    :func:`model_report`; ``args``: the run's, for its dtype). None when Megatron-LM's
    arithmetic cannot count the model (``gpt`` None: a hybrid's non-GPT layers; MLA + GQA,
    ...)."""
    # megatron.training (Megatron-LM) is heavy: imported once the line is known good
    from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory

    if gpt is None:  # Mamba, gated delta net layers
        return None
    whole = _countable(gpt)
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
