"""FP8 GEMM shape rules, checked before any work from the model's ``TransformerConfig``.

Transformer Engine needs every FP8 GEMM dimension to be a multiple of 16, 32 with MXFP8
(``assert_dim_for_fp8_exec`` and ``MXFP8_BLOCK_SCALING_SIZE`` in
``transformer_engine/pytorch/utils.py``), and asserts it only in the first forward step.
Checked: tokens per rank, ``h``, the attention, QKV, FFN, expert and shared-expert widths
per (expert-)TP rank. Not checked: multi-latent attention, tokens per expert (``Fp8Padding``)
and the output layer (not FP8).
"""

from __future__ import annotations

from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
    get_moe_layer_pattern,
)


def fp8_alignment(recipe) -> int:
    """32 for the ``mxfp8`` ``recipe`` (string or ``Fp8Recipe``), else 16."""
    return 32 if str(getattr(recipe, "value", recipe)) == "mxfp8" else 16


def _dense_layers(config) -> bool:
    """Whether some decoder layer has a dense MLP (megatron-core's ``get_moe_layer_pattern``)."""
    if not config.num_moe_experts:
        return True
    freq = config.moe_layer_freq
    if isinstance(freq, list) and len(freq) != config.num_layers:
        return 0 in freq  # megatron-core would assert; the length is model_problems' line
    return 0 in get_moe_layer_pattern(config)


def fp8_shape_problems(config, *, seq_length: int, micro_batch_size: int) -> list[str]:
    """With FP8 on, each GEMM dimension that is not a multiple of :func:`fp8_alignment`, one
    line each naming the dimension, its value and the flag to change. Tokens per rank are
    ``T * b / CP`` (``/ TP`` more with sequence parallelism), the same in both TST phases.

    Args:
        config: the model's megatron-core ``TransformerConfig`` (Megatron-LM's
            ``core_transformer_config_from_args``).
        seq_length: ``--seq-length`` (``T``).
        micro_batch_size: ``--micro-batch-size``.

    Returns:
        The problems, tokens per rank first, then the widths; empty without FP8 or when none.
    """
    if not config.fp8:
        return []
    align = fp8_alignment(config.fp8_recipe)
    why = f"with --fp8-format{' and --fp8-recipe mxfp8' if align == 32 else ''}"
    tp, cp = config.tensor_model_parallel_size, config.context_parallel_size
    tokens, split = seq_length * micro_batch_size // cp, "--context-parallel-size"
    if config.sequence_parallel:
        tokens, split = tokens // tp, "--tensor-model-parallel-size x --context-parallel-size"
    problems = []
    if tokens % align:
        problems.append(
            f"{why}, the tokens per rank, --seq-length x --micro-batch-size / ({split}) = "
            f"{tokens} (in both TST phases), must be a multiple of {align}; change --seq-length "
            "or --micro-batch-size"
        )
    h, heads, kv = config.hidden_size, config.num_attention_heads, config.kv_channels
    widths = [("--hidden-size", h, "--hidden-size")]
    if not config.multi_latent_attention:
        groups = config.num_query_groups or heads
        widths += [
            ("the attention width per TP rank", heads * kv // tp, "--kv-channels"),
            (
                "the query-key-value width per TP rank",
                (heads + 2 * groups) * kv // tp,
                "--kv-channels or --num-query-groups",
            ),
        ]
    if _dense_layers(config):
        widths.append(
            ("the FFN width per TP rank", config.ffn_hidden_size // tp, "--ffn-hidden-size")
        )
    if config.num_moe_experts:
        etp = config.expert_tensor_parallel_size or tp
        widths.append(
            (
                "--moe-ffn-hidden-size per expert-TP rank",
                config.moe_ffn_hidden_size // etp,
                "--moe-ffn-hidden-size",
            )
        )
        shared = config.moe_shared_expert_intermediate_size
        if shared:
            widths.append(
                (
                    "--moe-shared-expert-intermediate-size per TP rank",
                    shared // tp,
                    "--moe-shared-expert-intermediate-size",
                )
            )
    for name, value, fix in widths:
        if value % align:
            problems.append(f"{why}, {name} ({value}) must be a multiple of {align}; change {fix}")
    return problems


def problems(launch) -> list[str]:
    """With ``--fp8-format``, the GEMM shapes Transformer Engine would refuse in the first step
    (:func:`fp8_shape_problems` of the model's ``TransformerConfig``, which FP8 needs)."""
    args = launch.args
    if not getattr(args, "fp8", None):
        return []
    return fp8_shape_problems(
        launch.config, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size
    )
