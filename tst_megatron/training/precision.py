"""Shapes that FP8 can run, checked before any work.

Transformer Engine's FP8 GEMMs (cuBLASLt) need every dimension of both operands to be a
multiple of 16 (forward *and* backward: the token dimension becomes a leading dimension in the
weight-gradient GEMM), and MXFP8 quantises in blocks of 32 along each dimension. Source:
Transformer Engine's ``assert_dim_for_fp8_exec`` / ``check_dim_for_fp8_exec``
(``transformer_engine/pytorch/utils.py``) and its MXFP8 block size ``MXFP8_BLOCK_SCALING_SIZE``.

The dimensions a rank gives its TE linear layers are:
- the tokens: ``T * b / CP`` per rank, divided by TP under sequence parallelism (SP keeps a
  ``[T/tp, b, h]`` slice between the layers). TST phase 1 feeds the model ``T`` latent
  positions of ``b`` samples, exactly as phase 2 feeds ``T`` tokens, so one check covers both
  phases;
- ``h`` (``--hidden-size``); the attention widths per TP rank,
  ``heads * kv_channels / TP`` and ``(heads + 2 * groups) * kv_channels / TP``; the MLP width
  per TP rank ``ffn / TP`` (when some layers are dense); the expert width per expert-TP rank
  ``moe_ffn / ETP`` and the shared expert's per TP rank.
Tokens per expert are padded by megatron-core's grouped MLP itself (``Fp8Padding``), and the
output layer is not an FP8 GEMM, so neither is checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def fp8_alignment(recipe: str) -> int:
    """The multiple every FP8 GEMM dimension must be: 32 for ``mxfp8``, else 16."""
    return 32 if recipe == "mxfp8" else 16


def _field(cfg, name: str) -> Any:
    """Field ``name`` of whichever group of ``cfg`` (a ``RunConfig``) holds it."""
    for group in dataclasses.fields(cfg):
        value = getattr(cfg, group.name)
        if dataclasses.is_dataclass(value) and name in {f.name for f in dataclasses.fields(value)}:
            return getattr(value, name)
    raise KeyError(name)


def fp8_shape_problems(cfg) -> list[str]:
    """With ``--fp8-format`` set, every GEMM dimension of this layout that is not a multiple
    of :func:`fp8_alignment` (the module docstring lists them), one line each naming the
    dimension, its value and the flag to change. Reads only; empty without FP8.

    Args:
        cfg: the run's ``RunConfig`` (Megatron-LM field names).

    Returns:
        The problems, in the order: tokens per rank, then the widths; empty when none.
    """
    if not _field(cfg, "fp8_format"):
        return []
    recipe = _field(cfg, "fp8_recipe")
    align = fp8_alignment(recipe)
    why = f"with --fp8-format{' and --fp8-recipe mxfp8' if align == 32 else ''}"
    problems = []
    T, b = _field(cfg, "seq_length"), _field(cfg, "micro_batch_size")
    tp, cp = _field(cfg, "tensor_model_parallel_size"), _field(cfg, "context_parallel_size")
    sp = _field(cfg, "sequence_parallel")
    tokens, split = T * b // cp, "--context-parallel-size"
    if sp:
        tokens, split = tokens // tp, "--tensor-model-parallel-size x --context-parallel-size"
    if tokens % align:
        problems.append(
            f"{why}, the tokens per rank, --seq-length x --micro-batch-size / ({split}) = "
            f"{tokens} (in both TST phases), must be a multiple of {align}; change --seq-length "
            "or --micro-batch-size"
        )
    h, heads = _field(cfg, "hidden_size"), _field(cfg, "num_attention_heads")
    kv = _field(cfg, "kv_channels") or h // heads
    groups = _field(cfg, "num_query_groups") if _field(cfg, "group_query_attention") else heads
    ffn = _field(cfg, "ffn_hidden_size") or 4 * h
    etp = _field(cfg, "expert_tensor_parallel_size") or tp
    widths = [
        ("--hidden-size", h, "--hidden-size"),
        ("the attention width per TP rank", heads * kv // tp, "--kv-channels"),
        (
            "the query-key-value width per TP rank",
            (heads + 2 * groups) * kv // tp,
            "--kv-channels or --num-query-groups",
        ),
    ]
    experts = _field(cfg, "num_experts")
    if not experts or _field(cfg, "moe_layer_freq") != 1:  # some layers are dense
        widths.append(("--ffn-hidden-size per TP rank", ffn // tp, "--ffn-hidden-size"))
    if experts:
        moe_ffn = _field(cfg, "moe_ffn_hidden_size") or ffn
        widths.append(
            ("--moe-ffn-hidden-size per expert-TP rank", moe_ffn // etp, "--moe-ffn-hidden-size")
        )
        shared = _field(cfg, "moe_shared_expert_intermediate_size")
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
