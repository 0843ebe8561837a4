"""The ``GPTModel`` family (Megatron-LM's ``pretrain_gpt.py``): :class:`TSTGPTModel`, a
megatron-core ``GPTModel`` that also scores bags (the loss seam and phase 1's MTP skip,
:mod:`tst_megatron.models.seams`, shared with :mod:`tst_megatron.models.hybrid`), its
local layer specs (:func:`gpt_block_spec`, :func:`local_mtp_block_spec`) and its builder
(:func:`build_gpt_model_from_args`: the launcher's, and the checkpoint converter's).
No parameter or buffer is added: state dicts and ``sharded_state_dict`` keys are a baseline
``GPTModel``'s.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_decoder_layer_specs,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.heterogeneous.heterogeneous_config import (
    HeterogeneousTransformerConfig,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from tst_megatron.models.layers import (
    SequenceParallelNorm,
    local_layer,
    model_arguments,
    ready_for_ddp,
)
from tst_megatron.models.seams import (
    PhaseOneMTPSkip,
    TSTLossSeam,
    enable_loss_chunks,
    idle_gradient,
)


class TSTGPTModel(TSTLossSeam, PhaseOneMTPSkip, GPTModel):
    """A megatron-core ``GPTModel`` whose loss seam also takes ``[b, T, S]`` bag targets.

    Construction is ``GPTModel``'s. ``forward(..., labels=...)`` returns:

    - ``labels`` ``[b, T]`` (phase 2, validation): ``[b, T]`` fp32 per-token CE, megatron-core's
      own (:class:`~tst_megatron.models.seams.TSTLossSeam`).
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
        ``[b, T, S]`` fp32 CE, or ``hidden_states`` ``[T, b, h]`` on a non-output stage. With
        labels and ``--tst-loss-chunks`` > 1 the head runs in chunks (``chunked_head``; also
        in the expert-parallel overlap's post-process node, which calls this method).
        """
        with self.chunked_head(labels):  # --tst-loss-chunks (TSTLossSeam)
            return self._postprocess_phases(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )

    def _postprocess_phases(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
        if labels is None or labels.dim() != 3 or not self.config.mtp_num_layers:
            return super()._postprocess(
                hidden_states, input_ids, position_ids, labels, *args, **kwargs
            )
        idle = self._idle_mtp()  # :class:`~tst_megatron.models.seams.PhaseOneMTPSkip`
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


def gpt_block_spec(config: TransformerConfig, *, vp_stage: Optional[int] = None):
    """megatron-core's local decoder block spec (``get_gpt_decoder_block_spec``, dense/MoE
    layers by ``config.moe_layer_freq``) for this pipeline (and virtual) stage, with every norm
    a :class:`~tst_megatron.models.layers.SequenceParallelNorm` (TP + SP + MoE without TE or
    Apex) and the experts' second linear layer an :class:`~tst_megatron.models.layers.ExpertRowParallelLinear` (MoE with
    biases). Returns a ``TransformerBlockSubmodules``."""
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    return TransformerBlockSubmodules(
        layer_specs=[local_layer(spec) for spec in block.layer_specs],
        layer_norm=SequenceParallelNorm,
    )


def local_mtp_block_spec(config: TransformerConfig, *, vp_stage: Optional[int] = None):
    """megatron-core's local multi-token prediction block spec (``get_gpt_mtp_block_spec`` on
    the last decoder layer's spec, as Megatron-LM's ``mtp_block_spec`` builds it) with
    :func:`gpt_block_spec`'s norms and expert fc2; None when this stage has no MTP layer."""
    if not config.mtp_num_layers:
        return None
    layers = get_gpt_decoder_layer_specs(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    last = local_layer(layers[-1])
    block = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False, vp_stage=vp_stage)
    if block is None:
        return None
    norms = dict(enorm=SequenceParallelNorm, hnorm=SequenceParallelNorm)
    norms["layer_norm"] = SequenceParallelNorm
    specs = [
        dataclasses.replace(s, submodules=dataclasses.replace(s.submodules, **norms))
        for s in block.layer_specs
    ]
    return dataclasses.replace(block, layer_specs=specs)


def build_gpt_model_from_args(
    args,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """A :class:`TSTGPTModel` (a ``GPTModel`` with the TST loss seam; same parameters and
    state-dict keys) for Megatron-LM's ``args`` (the launcher's, or a checkpoint's: the
    converter calls this too). megatron-core's parallel state must be initialised.

    Configuration from Megatron-LM's ``gpt_config_from_args``; the layer spec is ``--spec``,
    else with ``--transformer-impl local`` :func:`gpt_block_spec` (and
    :func:`local_mtp_block_spec`), else Megatron-LM's ``default_layer_spec`` and
    ``mtp_block_spec``. The ``GPTModel`` arguments are those of Megatron-LM 0.19.2's
    ``GPTModelBuilder.build_model``, which cannot build a subclass (it names ``GPTModel``).
    Expert parameters are tagged and a CPU run's model kept on the CPU
    (:func:`~tst_megatron.models.layers.ready_for_ddp`).
    """
    # megatron.training (Megatron-LM) is heavy and optional for megatron-core users
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import default_layer_spec, mtp_block_spec

    cfg = gpt_config_from_args(args, config=config)
    spec = cfg.transformer_layer_spec
    plain_local = (
        cfg.transformer.transformer_impl == "local"
        and cfg.transformer.experimental_attention_variant is None
        and not isinstance(cfg.transformer, HeterogeneousTransformerConfig)
    )
    local = spec is None and plain_local
    if local:
        # megatron-core's local block spec with the project's norms (TP + SP without TE or
        # Apex) and expert fc2 (MoE with biases)
        spec = gpt_block_spec(cfg.transformer, vp_stage=vp_stage)
    elif spec is None:
        spec = default_layer_spec(cfg, vp_stage)
    elif not isinstance(spec, ModuleSpec) and callable(spec):  # as GPTModelBuilder calls it
        takes_stage = "vp_stage" in inspect.signature(spec).parameters
        spec = spec(cfg, vp_stage=vp_stage) if takes_stage else spec(cfg)
    if cfg.attention_backend == AttnBackend.local and hasattr(spec, "submodules"):
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = TSTGPTModel(
        transformer_layer_spec=spec,
        mtp_block_spec=(
            local_mtp_block_spec(cfg.transformer, vp_stage=vp_stage)  # the same norms
            if local
            else mtp_block_spec(cfg, spec, vp_stage=vp_stage)
        ),
        rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
        **model_arguments(
            args,
            cfg,
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        ),
    )
    enable_loss_chunks(model, getattr(args, "tst_loss_chunks", None) or 1)
    return ready_for_ddp(model, cfg.transformer)
