"""The loss seam: a megatron-core ``GPTModel`` that also scores bags, and a router whose
load-balancing gradient does not depend on the parallel layout.

Neither class adds a parameter or a buffer: state dicts and ``sharded_state_dict`` keys are
exactly those of a baseline ``GPTModel`` (tested), so checkpoints move freely between this
project, Megatron-LM and the converters.

Phase 1 scores the multi-hot cross-entropy where megatron-core scores its cross-entropy:
in :meth:`GPTModel.compute_language_model_loss`, on the output layer's sequence-first
logits ``[T, b, V/tp]``. ``GPTModel.forward(labels=None)`` would instead return a
batch-first *copy* of the logits, whose gradient is then laid out again for the output
layer's backward: one logits-sized buffer and two logits-sized copies per micro-batch.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy


class TSTGPTModel(GPTModel):
    """A megatron-core ``GPTModel`` whose loss seam also takes ``[b, T, S]`` bag targets.

    Construction is ``GPTModel``'s, unchanged (the MoE router included: megatron-core 0.19
    scales the per-token aux and z losses by the TP x CP group size itself, so their gradient
    does not depend on the layout; ``tests/unit/test_moe_loss_scaling.py``).
    ``forward(..., labels=...)``:

    - ``labels`` ``[b, T]`` (phase 2 and validation): megatron-core's own cross-entropy
      (fused or not, as configured) inside :class:`_ScoredRowsOnly`, so that a position
      whose loss gets no gradient (a masked one) passes exactly zero to the logits, even
      where they are ``inf``/``nan``; returns ``[b, T]`` fp32 per-token CE.
    - ``labels`` ``[b, T, S]`` (phase 1, global ids in ``[0, V)``): returns ``[b, T, S]`` fp32
      per-slot CE ``logsumexp(z_j) - z_j[t_{j,k}]`` from
      :func:`~tst_megatron.superposition.vocab_parallel_multi_target_cross_entropy`, computed
      on the sequence-first logits ``[T, b, V/tp]`` in place (as megatron-core's CE does):
      no copy of the logits is made. Ids are not checked (no host sync); data is checked
      where it enters (``training/data.py``).
    - ``labels=None``: batch-first logits ``[b, T, V/tp]``, as ``GPTModel``.

    Under context parallelism ``T`` is this rank's share of the (latent) sequence.
    The logits must be this rank's vocabulary shard: gathered logits
    (``runtime_gather_output=True``, or ``parallel_output=False`` at TP > 1) are refused.

    Multi-token prediction (``mtp_num_layers``, megatron-core's ``MultiTokenPredictionBlock``)
    trains in phase 2 only. With ``[b, T]`` labels (phase 2, validation) everything is
    megatron-core's ``GPTModel._postprocess``: the MTP block, ``process_mtp_loss`` with the
    ``loss_mask`` given to ``forward`` (``--mtp-loss-scaling-factor``, its logging by
    ``MTPLossLoggingHelper``). With ``[b, T, S]`` labels (phase 1) the MTP block is skipped
    (:meth:`_postprocess`): its loss is not added, nothing is logged for it, and the
    parameters only MTP uses (the MTP block, and the MTP stage's own copy of the embedding
    when that stage is not the first) get an exactly zero gradient. Why skip rather than
    adapt: megatron-core's MTP embeds the *next input token* (``roll_tensor`` of ``input_ids``
    by one position, then ``embedding(input_ids)``) and scores the labels rolled by one; phase
    1 has neither ``input_ids`` nor one-token labels (its inputs are bag means, its targets
    the next bag), and the paper defines no MTP over bags. Why a zero gradient rather than
    none: megatron-core's DDP with ``--overlap-grad-reduce`` dispatches a bucket's reduction
    when every parameter's gradient hook has fired and asserts so at the end of the step, so
    a parameter without a gradient would stop the run; with zeros the grad buffers hold what
    they would hold anyway (they are zero-filled), and the optimizer sees a zero gradient for
    these parameters in phase 1 either way. So in phase 1 their Adam moments stay zero while
    the optimizer's step count advances (their first updates after the switch have a spent
    bias correction), and decoupled weight decay still shrinks them.
    """

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """``GPTModel._postprocess``, except with ``[b, T, S]`` labels on a model with MTP.

        There (phase 1) the MTP block and ``process_mtp_loss`` are skipped: the output
        layer (with the shared embedding weight when tied, MuP logit scaling where
        megatron-core has it) scores ``hidden_states`` ``[T, b, h]`` through
        :meth:`compute_language_model_loss` (``[b, T, S]`` fp32 CE), and the parameters only
        MTP uses get an exactly zero gradient (:class:`_ZeroGradient`). A stage without the
        output layer returns ``hidden_states`` ``[T, b, h]`` (without MTP's concatenated
        outputs, which the output stage does not expect in phase 1 either).
        Everything else is megatron-core's, argument for argument.
        """
        if labels is None or labels.dim() != 3 or not self.config.mtp_num_layers:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        idle = self._mtp_only_parameters()
        if not self.post_process:
            return _ZeroGradient.apply(hidden_states, *idle)
        output_weight = None
        if self.share_embeddings_and_output_weights:
            output_weight = self.shared_embedding_or_output_weight()
        logits, _ = self.output_layer(
            hidden_states,
            weight=output_weight,
            runtime_gather_output=kwargs.get("runtime_gather_output"),
        )
        if self.config.use_mup:
            logits = self._scale_logits(logits)
        return _ZeroGradient.apply(self.compute_language_model_loss(labels, logits), *idle)

    def _mtp_only_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable parameters of this stage that only the MTP block uses: the block's,
        and on an MTP stage that is not the first, its own copy of the embedding (minus the
        output weight when tied: the output layer uses it in phase 1 too)."""
        if not getattr(self, "mtp_process", False):
            return []
        params = list(self.mtp.parameters())
        if not self.pre_process:
            shared = None
            if self.share_embeddings_and_output_weights and self.post_process:
                shared = self.shared_embedding_or_output_weight()
            params += [p for p in self.embedding.parameters() if p is not shared]
        unique = {id(p): p for p in params if p.requires_grad}
        return list(unique.values())

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
                match the logits, or the logits' last dimension is not this rank's share
                of the padded vocabulary (``vocab_size / TP``): scoring gathered logits as a
                shard would add ``log TP`` to every CE.
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
    """megatron-core's cross-entropy, with exactly zero gradient on unscored rows.

    megatron-core's cross-entropy backward (``tensor_parallel/cross_entropy.py`` and the
    fused ``fusions/fused_cross_entropy.py``) is ``(softmax - onehot) * g``: at a masked
    position ``g = 0``, but where the logits are inf/nan the softmax is nan and
    ``nan * 0 = nan``, which then reaches every parameter. Selecting the loss in the loss
    function cannot help (its gradient is already 0). Which cross-entropy runs inside is
    not this function's concern, so the same holds for Transformer Engine's.

    Forward runs ``cross_entropy(labels, logits)`` (megatron-core's, as configured) on a
    detached alias of the ``[T, b, V/tp]`` logits and returns its ``[b, T]`` fp32 loss.
    Backward runs that cross-entropy's own backward (``torch.autograd.grad``), then sets the
    rows whose upstream gradient is zero to exactly zero, in place: one ``[b, T]`` compare
    and one logits-sized pass, no copy, no collective, no host sync. Phase 1's
    cross-entropy does the same inside its own backward.
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


class _ZeroGradient(torch.autograd.Function):
    """Identity on ``output``; an exactly zero gradient for each of ``params``.

    Forward returns ``output`` itself (any shape, dtype). Backward passes ``output``'s
    gradient through unchanged and gives each parameter a zero gradient of its shape and
    dtype (a broadcast zero: no parameter-sized buffer is made here), so every parameter's
    gradient-accumulation hook fires (megatron-core DDP's ``register_grad_ready``) and adds
    zero. Saves nothing for backward but the parameters' shapes, dtypes and devices; no
    collective, no host sync.
    """

    @staticmethod
    def forward(ctx, output, *params):
        ctx.like = [(p.shape, p.dtype, p.device) for p in params]
        return output

    @staticmethod
    def backward(ctx, grad):
        zeros = (torch.zeros((), dtype=d, device=dev).expand(shape) for shape, d, dev in ctx.like)
        return (grad, *zeros)
