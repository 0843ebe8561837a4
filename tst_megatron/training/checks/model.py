"""Model rules: settings megatron-core 0.19 refuses only while building the model, and the
model class this launcher builds (a ``GPTModel``: ``pretrain_hybrid.py``'s flags are refused)."""

from __future__ import annotations

from typing import Sequence

#: Megatron-LM's flags of ``pretrain_hybrid.py``'s ``HybridModel`` (layer pattern, Mamba mixer):
#: this launcher builds a ``GPTModel``, which reads none of them. Exact flags, and a prefix.
HYBRID_FLAGS = (
    "--hybrid-layer-pattern",
    "--hybrid-override-pattern",
    "--mtp-hybrid-override-pattern",
    "--is-hybrid-model",
    "--disable-mamba-mem-eff-path",
)
HYBRID_FLAG_PREFIX = "--mamba-"


def hybrid_flag_problems(flags: Sequence[str]) -> list[str]:
    """The ``HybridModel`` flags among ``flags`` (the command line's ``--`` words, without
    ``=value``), as one line: :data:`HYBRID_FLAGS` and ``--mamba-*``. A ``GPTModel`` would
    silently ignore them (Megatron-LM's parser accepts them for every model; its
    ``validate_args`` even resets ``--num-layers`` from a pattern)."""
    hybrid = [f for f in flags if f in HYBRID_FLAGS or f.startswith(HYBRID_FLAG_PREFIX)]
    if not hybrid:
        return []
    return [
        f"{', '.join(dict.fromkeys(hybrid))}: a HybridModel flag (pretrain_hybrid.py's); "
        "this launcher builds pretrain_gpt.py's GPTModel, which would ignore it; drop it "
        "(HybridModel runs are not supported by this launcher)"
    ]


def model_problems(args) -> list[str]:
    """Model settings megatron-core 0.19 refuses only while building the model: heads not
    divisible by ``--num-query-groups``, a shared expert with biases, a ``--moe-layer-freq``
    pattern whose length is not ``--num-layers``, ``--moe-router-topk`` above
    ``--num-experts``."""
    problems = []
    if args.group_query_attention and args.num_attention_heads % args.num_query_groups:
        problems.append(
            f"--num-attention-heads {args.num_attention_heads} is not divisible by "
            f"--num-query-groups {args.num_query_groups}"
        )
    if args.moe_shared_expert_intermediate_size and args.add_bias_linear:
        problems.append(
            "--moe-shared-expert-intermediate-size: megatron-core's shared experts have no "
            "biases; add --disable-bias-linear"
        )
    experts = args.num_experts or 0
    freq = args.moe_layer_freq
    if experts and isinstance(freq, list) and len(freq) != args.num_layers:
        problems.append(
            f"--moe-layer-freq gives a pattern of {len(freq)} layers for --num-layers "
            f"{args.num_layers}: give one 0/1 entry per layer"
        )
    if experts and args.moe_router_topk > experts:
        problems.append(
            f"--moe-router-topk {args.moe_router_topk} is more than --num-experts {experts}"
        )
    return problems


def problems(launch) -> list[str]:
    """The model rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return model_problems(launch.args)


def notes(launch) -> list[str]:
    """That megatron-core 0.19's ``global_aux_loss`` counts tokens over DP and micro-batches
    (its value depends on the layout)."""
    args = launch.args
    kinds = args.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if not (args.num_experts and "global_aux_loss" in kinds):
        return []
    return [
        "--moe-router-load-balancing-type global_aux_loss: megatron-core counts the tokens "
        "per expert over the data-parallel ranks and micro-batches of a step, so its value "
        "and gradient change with DP and --micro-batch-size (the same run under another "
        "layout trains differently; aux_loss does not). TST keeps its meaning: a phase-1 "
        "bag counts as one token"
    ]
