"""Bag-averaged, vocab-parallel input embedding (``docs/design.md``, "Input superposition")."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)


def check_token_ids(ids: torch.Tensor, vocab_size: int, *, what: str = "token id") -> None:
    """Raise one clear error if any id lies outside ``[0, vocab_size)``.

    The check uses the *global* vocabulary size, so every TP size gives the same message.
    Costs one min/max reduction and one device-to-host copy of two numbers.

    Args:
        ids: integer tensor of any shape.
        vocab_size: the global (padded) vocabulary size ``V``.
        what: the noun used in the message.

    Raises:
        ValueError: ``ids`` is not an integer tensor or holds a value outside ``[0, V)``.
    """
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{what}s must be an integer tensor, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    low, high = (int(v) for v in torch.stack(torch.aminmax(ids)).tolist())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} {bad} is outside the vocabulary [0, {vocab_size})")


def run_forward_pre_hooks(module: torch.nn.Module, *args) -> None:
    """Run ``module``'s forward pre-hooks as calling it would, for code that reads its
    parameters without calling it. megatron-core's DDP (0.19) waits in these hooks for the
    parameters' all-gather under ``--overlap-param-gather`` (distributed optimizer); skipping
    them reads stale weights (found on CPU: phase 1's loss differed from iteration 2)."""
    for hook in tuple(module._forward_pre_hooks.values()):
        hook(module, args)


def bag_embedding(
    embedding: LanguageModelEmbedding,
    bags: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    *,
    check: bool = False,
) -> torch.Tensor:
    """Embed each bag as the mean of its ``S`` token embeddings, with megatron-core's weights.

    Computes ``e_j = (1/S) * sum_k E[bags[:, j, k]]`` (paper section 3) with
    ``embedding.word_embeddings.weight`` (the local vocab shard ``[V/tp, h]``), then does
    what :meth:`LanguageModelEmbedding.forward` does after its lookup, step for step in
    megatron-core 0.19: adds the learned absolute position
    embedding of the *latent* position, transposes to sequence-first, applies the MuP
    embedding multiplier (``config.use_mup``), fp32-residual casting, the sequence-parallel scatter and dropout (under the
    model-parallel RNG tracker when SP is on). With ``S = 1`` it equals
    ``LanguageModelEmbedding.forward`` (tested). Its output can be passed to
    ``GPTModel.forward(decoder_input=...)``.

    The mean is taken on each TP rank's partial lookup before the TP reduction, so the
    reduction carries ``[b, T, h]`` as a baseline step does (``docs/design.md``, "Input
    superposition"); ``torch.nn.functional.embedding_bag`` gathers and sums each bag in one
    op, with no ``[b, S*T, h]`` intermediate.

    Collectives: one all-reduce of ``[b, T, h]`` on the embedding's TP group (or one
    reduce-scatter to ``[T/tp, b, h]`` when ``embedding.reduce_scatter_embeddings``), plus
    the SP scatter that ``LanguageModelEmbedding`` itself does when position embeddings are
    learned. Nothing when TP = 1.

    Args:
        embedding: a megatron-core ``LanguageModelEmbedding`` (e.g. ``gpt_model.embedding``),
            without token-type embeddings.
        bags: ``[b, T, S]`` integer token ids (global ids in ``[0, V)``).
        position_ids: ``[b, T]`` latent positions for learned absolute position embeddings;
            defaults to ``0..T-1`` for every sample. Ignored for RoPE models.
        check: raise on ids outside ``[0, V)`` (one min/max and one device-to-host read,
            which stalls a GPU stream). Off by default: the launcher checks ids once where
            data enters, and an unchecked out-of-range id embeds as zeros at TP > 1 or
            fails inside the lookup at TP = 1.

    Returns:
        ``[T, b, h]`` (``[T/tp, b, h]`` under sequence parallelism) in the embedding weight's
        dtype (fp32 when ``config.fp32_residual_connection``). The bag sum is accumulated by
        ``embedding_bag`` (fp32 for fp32 weights; the fp32 accumulator of the CUDA kernel for
        bf16/fp16) and divided by ``S`` in fp32 before the cast back.

    Raises:
        ValueError: ``bags`` is not a 3-D integer tensor, or (with ``check``) holds an id
            outside ``[0, V)`` (same message at every TP size), or the embedding has
            token-type embeddings.
    """
    if bags.dim() != 3:
        raise ValueError(f"bags must be [b, T, S], got shape {tuple(bags.shape)}")
    if getattr(embedding, "tokentype_embeddings", None) is not None:
        raise ValueError("bag_embedding does not support token-type embeddings")
    if bags.dtype.is_floating_point or bags.dtype == torch.bool:
        raise ValueError(f"token ids must be an integer tensor, got dtype {bags.dtype}")
    word = embedding.word_embeddings
    if check:
        check_token_ids(bags, word.num_embeddings)
    b, latent_len, bag_size = bags.shape
    run_forward_pre_hooks(word, bags)  # the lookup reads word.weight without calling word
    weight = word.weight

    # Local masked lookup, exactly as VocabParallelEmbedding.forward does, summed per bag.
    tp_size = word.tp_group.size()  # megatron-core's TP mappings need the group, even of 1
    flat = bags.reshape(b * latent_len, bag_size)
    if tp_size > 1:
        outside = (flat < word.vocab_start_index) | (flat >= word.vocab_end_index)
        local_ids = torch.where(outside, 0, flat - word.vocab_start_index)
        keep = (~outside).to(weight.dtype)  # 0/1 weights are exact in every dtype
        summed = F.embedding_bag(local_ids, weight, mode="sum", per_sample_weights=keep)
    else:
        summed = F.embedding_bag(flat, weight, mode="sum")
    output_parallel = (summed.float() / bag_size).to(weight.dtype).view(b, latent_len, -1)

    # TP reduction of T positions (not S*T): see the docstring.
    if embedding.reduce_scatter_embeddings:
        # [b, T, h] -> [T, b, h] -> reduce-scatter -> [T/tp, b, h]
        output_parallel = output_parallel.transpose(0, 1).contiguous()
        embeddings = tensor_parallel.reduce_scatter_to_sequence_parallel_region(
            output_parallel, group=word.tp_group
        )
    else:
        embeddings = tensor_parallel.reduce_from_tensor_model_parallel_region(
            output_parallel, group=word.tp_group
        )

    # From here on: the tail of LanguageModelEmbedding.forward (megatron-core 0.19).
    if embedding.add_position_embedding:
        if position_ids is None:
            position_ids = torch.arange(latent_len, device=bags.device).unsqueeze(0).expand(b, -1)
        embeddings = embeddings + embedding.position_embeddings(position_ids)
    if not embedding.reduce_scatter_embeddings:
        embeddings = embeddings.transpose(0, 1).contiguous()  # [b, T, h] -> [T, b, h]
    config = embedding.config
    # MuP input multiplier
    if config.use_mup and config.mup_embedding_mult != 1.0:
        embeddings = embeddings * config.mup_embedding_mult
    if config.fp32_residual_connection:
        embeddings = embeddings.float()
    if config.sequence_parallel:
        if not embedding.reduce_scatter_embeddings and embedding.scatter_to_sequence_parallel:
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
                embeddings, group=embedding.tp_group
            )
        if config.clone_scatter_output_in_embedding and embedding.scatter_to_sequence_parallel:
            embeddings = embeddings.clone()
        with tensor_parallel.get_cuda_rng_tracker().fork():
            embeddings = embedding.embedding_dropout(embeddings)
    else:
        embeddings = embedding.embedding_dropout(embeddings)
    return embeddings
