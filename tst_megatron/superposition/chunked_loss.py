"""The output layer and the (multi-target) vocab-parallel cross-entropy in one function, over
chunks of the positions, so that no full ``[T, b, V/tp]`` logits tensor exists, in forward or
in backward.

Per chunk of ``t`` positions the logits are ``hidden[t] @ W^T`` (the output layer's matmul),
scored as :func:`~tst_megatron.superposition.cross_entropy.vocab_parallel_multi_target_cross_entropy`
scores them (one max and one sum across the TP group), and dropped. Backward computes each
chunk's logits again from the saved hidden states and weight and the saved per-position
log-sum-exp: ``dL/dz = softmax(z) * sum_k g_k - sum_k g_k onehot(t_k)`` with
``softmax(z) = exp(z - lse)``, then ``dL/dh = dL/dz @ W`` and ``dL/dW += dL/dz^T @ h``.

Why recompute rather than compute the gradients in forward: the upstream gradient of each
position's CE (its loss mask, the bag weights, the micro-batch and token normalisation, the
fp16 loss scale) reaches the model only in backward, as megatron-core's loss contract has it;
gradients computed in forward would have to assume it. Recomputing costs one more matmul of the
head (3 -> 4: ``docs/results/chunked_loss.md`` measures what that costs).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tst_megatron.superposition.cross_entropy import _group_size_rank, _local_target_logits


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` contiguous ``(start, end)`` ranges covering ``[0, length)``, the first ones
    one longer when ``chunks`` does not divide ``length`` (empty ranges are dropped).

    Raises:
        ValueError: ``chunks < 1``.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    size, extra = divmod(length, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            bounds.append((start, end))
        start = end
    return bounds


# --- named math steps ------------------------------------------------------------------


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    """The softmax's dtype: fp32 for bf16/fp16/fp32 logits (as megatron-core's CE), fp64 for
    fp64."""
    return torch.promote_types(dtype, torch.float32)


def _widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in :func:`_accumulation`'s dtype: a copy for bf16/fp16, else the tensor
    itself (a fresh matmul output nothing else reads, so it may be overwritten)."""
    wide = _accumulation(logits.dtype)
    return logits if logits.dtype == wide else logits.to(wide)


def _chunk_forward(hidden, weight, targets, tp_group, vocab_start, predictions=None):
    """One chunk's per-slot CE ``[t, b, k]`` and log-sum-exp ``[t, b, 1]`` (fp32): the
    logits ``[t, b, V/tp]`` and their fp32 shifted copy live only inside this call.
    Collectives: all-reduce MAX of ``[t, b]``, all-reduce SUM of ``[t, b, k+1]``; with
    ``predictions`` (``[t, b]`` int64, written) one all-reduce MIN of ``[t, b]`` more."""
    logits = hidden @ weight.t()  # [t, b, V/tp] in the activations' dtype, as the output layer
    if predictions is None:
        global_max = logits.amax(dim=-1).to(_accumulation(logits.dtype))
    else:
        local_max, local_argmax = logits.max(dim=-1)
        global_max = local_max.to(_accumulation(logits.dtype), copy=True)  # local_max stays
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    if predictions is not None:
        _global_argmax(predictions, local_max, local_argmax, global_max, tp_group, vocab_start)
    shifted = _widened(logits).sub_(global_max.unsqueeze(-1))
    del logits
    target_logits, _, _ = _local_target_logits(
        shifted, targets, vocab_start, vocab_start + shifted.shape[-1]
    )
    reduced = torch.cat([target_logits, shifted.exp_().sum(dim=-1, keepdim=True)], dim=-1)
    del shifted
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=tp_group)
    log_sum_exp = torch.log(reduced[..., -1:])
    return log_sum_exp - reduced[..., :-1], log_sum_exp + global_max.unsqueeze(-1)


def _global_argmax(out, local_max, local_argmax, global_max, tp_group, vocab_start):
    """Write into ``out`` ``[t, b]`` the first global vocabulary id of each position's largest
    logit (``torch.argmax`` of the gathered logits; megatron-core's ``_vocab_parallel_argmax``
    picks the same id): the smallest ``vocab_start + local argmax`` over the ranks whose
    shard holds the maximum (all-reduce MIN)."""
    none = torch.iinfo(torch.int64).max
    holds_max = local_max.to(global_max.dtype) == global_max
    ids = torch.where(holds_max, local_argmax + vocab_start, none)
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=tp_group)
    out.copy_(ids)


def _chunk_grad_logits(hidden, weight, targets, lse, grad_loss, vocab_start):
    """``dL/dz`` ``[t, b, V/tp]`` of one chunk in the activations' dtype, from its logits
    computed again: ``exp(z - lse) * sum_k g_k - sum_k g_k onehot(t_k)``; a position whose
    upstream gradients are all 0 (masked) gets exactly 0, even with non-finite logits."""
    grad = _widened(hidden @ weight.t()).sub_(lse).exp_()
    grad_loss = grad_loss.to(grad.dtype)
    grad_sum = grad_loss.sum(dim=-1, keepdim=True)
    grad.mul_(grad_sum).masked_fill_(grad_sum == 0, 0.0)
    _, local_targets, in_shard = _local_target_logits(
        grad, targets, vocab_start, vocab_start + grad.shape[-1]
    )
    grad.scatter_add_(-1, local_targets, -torch.where(in_shard, grad_loss, 0.0))
    return grad.to(hidden.dtype)


#: Vocabulary rows of one weight-gradient product (bounds its temporary to 1/8 of the weight).
WEIGHT_GRAD_BLOCKS = 8


def _add_weight_grad(target: torch.Tensor, grad_logits: torch.Tensor, hidden: torch.Tensor):
    """``target[V/tp, h] += grad_logits^T @ hidden`` over blocks of vocabulary rows: the product
    of one block (at most 1/:data:`WEIGHT_GRAD_BLOCKS` of the weight, in the activations'
    dtype) is the only temporary, so an fp32 ``main_grad`` target needs no weight-sized copy."""
    vocab, h = grad_logits.shape[-1], hidden.shape[-1]
    rows = grad_logits.reshape(-1, vocab)
    flat = hidden.reshape(-1, h)
    if target.dtype == grad_logits.dtype:
        target.addmm_(rows.t(), flat)
        return
    for start, end in chunk_bounds(vocab, WEIGHT_GRAD_BLOCKS):
        target[start:end].add_(rows[:, start:end].t() @ flat)


def _placeholder(weight: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient of ``weight``'s shape and dtype, as megatron-core's
    ``ColumnParallelLinear`` returns when it wrote ``main_grad`` itself (without TE): a fresh
    tensor, which autograd takes as ``weight.grad`` without a copy and DDP's hook drops."""
    return torch.empty_like(weight)


class _ChunkedOutputCrossEntropy(torch.autograd.Function):
    """Output layer + per-slot vocab-parallel CE over chunks of positions.

    Collectives on ``tp_group``: forward, with sequence parallelism, one all-gather of the
    hidden states ``[T/tp, b, h] -> [T, b, h]`` (as ``ColumnParallelLinear``), then per chunk
    an all-reduce MAX ``[t, b]`` and an all-reduce SUM ``[t, b, k+1]`` (megatron-core's CE
    makes the same two, once, over ``[T, b]``); backward, one all-reduce of ``dL/dh``
    ``[T, b, h]`` (a reduce-scatter to ``[T/tp, b, h]`` with sequence parallelism), as
    ``ColumnParallelLinear``'s backward. Saved for backward: the (gathered) hidden states, the
    weight (a reference), the targets ``[T, b, k]`` and the log-sum-exp ``[T, b, 1]`` (fp32): no
    logits-sized tensor. The weight gradient is accumulated chunk by chunk in the weight's
    dtype, or into megatron-core's fp32 ``main_grad`` (``into_main_grad``).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, chunks, tp_group, sequence_parallel, into_main_grad,
        predictions,
    ):  # fmt: skip
        tp_size, tp_rank = _group_size_rank(tp_group)
        if sequence_parallel and tp_size > 1:
            parts = [torch.empty_like(hidden) for _ in range(tp_size)]
            dist.all_gather(parts, hidden.contiguous(), group=tp_group)
            hidden = torch.cat(parts, dim=0)
        vocab_start = tp_rank * weight.shape[0]
        wide = _accumulation(hidden.dtype)
        loss = torch.empty(targets.shape, dtype=wide, device=hidden.device)
        lse = torch.empty((*targets.shape[:-1], 1), dtype=wide, device=hidden.device)
        with torch.no_grad():
            for start, end in chunk_bounds(hidden.shape[0], chunks):
                loss[start:end], lse[start:end] = _chunk_forward(
                    hidden[start:end], weight, targets[start:end], tp_group, vocab_start,
                    None if predictions is None else predictions[start:end],
                )  # fmt: skip
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunks, ctx.tp_group, ctx.sequence_parallel = chunks, tp_group, sequence_parallel
        ctx.vocab_start, ctx.into_main_grad = vocab_start, into_main_grad
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        if ctx.into_main_grad and hasattr(weight, "__fsdp_param__"):  # as ColumnParallelLinear
            weight.main_grad = weight.get_main_grad()  # Megatron-FSDP makes it in place
        into_main_grad = ctx.into_main_grad and getattr(weight, "main_grad", None) is not None
        wants_weight = ctx.needs_input_grad[1]  # False for a detached weight (MTP's detached heads)
        into_main_grad = into_main_grad and wants_weight
        # megatron-core's gradient-accumulation fusion: straight into the fp32 main_grad
        if into_main_grad:
            target = weight.main_grad
        else:
            target = torch.zeros_like(weight) if wants_weight else None
        for start, end in chunk_bounds(hidden.shape[0], ctx.chunks):
            part = hidden[start:end]
            grad_logits = _chunk_grad_logits(
                part, weight, targets[start:end], lse[start:end], grad_loss[start:end],
                ctx.vocab_start,
            )  # fmt: skip
            torch.matmul(grad_logits, weight, out=grad_hidden[start:end])
            if target is not None:
                _add_weight_grad(target, grad_logits, part)
            del grad_logits
        tp_size, _ = _group_size_rank(ctx.tp_group)
        if tp_size > 1 and ctx.sequence_parallel:
            local = torch.empty(
                (grad_hidden.shape[0] // tp_size, *grad_hidden.shape[1:]),
                dtype=grad_hidden.dtype,
                device=grad_hidden.device,
            )
            dist.reduce_scatter_tensor(local, grad_hidden, group=ctx.tp_group)
            grad_hidden = local
        elif tp_size > 1:
            dist.all_reduce(grad_hidden, group=ctx.tp_group)
        if not into_main_grad:
            return grad_hidden, target, None, None, None, None, None, None
        # as megatron-core's ColumnParallelLinear: a placeholder gradient, so that DDP's hook
        # runs (and skips it: grad_added_to_main_grad)
        weight.grad_added_to_main_grad = True
        return grad_hidden, _placeholder(weight), None, None, None, None, None, None


def chunked_output_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunks: int,
    tp_group: Optional[dist.ProcessGroup] = None,
    sequence_parallel: bool = False,
    into_main_grad: bool = False,
    predictions: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Per-slot cross-entropy of ``hidden @ weight^T`` against ``k`` targets per position,
    computed over ``chunks`` chunks of the positions so that at most one chunk's logits (and
    their fp32 copy) exist at a time, in forward and backward.

    Equals the output layer (``ColumnParallelLinear`` without bias, ``parallel_output``)
    followed by :func:`~tst_megatron.superposition.cross_entropy.vocab_parallel_multi_target_cross_entropy`
    (``k = 1``: megatron-core's ``vocab_parallel_cross_entropy``), to round-off: the same
    math, with the softmax in backward taken as ``exp(z - lse)``.

    Args:
        hidden: ``[T, b, h]`` sequence-first hidden states (``[T/tp, b, h]`` with
            ``sequence_parallel``), bf16/fp16/fp32/fp64.
        weight: ``[V/tp, h]`` this rank's vocabulary rows of the output weight (the output
            layer's, or the shared embedding's), same dtype.
        targets: ``[T, b, k]`` integer global token ids in ``[0, V)``.
        chunks: how many chunks the ``T`` positions are cut into (1: one chunk, still
            without keeping logits for backward).
        tp_group: the tensor-parallel group the vocabulary is split over (None: no TP).
        sequence_parallel: ``hidden`` is this rank's sequence shard (Megatron's sequence
            parallelism): gathered in forward, its gradient reduce-scattered.
        into_main_grad: megatron-core's gradient-accumulation fusion (the output layer's
            ``gradient_accumulation_fusion``): when ``weight`` has a ``main_grad`` (megatron-core
            DDP's fp32 buffer), its gradient is added there chunk by chunk, block by block,
            ``weight.grad_added_to_main_grad`` is set and a placeholder gradient is returned,
            as ``ColumnParallelLinear`` does; no weight-sized gradient is made.
        predictions: a ``[T, b]`` int64 tensor to write each position's predicted token into
            (the first global id of its largest logit, as ``torch.argmax`` of the gathered
            logits), for megatron-core's MTP acceptance counts; one all-reduce MIN of
            ``[t, b]`` per chunk more at TP > 1. None: not computed.

    Returns:
        ``[T, b, k]`` per-slot CE (nats), float32 (float64 for float64 inputs).

    Raises:
        ValueError: ``chunks < 1``; shapes that do not agree; non-integer targets.
    """
    tp_size, _ = _group_size_rank(tp_group)
    full_t = hidden.shape[0] * (tp_size if sequence_parallel else 1)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if targets.dim() != 3 or targets.shape[:2] != (full_t, hidden.shape[1]):
        raise ValueError(
            f"targets must be [T, b, k] = [{full_t}, {hidden.shape[1]}, k], got "
            f"{tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/tp, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"target ids must be an integer tensor, got dtype {targets.dtype}")
    if predictions is not None and (
        predictions.shape != targets.shape[:2] or predictions.dtype != torch.int64
    ):
        raise ValueError(
            f"predictions must be an int64 [T, b] = {tuple(targets.shape[:2])} tensor, got "
            f"{predictions.dtype} {tuple(predictions.shape)}"
        )
    return _ChunkedOutputCrossEntropy.apply(
        hidden, weight, targets.to(torch.int64), chunks, tp_group, sequence_parallel,
        into_main_grad, predictions,
    )  # fmt: skip
