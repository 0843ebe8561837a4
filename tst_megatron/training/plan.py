"""``--dry-run``: what a launch would do, without starting processes, reading data or
building the model.

:func:`dry_run` validates the flags for ``WORLD_SIZE`` processes, then prints the resolved
layout, the model (with its parameter counts, computed analytically by
:func:`parameter_counts`) and the TST plan; or every problem found, one per line.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional

from tst_megatron.training.config import (
    RunConfig,
    moe_layer_pattern,
    problems,
    resolve,
)


@dataclasses.dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the whole model (all pipeline stages, before any sharding)."""

    total: int
    """Every parameter."""
    active: int
    """Parameters a token goes through: ``total`` less the ``E - topk`` unrouted experts of
    each MoE layer (embedding and output layer included)."""
    embedding: int
    """Input embedding + learned positions + output layer (0 if the vocabulary is unknown)."""


def parameter_counts(cfg: RunConfig, padded_vocab: Optional[int]) -> ParameterCounts:
    """Analytic parameter count of the megatron-core ``GPTModel`` that ``cfg`` builds.

    Per layer (megatron-core's ``TransformerLayer``; biases only without
    ``--disable-bias-linear``; a norm has ``h`` weights, ``2h`` for LayerNorm):
    attention ``linear_qkv`` ``h x (heads + 2 groups) d`` and ``linear_proj`` ``heads d x h``
    (``d`` = kv-channels), q/k norms of ``d`` with ``--qk-layernorm``, two norms; a dense MLP
    ``h x f (x2 with SwiGLU)`` + ``f x h``; an MoE layer a router ``E x h`` (+ ``E`` bias), ``E`` experts of
    that MLP shape with the expert width and the shared expert. Plus the embedding
    ``V x h``, learned positions ``max_pos x h``, the final norm and an untied output layer
    ``V x h``. ``cfg`` must be resolved (:func:`~tst_megatron.training.config.resolve`).

    Args:
        cfg: the resolved run configuration.
        padded_vocab: ``V`` after Megatron's padding; None = unknown (not counted).
    """
    m, moe = cfg.model, cfg.moe
    h, heads = m.hidden_size, m.num_attention_heads
    d = m.kv_channels or h // heads
    groups = m.num_query_groups if m.group_query_attention else heads
    bias = not m.disable_bias_linear
    norm = 2 * h if m.normalization == "LayerNorm" else h
    qk_norm = (2 * d if m.normalization == "LayerNorm" else d) if m.qk_layernorm else 0
    qkv_out = (heads + 2 * groups) * d
    attention = h * qkv_out + heads * d * h + (qkv_out + h if bias else 0) + 2 * qk_norm

    def mlp(width: int) -> int:
        up = width * (2 if m.swiglu else 1)
        return h * up + width * h + (up + h if bias else 0)

    dense = attention + 2 * norm + mlp(m.ffn_size())
    if moe.num_experts:
        expert = mlp(moe.moe_ffn_hidden_size or m.ffn_size())
        shared = (
            mlp(moe.moe_shared_expert_intermediate_size)
            if moe.moe_shared_expert_intermediate_size
            else 0
        )
        router = moe.num_experts * (h + 1 if bias else h)
        moe_layer = attention + 2 * norm + router + shared
        pattern = moe_layer_pattern(moe.moe_layer_freq, m.num_layers)
    else:
        expert, moe_layer, pattern = 0, 0, [0] * m.num_layers
    n_moe = sum(pattern)
    experts = moe.num_experts or 0
    layers = (m.num_layers - n_moe) * dense + n_moe * (moe_layer + experts * expert)
    embedding = 0
    if padded_vocab:
        embedding = padded_vocab * h * (1 if not m.untie_embeddings_and_output_weights else 2)
        if m.position_embedding_type == "learned_absolute":
            embedding += (m.max_position_embeddings or m.seq_length) * h
    total = layers + norm + embedding
    unrouted = n_moe * (experts - moe.moe_router_topk) * expert if n_moe else 0
    return ParameterCounts(total=total, active=total - unrouted, embedding=embedding)


def _padded_vocab(cfg: RunConfig) -> Optional[int]:
    from tst_megatron.training.model import padded_vocab_size

    if cfg.model.vocab_size is None:
        return None
    return padded_vocab_size(
        cfg.model.vocab_size,
        divisible_by=cfg.model.make_vocab_size_divisible_by,
        tp=cfg.parallel.tensor_model_parallel_size,
    )


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n:,} ({n / size:.2f}{unit})"
    return f"{n:,}"


def describe(cfg: RunConfig, world_size: int) -> list[str]:
    """The resolved run as lines of text (layout, model, TST plan). ``cfg`` is resolved."""
    m, moe, p, t, tst = cfg.model, cfg.moe, cfg.parallel, cfg.train, cfg.tst
    dp = p.data_parallel_size(world_size)
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    lines = [
        f"layout: world {world_size} = TP {p.tensor_model_parallel_size} x PP "
        f"{p.pipeline_model_parallel_size} x CP {p.context_parallel_size} x DP {dp}; "
        f"VPP {p.virtual_stages(m.num_layers) or 1}; EP {p.expert_model_parallel_size}, "
        f"expert-TP {etp}; sequence parallel {'on' if t.sequence_parallel else 'off'}",
        f"batch: micro-batch {t.micro_batch_size} x DP {dp} x {micro} micro-batches per step "
        f"= global batch {t.global_batch_size} samples of {m.seq_length} positions",
    ]
    groups = m.num_query_groups if m.group_query_attention else m.num_attention_heads
    kind = (
        f"MoE, {moe.num_experts} experts, top-{moe.moe_router_topk}" if moe.num_experts else "dense"
    )
    if moe.num_experts:
        n_moe = sum(moe_layer_pattern(moe.moe_layer_freq, m.num_layers))
        kind += f", {n_moe} of {m.num_layers} layers MoE"
    lines.append(
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, FFN {m.ffn_size()}, "
        f"{m.num_attention_heads} heads / {groups} query groups, {kind}; "
        f"{m.normalization}, {m.position_embedding_type} positions, "
        f"transformer impl {t.transformer_impl}"
    )
    vocab = _padded_vocab(cfg)
    counts = parameter_counts(cfg, vocab)
    note = (
        f" (padded vocabulary {vocab})"
        if vocab
        else " (embeddings not counted: the vocabulary comes from the tokenizer, not read here)"
    )
    lines.append(
        f"parameters: {_human(counts.total)} total, {_human(counts.active)} active per token{note}"
    )
    n1 = tst.phase1_steps(t.train_iters)
    tokens1 = n1 * t.global_batch_size * tst.windows_per_sample() * m.seq_length
    tokens2 = (t.train_iters - n1) * t.global_batch_size * m.seq_length
    given = f" (from --train-samples {t.train_samples})" if t.train_samples is not None else ""
    lines.append(
        f"TST: bag size {tst.bag_size}, mode {tst.mode}; phase 1 = iterations [0, {n1}), {tokens1:,} tokens; "
        f"phase 2 = [{n1}, {t.train_iters}), {tokens2:,} tokens; {t.train_iters} iterations"
        f"{given}"
    )
    return lines


def dry_run(cfg: RunConfig, env=None, *, out=None, err=None) -> int:
    """``--dry-run``: validate for ``WORLD_SIZE`` (default 1) processes and print the resolved
    run, or every problem (``error: ...``, one per line). Prints from rank 0 only.

    ``--device auto`` is checked as a CUDA run (a dry run usually runs on a login node
    without GPUs); ``--device cpu`` as a CPU run.

    Returns:
        0 if there is no problem, else 2.
    """
    env = os.environ if env is None else env
    out, err = out or sys.stdout, err or sys.stderr
    world_size = int(env.get("WORLD_SIZE", "1"))
    device_type = "cpu" if cfg.train.device == "cpu" else "cuda"
    rank0 = env.get("RANK", env.get("SLURM_PROCID", "0")) == "0"
    found = problems(cfg, world_size, device_type)
    if not rank0:
        return 2 if found else 0
    if found:
        for line in found:
            print(f"error: {line}", file=err, flush=True)
        print(f"dry run: {len(found)} problem(s) for world size {world_size}", file=err)
        return 2
    resolved = resolve(cfg, world_size, device_type)
    print(f"dry run: world size {world_size}, checked for a {device_type} run", file=out)
    for line in describe(resolved, world_size):
        print(" " + line, file=out)
    print("dry run: no problems found", file=out, flush=True)
    return 0


def flops_per_position(cfg: RunConfig) -> float:
    """Model FLOPs of one position (forward + backward) for ``--log-throughput``:
    ``6 N + 12 L h T`` with ``N`` the active parameters outside the input embedding and
    ``T`` the sequence length (the PaLM paper's estimate, appendix B; Megatron-LM's
    ``num_floating_point_operations`` differs in detail). ``cfg`` is resolved."""
    m = cfg.model
    counts = parameter_counts(cfg, None)  # without input embedding and output layer
    output = 0
    vocab = _padded_vocab(cfg)
    if vocab:
        output = vocab * m.hidden_size  # the output layer's matmul (tied or not)
    n = counts.active + output
    return 6.0 * n + 12.0 * m.num_layers * m.hidden_size * m.seq_length
