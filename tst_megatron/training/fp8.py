"""Shapes FP8 can run, checked before any work from the model's own ``TransformerConfig``.

Transformer Engine's FP8 GEMMs (cuBLASLt) need every dimension of both operands to be a
multiple of 16 (forward *and* backward: the token dimension becomes a leading dimension in
the weight-gradient GEMM), and MXFP8 quantises in blocks of 32 along each dimension. Source:
Transformer Engine's ``assert_dim_for_fp8_exec`` / ``check_dim_for_fp8_exec``
(``transformer_engine/pytorch/utils.py``) and its MXFP8 block size ``MXFP8_BLOCK_SCALING_SIZE``.
Transformer Engine asserts it inside the first forward step, after the model, the optimizer
and the data are set up; Megatron-LM's ``validate_args`` does not check it.

Every size is read from the megatron-core ``TransformerConfig`` that Megatron-LM builds for the
model (``core_transformer_config_from_args``, after ``validate_args`` derived the defaults), so
this file holds no derivation of its own: the FFN width with ``--swiglu``
(``int(4h * 2/3 / 64) * 64``), ``kv_channels`` (``h / heads``), the query groups (``heads``
without ``--group-query-attention``), the expert width and expert TP are Megatron-LM's.

The dimensions a rank gives its TE linear layers are:

- the tokens: ``T * b / CP`` per rank, divided by TP under sequence parallelism (SP keeps a
  ``[T/tp, b, h]`` slice between the layers). TST phase 1 feeds the model ``T`` latent
  positions of ``b`` samples, exactly as phase 2 feeds ``T`` tokens, so one check covers both
  phases;
- ``h``; the attention widths per TP rank, ``heads * kv_channels / TP`` and
  ``(heads + 2 * groups) * kv_channels / TP`` (not with multi-latent attention, whose
  projections are not checked here); the MLP width per TP rank ``ffn / TP`` (when some layers
  are dense); the expert width per expert-TP rank ``moe_ffn / ETP`` and the shared expert's
  per TP rank.

Tokens per expert are padded by megatron-core's grouped MLP itself (``Fp8Padding``), and the
output layer is not an FP8 GEMM, so neither is checked.
"""

from __future__ import annotations


def fp8_alignment(recipe) -> int:
    """The multiple every FP8 GEMM dimension must be: 32 for the ``mxfp8`` recipe, else 16.
    ``recipe``: ``TransformerConfig.fp8_recipe`` (a string or megatron-core's ``Fp8Recipe``)."""
    return 32 if str(getattr(recipe, "value", recipe)) == "mxfp8" else 16


def _dense_layers(config) -> bool:
    """Whether some decoder layer has a dense MLP (``moe_layer_freq``: an int ``k`` makes every
    ``k``-th layer MoE from the first; a list is the pattern; megatron-core's rule)."""
    if not config.num_moe_experts:
        return True
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return freq > 1 and config.num_layers > 1
    return 0 in list(freq)


def fp8_shape_problems(config, *, seq_length: int, micro_batch_size: int) -> list[str]:
    """With FP8 on (``--fp8-format``), every GEMM dimension of this layout that is not a
    multiple of :func:`fp8_alignment` (the module docstring lists them), one line each naming
    the dimension, its value and the flag to change. Reads only.

    Args:
        config: the model's megatron-core ``TransformerConfig`` (Megatron-LM's
            ``core_transformer_config_from_args``).
        seq_length: ``--seq-length`` (``T``, tokens per sample in phase 2 and latent positions
            in phase 1).
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
