"""The loss seam TST shares between megatron-core's ``GPTModel`` and ``HybridModel``: both
score their logits in ``compute_language_model_loss(labels, logits)`` (megatron-core's
``LanguageModule``), which :class:`TSTLossSeam` extends to phase 1's bags.

Phase 1's multi-hot cross-entropy is scored there on the sequence-first logits
``[T, b, V/tp]``, as megatron-core scores its own, with no batch-first copy.
"""

from __future__ import annotations

import torch

from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy


class TSTLossSeam:
    """Mixin for a megatron-core ``LanguageModule`` (``GPTModel``, ``HybridModel``), listed
    before it: ``class M(TSTLossSeam, GPTModel)``. Adds no parameter, buffer or state-dict key.
    """

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor):
        """Per-token CE for ``[b, T]`` labels (megatron-core), per-slot CE for ``[b, T, S]``.

        Args:
            labels: ``[b, T]`` or ``[b, T, S]`` integer global token ids.
            logits: ``[T, b, V/tp]`` output-layer logits (vocab-parallel). With ``[b, T, S]``
                labels they are overwritten by the softmax (they are not used afterwards).

        Returns:
            ``[b, T]`` or ``[b, T, S]`` float32 cross-entropy (nats).

        Raises:
            ValueError: ``labels`` is neither 2-D nor 3-D, or its leading shape does not
                match the logits, or the logits' last dimension is not ``vocab_size / TP``
                (gathered logits).
        """
        tp = self.tp_group.size() if self.tp_group is not None else 1
        if logits.shape[-1] * tp != self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} vocabulary entries per rank but the loss "
                f"scores this rank's shard, padded vocabulary {self.vocab_size} / TP {tp} = "
                f"{self.vocab_size // tp}: do not gather them (runtime_gather_output=True or "
                "parallel_output=False)"
            )
        if labels.dim() == 2:
            cross_entropy = super().compute_language_model_loss
            if not (torch.is_grad_enabled() and logits.requires_grad):  # no backward
                return cross_entropy(labels, logits)
            return _ScoredRowsOnly.apply(logits, labels, cross_entropy)
        if labels.dim() != 3:
            raise ValueError(f"labels must be [b, T] or [b, T, S], got {tuple(labels.shape)}")
        targets = labels.transpose(0, 1).contiguous()  # [b, T, S] -> [T, b, S] (small)
        per_slot = vocab_parallel_multi_target_cross_entropy(
            logits, targets, tp_group=self.tp_group, inplace=True
        )
        return per_slot.transpose(0, 1).contiguous()  # [T, b, S] -> [b, T, S]


# --- phase 2: no gradient from unscored positions ---------------------------------------


class _ScoredRowsOnly(torch.autograd.Function):
    """``cross_entropy(labels, logits)`` on ``[T, b, V/tp]`` logits, ``[b, T]`` fp32, whose
    backward zeroes the logits' gradient (in place) where the upstream gradient is zero.

    Workaround: megatron-core's CE backward (``tensor_parallel/cross_entropy.py``,
    ``fusions/fused_cross_entropy.py``) is ``(softmax - onehot) * g``, so a masked position
    with inf/nan logits gives ``nan * 0 = nan``.
    """

    @staticmethod
    def forward(ctx, logits, labels, cross_entropy):
        with torch.enable_grad():
            inner = logits.detach().requires_grad_()  # same storage: no copy
            per_token = cross_entropy(labels, inner)  # [b, T]
        ctx.inner, ctx.per_token = inner, per_token
        return per_token.detach()

    @staticmethod
    def backward(ctx, grad):
        inner, per_token = ctx.inner, ctx.per_token
        del ctx.inner, ctx.per_token
        (grad_logits,) = torch.autograd.grad(per_token, inner, grad)  # [T, b, V/tp]
        unscored = (grad == 0).transpose(0, 1).unsqueeze(-1)  # [b, T] -> [T, b, 1]
        if grad_logits.is_contiguous():  # the cross-entropy's own buffer
            return grad_logits.masked_fill_(unscored, 0.0), None, None
        return grad_logits.masked_fill(unscored, 0.0), None, None
