"""TST on megatron-core's ``HybridModel`` (Megatron-LM's ``pretrain_hybrid.py``): the same
seams as on ``GPTModel``. The forward steps embed phase 1's bags with the model's own
``embedding`` and pass them as ``decoder_input``; the loss is scored in
``compute_language_model_loss`` (:class:`~tst_megatron.models.seams.TSTLossSeam`).

The layer kinds of ``--hybrid-layer-pattern`` (megatron-core's ``Symbols``): ``*``
attention, ``-`` dense MLP and ``E`` MoE run on megatron-core's local modules
(:func:`local_hybrid_stack_spec`, ``--transformer-impl local``, every CPU run) or its
Transformer Engine spec (``hybrid_stack_spec``); ``M`` (Mamba-2), ``G`` (gated delta net),
``D`` (DeepSeek sparse attention) and ``+`` (MLA) only on the latter
(:data:`~tst_megatron.models.pattern.LAYER_KINDS`, their ``needs``; the rules refuse them in one line,
:func:`tst_megatron.training.checks.model.hybrid_pattern_problems`).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from tst_megatron.models.layers import (
    SequenceParallelNorm,
    local_layer_specs,
    model_arguments,
    ready_for_ddp,
)
from tst_megatron.models.seams import (
    PhaseOneMTPSkip,
    TSTLossSeam,
    enable_loss_chunks,
    idle_gradient,
)


class TSTHybridModel(TSTLossSeam, PhaseOneMTPSkip, HybridModel):
    """A megatron-core ``HybridModel`` whose loss seam also takes ``[b, T, S]`` bag targets.

    Construction is ``HybridModel``'s; ``forward(..., labels=...)`` returns ``[b, T]`` fp32
    per-token CE (phase 2), ``[b, T, S]`` fp32 per-slot CE (phase 1,
    :class:`~tst_megatron.models.seams.TSTLossSeam`) or, with ``labels=None``,
    batch-first logits ``[b, T, V/tp]``. Parameters and state-dict keys are a
    ``HybridModel``'s. Multi-token prediction (``/`` in the pattern) trains in phase 2 only, as
    on the GPT path (:class:`~tst_megatron.models.seams.PhaseOneMTPSkip`, entered in
    :meth:`forward`).
    """

    def forward(
        self,
        input_ids,
        position_ids,
        attention_mask,
        decoder_input=None,
        labels=None,
        *rest,
        **kwargs,
    ):
        """``HybridModel.forward``, except with ``[b, T, S]`` labels on a stage that runs MTP:
        the MTP block is skipped (``HybridModel`` runs it on ``input_ids``, which phase 1's
        bag inputs lack) and the MTP-only parameters get an exactly zero gradient; with labels
        and ``--tst-loss-chunks`` > 1 the head runs in chunks (``chunked_head``)."""
        args = (input_ids, position_ids, attention_mask, decoder_input, labels, *rest)
        with self.chunked_head(labels):  # --tst-loss-chunks (TSTLossSeam)
            if labels is None or labels.dim() != 3 or not getattr(self, "mtp_process", False):
                return super().forward(*args, **kwargs)
            idle = self._idle_mtp()
            self.mtp_process = False  # HybridModel.forward reads it for both MTP steps
            try:
                output = super().forward(*args, **kwargs)
            finally:
                self.mtp_process = True
            return idle_gradient(output, idle)


class LocalHybridStack(HybridStack):
    """megatron-core's ``HybridStack`` with its final norm a
    :class:`~tst_megatron.models.layers.SequenceParallelNorm`. Same parameter names
    (``final_norm.weight``, ``final_norm.bias``).

    Workaround: ``HybridStack`` builds Transformer Engine's ``TENorm`` whatever its spec
    (megatron-core 0.19.2, ``hybrid_block.py``), which a run without TE cannot build.
    """

    def __init__(self, config: TransformerConfig, submodules, *args, **kwargs):
        post_layer_norm = kwargs.pop("post_layer_norm", True)
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = SequenceParallelNorm(
                config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon
            )


def local_hybrid_stack_spec(config: TransformerConfig) -> ModuleSpec:
    """A ``HybridStack`` spec of megatron-core's local modules for ``*``, ``-`` and ``E``, from the local GPT layer specs
    (:func:`tst_megatron.models.layers.local_layer_specs`: the same attention, MLP and MoE
    modules and norms as a GPT layer), split as megatron-core's TE ``hybrid_stack_spec``
    splits them: the attention layer keeps ``input_layernorm`` and ``self_attention``, the
    MLP and MoE layers ``pre_mlp_layernorm`` and ``mlp``. The final norm:
    :class:`LocalHybridStack`; the MTP block: :func:`local_hybrid_mtp_block_spec`."""
    dense, moe = local_layer_specs(config)
    attention = dense.submodules
    layers = dict(
        attention_layer=ModuleSpec(
            module=TransformerLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=attention.input_layernorm,
                self_attention=attention.self_attention,
                self_attn_bda=attention.self_attn_bda,
                sharded_state_dict_keys_map=_keys_map(attention, "input_layernorm."),
            ),
        ),
        mlp_layer=ModuleSpec(module=MLPLayer, submodules=_mlp_only(dense.submodules)),
    )
    if moe is not None:  # else megatron-core's IdentityOp: the rules refuse E without experts
        layers["moe_layer"] = ModuleSpec(
            module=MoETransformerLayer, submodules=_mlp_only(moe.submodules)
        )
    return ModuleSpec(
        module=LocalHybridStack,
        submodules=HybridStackSubmodules(**layers, mtp_block_spec=local_hybrid_mtp_block_spec()),
    )


def local_hybrid_mtp_block_spec() -> ModuleSpec:
    """megatron-core's hybrid MTP block spec (``hybrid_layer_specs._hybrid_mtp_block_spec``:
    norms and the projection; the inner layers are built from the pattern after ``/``) with
    megatron-core's local column-parallel projection (``LocalSpecProvider``) and
    :class:`~tst_megatron.models.layers.SequenceParallelNorm` norms."""
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=SequenceParallelNorm,
            hnorm=SequenceParallelNorm,
            eh_proj=LocalSpecProvider().column_parallel_linear(),
            mtp_model_layer=None,  # HybridModel builds it from the MTP pattern
            layer_norm=SequenceParallelNorm,
        ),
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[layer]),
    )


def _mlp_only(sub: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    return TransformerLayerSubmodules(
        pre_mlp_layernorm=sub.pre_mlp_layernorm,
        mlp=sub.mlp,
        mlp_bda=sub.mlp_bda,
        sharded_state_dict_keys_map=_keys_map(sub, "pre_mlp_layernorm."),
    )


def _keys_map(sub: TransformerLayerSubmodules, prefix: str) -> dict:
    """The GPT local layer's checkpoint name of the norm at ``prefix``
    (``sharded_state_dict_keys_map``: megatron-core saves ``input_layernorm.weight`` as
    ``self_attention.linear_qkv.layer_norm_weight``, Transformer Engine's fused name), so a
    local hybrid checkpoint names its norms as a GPT one does and megatron-core's GPT-to-hybrid
    load (``dist_checkpointing.gpt_checkpoint_interop``) finds them."""
    return {k: v for k, v in (sub.sharded_state_dict_keys_map or {}).items() if k == prefix}


def build_hybrid_model_from_args(
    args,
    *,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
) -> TSTHybridModel:
    """A :class:`TSTHybridModel` for Megatron-LM's ``args`` (``--hybrid-layer-pattern``),
    with the arguments of Megatron-LM 0.19.2's ``HybridModelBuilder.build_model`` (which
    cannot build a subclass) from its ``hybrid_config_from_args``. The stack spec is
    ``--spec``, else with ``--transformer-impl local`` :func:`local_hybrid_stack_spec`, else
    megatron-core's ``hybrid_stack_spec`` (Transformer Engine). Expert parameters are tagged
    and a CPU run's model kept on the CPU (:func:`~tst_megatron.models.layers.ready_for_ddp`).
    megatron-core's parallel state must be initialised.
    """
    # megatron.training (Megatron-LM) is heavy and optional for megatron-core users
    from megatron.training.argument_utils import hybrid_config_from_args

    cfg = hybrid_config_from_args(args, config=config)
    spec = cfg.hybrid_stack_spec
    if spec is None:
        local = cfg.transformer.transformer_impl == "local"
        spec = local_hybrid_stack_spec(cfg.transformer) if local else hybrid_stack_spec
    model = TSTHybridModel(
        hybrid_stack_spec=spec,
        hybrid_layer_pattern=cfg.hybrid_layer_pattern,
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
