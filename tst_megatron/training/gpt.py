"""A megatron-core ``GPTModel`` that also scores bags: the loss seam
and phase 1's MTP skip (:mod:`tst_megatron.training.seams`, shared with the ``HybridModel`` of
:mod:`tst_megatron.training.hybrid`), the latter entered in :meth:`TSTGPTModel._postprocess`.
No parameter or buffer is added: state dicts and ``sharded_state_dict`` keys are a baseline
``GPTModel``'s.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel

from tst_megatron.training.seams import PhaseOneMTPSkip, TSTLossSeam, idle_gradient


class TSTGPTModel(TSTLossSeam, PhaseOneMTPSkip, GPTModel):
    """A megatron-core ``GPTModel`` whose loss seam also takes ``[b, T, S]`` bag targets.

    Construction is ``GPTModel``'s. ``forward(..., labels=...)`` returns:

    - ``labels`` ``[b, T]`` (phase 2, validation): ``[b, T]`` fp32 per-token CE, megatron-core's
      own (:class:`~tst_megatron.training.seams.TSTLossSeam`).
    - ``labels`` ``[b, T, S]`` (phase 1, global ids in ``[0, V)``, not checked): ``[b, T, S]``
      fp32 per-slot CE ``logsumexp(z_j) - z_j[t_{j,k}]`` from
      :func:`~tst_megatron.superposition.vocab_parallel_multi_target_cross_entropy`, in place
      on the ``[T, b, V/tp]`` logits.
    - ``labels=None``: batch-first logits ``[b, T, V/tp]``, as ``GPTModel``.

    Under context parallelism ``T`` is this rank's share. Gathered logits are refused.
    Multi-token prediction (``mtp_num_layers``) trains in phase 2 only: megatron-core's MTP
    embeds the next input token, which phase 1 (bag-mean inputs) lacks, so there the MTP block
    is skipped and its parameters get a zero gradient (:meth:`_postprocess`).
    """

    def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        """``GPTModel._postprocess``, except with ``[b, T, S]`` labels on a model with MTP:
        the MTP block is skipped and MTP-only parameters get an exactly zero gradient
        (megatron-core DDP's ``--overlap-grad-reduce`` needs every grad hook to fire). Returns
        ``[b, T, S]`` fp32 CE, or ``hidden_states`` ``[T, b, h]`` on a non-output stage.
        """
        if labels is None or labels.dim() != 3 or not self.config.mtp_num_layers:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        idle = self._idle_mtp()  # :class:`~tst_megatron.training.seams.PhaseOneMTPSkip`
        if not self.post_process:
            return idle_gradient(hidden_states, idle)
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
        return idle_gradient(self.compute_language_model_loss(labels, logits), idle)
