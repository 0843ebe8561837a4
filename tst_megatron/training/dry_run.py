"""``--dry-run``: the launch's own checks (:func:`tst_megatron.training.validate.check`, run
with ``dry_run=True``) plus a report of what the launch line would do at ``WORLD_SIZE=N``:
the layout, the batch, the model and its parameter counts (:func:`parameter_counts`,
arithmetic) and the TST plan; or every problem found, one ``error: ...`` line each. Exit
status 0 or 2. Nothing is started: no process group, no model, no data, no GPU (a launch
line for CUDA is checked as for an H100 with Transformer Engine when this machine has
neither: :mod:`tst_megatron.training.assumed`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Sequence

from tst_megatron.training.flags import tst_config
from tst_megatron.training.plan import _batch_calculator, schedule, switch_sample

# --- parameter counts ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the whole model (all pipeline stages, before any sharding; a tied
    output layer counted once)."""

    total: int
    """Every parameter."""
    active: int
    """Parameters a token goes through: ``total`` less the ``E - topk`` unrouted experts of
    each MoE layer (MTP layers included)."""
    embedding: int
    """Input embedding + learned positions + untied output layer (0: vocabulary unknown)."""
    mtp: int
    """The multi-token-prediction layers (``--mtp-num-layers``; 0 without)."""


def _norm(args, size: int) -> int:
    """Parameters of one norm over ``size`` features: LayerNorm weight + bias, RMSNorm weight."""
    return (2 if args.normalization == "LayerNorm" else 1) * size


def _attention(args) -> int:
    """One self-attention block with its input norm (megatron-core ``SelfAttention`` or
    ``MLASelfAttention``, local and Transformer Engine specs alike)."""
    h, heads = args.hidden_size, args.num_attention_heads
    bias = args.add_bias_linear
    sinks = heads if getattr(args, "softmax_type", "vanilla") == "learnable" else 0
    if args.multi_latent_attention:
        # MLASelfAttention.__init__: q (direct or down/up through q_lora_rank), kv down to
        # kv_lora_rank + rope dims, kv up to heads * (qk + v), norms on the low ranks with
        # --qk-layernorm (the local spec; TE fuses them into the up projections), no biases
        # except linear_proj's.
        q_head = args.qk_head_dim + args.qk_pos_emb_head_dim
        if args.q_lora_rank is None:
            q = h * heads * q_head
        else:
            q = h * args.q_lora_rank + args.q_lora_rank * heads * q_head
            q += _norm(args, args.q_lora_rank) if args.qk_layernorm else 0
        kv = h * (args.kv_lora_rank + args.qk_pos_emb_head_dim)
        kv += args.kv_lora_rank * heads * (args.qk_head_dim + args.v_head_dim)
        kv += _norm(args, args.kv_lora_rank) if args.qk_layernorm else 0
        proj = heads * args.v_head_dim * h + (h if bias else 0)
        return _norm(args, h) + q + kv + proj + sinks
    d = args.kv_channels
    groups = args.num_query_groups if args.group_query_attention else heads
    qkv_out = (heads + 2 * groups) * d
    qkv = h * qkv_out + (qkv_out if args.add_qkv_bias else 0)
    proj = heads * d * h + (h if bias else 0)
    qk_norm = 2 * _norm(args, d) if args.qk_layernorm else 0
    return _norm(args, h) + qkv + proj + qk_norm + sinks


def _mlp(args, width: int, hidden: Optional[int] = None) -> int:
    """One megatron-core ``MLP`` (fc1 ``h x f``, doubled when gated: ``--swiglu`` or
    ``--quick-geglu``; fc2 ``f x h``; biases with ``--add-bias-linear``)."""
    h = args.hidden_size if hidden is None else hidden
    gated = bool(args.swiglu or getattr(args, "quick_geglu", False))
    up = width * (2 if gated else 1)
    return h * up + width * h + ((up + h) if args.add_bias_linear else 0)


def moe_layer_pattern(args) -> list[int]:
    """1 for each MoE layer of ``--num-layers`` (``--moe-layer-freq``: an int ``k`` makes every
    ``k``-th layer from the first MoE; a list is the pattern itself), all 0 without experts.
    Megatron-LM's ``TransformerConfig.moe_layer_freq`` rule."""
    if not args.num_experts:
        return [0] * args.num_layers
    freq = args.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(args.num_layers)]
    return [int(x) for x in freq]


def parameter_counts(args, padded_vocab: Optional[int]) -> ParameterCounts:
    """Parameter counts of the ``GPTModel`` that validated Megatron-LM arguments ``args`` build,
    by arithmetic (no model is built): megatron-core 0.19's module shapes.

    Per layer: the input norm and attention (:func:`_attention`: GQA/MHA ``linear_qkv`` and
    ``linear_proj``, q/k norms with ``--qk-layernorm``, one learnable softmax offset per head
    with ``--softmax-type learnable``; or MLA's projections), the pre-MLP norm, and either a
    dense MLP of ``--ffn-hidden-size`` or an MoE layer: router ``E x h`` (+ ``E`` biases),
    ``E`` experts of ``--moe-ffn-hidden-size``, the shared expert
    (``--moe-shared-expert-intermediate-size``, its gate with ``--moe-shared-expert-gate``),
    latent projections ``2 h x latent`` (``--moe-latent-size``). Plus the final norm, the
    embedding ``V x h`` (+ learned positions), an untied output layer ``V x h``, and per MTP
    layer two norms, ``eh_proj`` ``2h x h``, a transformer layer like the last decoder
    layer and a final norm (``MultiTokenPredictionLayer``; embedding and output shared).
    Megatron-LM's ``compute_weight_and_optimizer_memory`` (theoretical_memory_usage.py) is
    the same sum without biases, q/k norms, sinks and the MTP layer's own weights.

    Args:
        args: validated Megatron-LM arguments (``validate_args`` has filled ``kv_channels``,
            ``ffn_hidden_size``, ``moe_ffn_hidden_size``, ``add_qkv_bias``).
        padded_vocab: ``V`` after Megatron-LM's padding; None = unknown (embedding not counted).

    Raises:
        NotImplementedError: a model this count does not cover (hybrid/heterogeneous models,
            experimental attention variants), naming it.
    """
    for flag, on in (
        (
            "--heterogeneous-layers-config-path",
            getattr(args, "heterogeneous_layers_config_path", None),
        ),
        ("--hybrid-override-pattern", getattr(args, "hybrid_override_pattern", None)),
        ("--experimental-attention-variant", getattr(args, "experimental_attention_variant", None)),
    ):
        if on:
            raise NotImplementedError(f"not counted for {flag}")
    h = args.hidden_size
    attention = _attention(args)
    norm = _norm(args, h)
    dense = attention + norm + _mlp(args, args.ffn_hidden_size)
    experts = args.num_experts or 0
    if experts:
        latent = getattr(args, "moe_latent_size", None)
        expert = _mlp(args, args.moe_ffn_hidden_size, hidden=latent or h)
        shared_width = args.moe_shared_expert_intermediate_size
        shared = _mlp(args, shared_width) if shared_width else 0
        if shared_width and getattr(args, "moe_shared_expert_gate", False):
            shared += h
        router = experts * h + (experts if args.add_bias_linear else 0)
        moe_rest = attention + norm + router + shared + (2 * h * latent if latent else 0)
        unrouted = (experts - args.moe_router_topk) * expert
    else:
        expert = moe_rest = unrouted = 0
    pattern = moe_layer_pattern(args)
    n_moe = sum(pattern)
    moe_layer = moe_rest + experts * expert
    layers = (args.num_layers - n_moe) * dense + n_moe * moe_layer + norm
    mtp_layers = getattr(args, "mtp_num_layers", None) or 0
    mtp_is_moe = bool(pattern[-1]) if pattern else False
    mtp = mtp_layers * (3 * norm + 2 * h * h + (moe_layer if mtp_is_moe else dense))
    embedding = 0
    if padded_vocab:
        tied = not args.untie_embeddings_and_output_weights
        embedding = padded_vocab * h * (1 if tied else 2)
        if args.position_embedding_type == "learned_absolute":
            embedding += args.max_position_embeddings * h
    total = layers + mtp + embedding
    active = total - (n_moe + (mtp_layers if mtp_is_moe else 0)) * unrouted
    return ParameterCounts(total=total, active=active, embedding=embedding, mtp=mtp)


def padded_vocab_size(args) -> Optional[int]:
    """``V`` as Megatron-LM pads it (``vocab_utils.calculate_padded_vocab_size``: a multiple of
    ``--make-vocab-size-divisible-by x TP``), when the launch line gives it without a
    tokenizer file (``--tokenizer-type NullTokenizer --vocab-size V``); None otherwise (a
    dry run reads no tokenizer)."""
    if args.tokenizer_type != "NullTokenizer" or not args.vocab_size:
        return None
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    return calculate_padded_vocab_size(
        args.vocab_size,
        args.make_vocab_size_divisible_by,
        args.tensor_model_parallel_size,
        logging_enabled=False,
    )


# --- the dry run ---------------------------------------------------------------------------


def _human(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f}{unit})"
    return f"{n:,}"


def _batch_lines(args, dp: int) -> list[str]:
    """The batch, or the batch-size schedule step by step (Megatron-LM's calculator)."""

    per_micro = args.micro_batch_size * dp
    calculator = _batch_calculator(args)
    if calculator is None:
        line = (
            f"batch: global batch {args.global_batch_size} = micro-batch "
            f"{args.micro_batch_size} x DP {dp} x {args.global_batch_size // per_micro} "
            f"micro-batches per step; samples of --seq-length {args.seq_length}"
        )
        if getattr(args, "rampup_batch_size", None):
            line += " (--rampup-batch-size is deprecated and ignored by Megatron-LM 0.19)"
        return [line]
    steps = ", ".join(
        f"from sample {threshold:,}: {batch} ({batch // per_micro} micro-batches)"
        for threshold, batch in calculator.schedule
    )
    return [
        f"batch: --step-batch-size-schedule, micro-batch {args.micro_batch_size} x DP {dp}; "
        f"global batch {steps}; samples of --seq-length {args.seq_length}"
    ]


def describe(args) -> list[str]:
    """The run as lines of text (layout, batch, model, parameters, TST plan) from validated
    Megatron-LM arguments with the launcher's ``--tst-*`` flags.

    The arguments have passed :func:`~tst_megatron.training.validate.check` (the batch-size
    schedule calculator included).
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
    lines += _batch_lines(args, dp)
    pattern = moe_layer_pattern(args)
    if args.num_experts:
        kind = (
            f"MoE {sum(pattern)} of {args.num_layers} layers: {args.num_experts} experts of "
            f"{args.moe_ffn_hidden_size}, top-{args.moe_router_topk}"
        )
        if args.moe_shared_expert_intermediate_size:
            kind += f", shared expert {args.moe_shared_expert_intermediate_size}"
    else:
        kind = "dense"
    if args.multi_latent_attention:
        attention = (
            f"MLA, {args.num_attention_heads} heads (q rank {args.q_lora_rank}, kv rank "
            f"{args.kv_lora_rank})"
        )
    else:
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        attention = (
            f"{args.num_attention_heads} heads / {groups} query groups of {args.kv_channels}"
        )
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
    vocab = padded_vocab_size(args)
    try:
        counts = parameter_counts(args, vocab)
    except NotImplementedError as exc:
        lines.append(f"parameters: {exc}")
    else:
        note = (
            f" (padded vocabulary {vocab})"
            if vocab
            else " (embeddings not counted: the vocabulary comes from the tokenizer, "
            "which a dry run does not read)"
        )
        mtp_note = f", of which MTP {_human(counts.mtp)}" if counts.mtp else ""
        lines.append(
            f"parameters: {_human(counts.total)} total, {_human(counts.active)} active per "
            f"token{mtp_note}{note}"
        )
    tst, plan = tst_config(args), schedule(args)
    n1, n = plan.n1, plan.train_iters
    given = f" (from --train-samples {args.train_samples:,})" if args.train_samples else ""
    if n1 == 0:
        lines.append(
            f"TST: no phase 1 (bag size {tst.bag_size}): next-token training for {n:,} "
            f"iterations{given}, samples of {plan.phase2.data_seq_length} + 1 tokens"
        )
        return lines
    lines.append(
        f"TST: bag size {tst.bag_size}, mode {tst.mode}, weighting {tst.bag_weighting}; "
        f"N1 = {n1:,} of {n:,} iterations{given}; switch at sample {switch_sample(args):,}; "
        f"phase 1: samples of {plan.phase1.data_seq_length} + 1 tokens, {plan.phase1.model_seq_length} "
        f"positions; phase 2: samples of {plan.phase2.data_seq_length} + 1 tokens"
    )
    return lines


def dry_run(argv: Sequence[str], *, out=None, err=None) -> int:
    """``--dry-run``: :func:`~tst_megatron.training.validate.check` ``argv`` for
    ``WORLD_SIZE`` processes (default 1) as the launch does, and print the run (stdout) or
    every problem (``error: ...`` lines on stderr). Prints from rank 0 only (``RANK``, else
    ``SLURM_PROCID``, default 0).

    Returns:
        0 when no problem was found, else 2.
    """
    from tst_megatron.training.validate import check

    out, err = out or sys.stdout, err or sys.stderr
    checked = check(argv, dry_run=True)
    rank0 = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    problems, notes = list(checked.problems), checked.notes
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not problems:
        lines = describe(checked.args)
    if not rank0:
        return 2 if problems else 0
    if problems:
        for line in problems:
            print(f"error: {line}", file=err, flush=True)
        for line in notes:
            print(f" note: {line}", file=err)
        print(f"dry run: {len(problems)} problem(s) for world size {world}", file=err, flush=True)
        return 2
    device = "CPU" if checked.device == "cpu" else "CUDA"
    print(f"dry run: world size {world}, checked as a {device} run", file=out)
    for line in notes:
        print(f" note: {line}", file=out)
    for line in lines:
        print(f" {line}", file=out)
    print("dry run: no problems found", file=out, flush=True)
    return 0
