"""Vocab-parallel multi-target cross-entropy and the multi-hot (MCE) bag loss.

Style follows megatron-core's ``tensor_parallel/cross_entropy.py``: the math is split into
named steps; the collectives live in a thin autograd function.

Source of the loss: ``docs/design.md``, "Multi-hot cross-entropy (MCE)":
``MCE_j = sum_k w_k * m_{j,k} * CE(z_j, t_{j,k})`` with ``CE(z, t) = logsumexp(z) - z[t]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from tst_megatron.superposition.embedding import check_token_ids


def _group_size_rank(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return group.size(), group.rank()


# --- named math steps ------------------------------------------------------------------


def _shifted_logits(
    logits: torch.Tensor, global_max: torch.Tensor, *, inplace: bool
) -> torch.Tensor:
    """``[..., V/tp]`` fp32 logits minus the global row max, in one fp32 logits-sized buffer.

    bf16/fp16 logits: their fp32 copy, shifted in place (``logits.float() - max`` would hold
    two fp32 copies at once: +2 GiB at 8,192 tokens x 131,072 on an H200, where
    megatron-core's CE holds one). fp32 logits: their own storage with ``inplace``
    (megatron-core's CE does the same; the output layer does not keep its logits), else one
    new tensor.
    """
    if logits.dtype != torch.float32:
        return logits.float().sub_(global_max.unsqueeze(-1))
    if inplace:
        return logits.sub_(global_max.unsqueeze(-1))
    return logits - global_max.unsqueeze(-1)


def _local_target_logits(
    shifted: torch.Tensor, targets: torch.Tensor, vocab_start: int, vocab_end: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather ``shifted[..., t_k]`` for the targets in this shard, 0 for the others.

    Returns ``(target_logits [..., k] fp32, local_targets [..., k] int64, in_shard [..., k] bool)``.
    """
    in_shard = (targets >= vocab_start) & (targets < vocab_end)
    local_targets = torch.where(in_shard, targets - vocab_start, 0)
    target_logits = torch.gather(shifted, -1, local_targets)
    return torch.where(in_shard, target_logits, 0.0), local_targets, in_shard


class _VocabParallelMultiTargetCrossEntropy(torch.autograd.Function):
    """Per-slot CE of ``k`` targets against one vocab-parallel softmax.

    Forward collectives on ``tp_group`` (none when it is ``None`` or of size 1):
    1. all-reduce MAX of the row max ``[...]``;
    2. one all-reduce SUM of ``[..., k+1]``: the ``k`` target logits and the sum of exps.
    Saved for backward: the local softmax ``[..., V/tp]`` fp32 (one, not ``k``), the local
    target indices ``[..., k]`` and their shard mask ``[..., k]``. Backward needs no
    communication: ``dL/dz = softmax * sum_k g_k - sum_k g_k * onehot(t_k)``; a row whose
    upstream gradients are all zero (a fully masked position) gets exactly zero, even where
    its softmax is not finite. As in megatron-core, backward writes into the saved softmax,
    so it can run once per forward. No host synchronisation.
    """

    @staticmethod
    def forward(ctx, vocab_parallel_logits, targets, tp_group, inplace):
        tp_size, tp_rank = _group_size_rank(tp_group)
        vocab_per_rank = vocab_parallel_logits.shape[-1]
        vocab_start = tp_rank * vocab_per_rank

        # Step 1: global max for a stable log-sum-exp.
        global_max = vocab_parallel_logits.detach().amax(dim=-1).float()
        if tp_size > 1:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)

        # Step 2: shifted logits, the target logits in this shard, and the local sum of
        # exps; one all-reduce carries both.
        shifted = _shifted_logits(vocab_parallel_logits.detach(), global_max, inplace=inplace)
        target_logits, local_targets, in_shard = _local_target_logits(
            shifted, targets, vocab_start, vocab_start + vocab_per_rank
        )
        exp_logits = shifted.exp_()
        reduced = torch.cat([target_logits, exp_logits.sum(dim=-1, keepdim=True)], dim=-1)
        if tp_size > 1:
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=tp_group)
        target_logits, sum_exp = reduced[..., :-1], reduced[..., -1:]

        # Step 3: CE_k = log(sum exp) - z[t_k]; keep softmax for backward.
        loss = torch.log(sum_exp) - target_logits
        softmax = exp_logits.div_(sum_exp)
        ctx.save_for_backward(softmax, local_targets, in_shard)
        ctx.input_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_targets, in_shard = ctx.saved_tensors
        grad_loss = grad_loss.float()
        grad_sum = grad_loss.sum(dim=-1, keepdim=True)
        # softmax * sum_k g_k, exactly 0 on rows without gradient (selection: 0 * nan = nan) ...
        grad_input = softmax.mul_(grad_sum).masked_fill_(grad_sum == 0, 0.0)
        # ... minus g_k at each target in this shard (duplicates add up).
        grad_input.scatter_add_(-1, local_targets, -torch.where(in_shard, grad_loss, 0.0))
        return grad_input.to(ctx.input_dtype), None, None, None


def vocab_parallel_multi_target_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: Optional[dist.ProcessGroup] = None,
    inplace: bool = False,
    check: bool = False,
) -> torch.Tensor:
    """Cross-entropy of ``k`` targets per position against vocab-parallel logits.

    ``CE_k = logsumexp(z) - z[t_k]`` for every slot ``k``, with the log-sum-exp computed
    once for all ``k`` slots (megatron-core ``vocab_parallel_cross_entropy`` generalised to
    several targets). ``k = 1`` equals megatron-core's result.

    Args:
        vocab_parallel_logits: ``[..., V/tp]`` float logits, this rank's contiguous vocab
            shard (rank ``r`` holds ids ``[r*V/tp, (r+1)*V/tp)``). Any layout, e.g. the
            output layer's sequence-first ``[T, b, V/tp]``.
        targets: ``[..., k]`` integer *global* token ids in ``[0, V)``, same leading shape.
            An id outside ``[0, V)`` is not detected unless ``check`` (it then scores as a
            target of logit 0); check ids where data enters instead.
        tp_group: the tensor-parallel group the vocab is split over (e.g.
            ``model.output_layer.tp_group``). ``None`` means no tensor parallelism.
        inplace: reuse the storage of fp32 logits for the softmax (as megatron-core's CE
            does): saves one logits-sized fp32 buffer; the logits are overwritten and must
            not be used afterwards. Without it the logits are never modified.
        check: raise on ids outside ``[0, V)`` (one min/max and one device-to-host read).

    Returns:
        ``[..., k]`` float32 per-slot cross-entropy (nats).

    Raises:
        ValueError: leading shapes differ, targets are not integers, or (with ``check``) a
            target id lies outside ``[0, V)``.

    Cost: 2 all-reduces on ``tp_group`` (see ``_VocabParallelMultiTargetCrossEntropy``);
    memory: one fp32 ``[..., V/tp]`` softmax kept for backward (the logits' own with
    ``inplace``); no host synchronisation unless ``check``.
    """
    if vocab_parallel_logits.shape[:-1] != targets.shape[:-1]:
        raise ValueError(
            f"logits {tuple(vocab_parallel_logits.shape)} and targets {tuple(targets.shape)} "
            "must agree in all but the last dimension"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"target ids must be an integer tensor, got dtype {targets.dtype}")
    if check:
        tp_size, _ = _group_size_rank(tp_group)
        check_token_ids(targets, vocab_parallel_logits.shape[-1] * tp_size, what="target id")
    return _VocabParallelMultiTargetCrossEntropy.apply(
        vocab_parallel_logits, targets.to(torch.int64), tp_group, inplace
    )


def multi_hot_cross_entropy(
    per_slot_ce: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce per-slot CE to the MCE numerator and denominator (Megatron's loss contract).

    ``loss_sum = sum w_k * m_{j,k} * ce_{j,k}`` and ``weight_sum = sum w_k * m_{j,k}`` over all
    positions ``j`` and slots ``k``; the batch MCE is ``loss_sum / weight_sum``
    (``docs/design.md``, "Multi-hot cross-entropy (MCE)"). Masked slots are excluded with ``torch.where``, so a NaN or inf
    CE in a masked slot cannot leak into the loss or its gradient.

    Args:
        per_slot_ce: ``[..., S]`` float CE per slot (e.g. from
            :func:`vocab_parallel_multi_target_cross_entropy`).
        mask: ``[..., S]`` loss mask (0/1, any real dtype).
        weights: ``[S]`` slot weights (e.g. :func:`bag_weights`).

    Returns:
        ``(loss_sum, weight_sum)``: fp32 scalars. All-masked input gives ``(0, 0)`` with
        zero (finite) gradients.

    Raises:
        ValueError: shapes do not match.
    """
    if per_slot_ce.shape != mask.shape or weights.shape != per_slot_ce.shape[-1:]:
        raise ValueError(
            f"shapes do not match: per_slot_ce {tuple(per_slot_ce.shape)}, "
            f"mask {tuple(mask.shape)}, weights {tuple(weights.shape)}"
        )
    slot_weight = mask.float() * weights.to(device=mask.device, dtype=torch.float32)
    scored = torch.where(slot_weight > 0, per_slot_ce.float(), 0.0)
    return (scored * slot_weight).sum(), slot_weight.sum()
