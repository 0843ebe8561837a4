"""Model construction: a plain megatron-core ``GPTModel`` in both TST phases.

The launcher's model provider (:func:`build_model_from_args`, also the checkpoint
converter's) takes the local layer specs from here (:func:`gpt_block_spec`,
:func:`local_mtp_block_spec`). TST adds no module and no parameter: its state dict has
exactly the keys of a baseline model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from tst_megatron.runtime.norm import SequenceParallelNorm
from tst_megatron.training.gpt import TSTGPTModel


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` as the local experts' second linear layer, always on
    megatron-core's expert path (``explicit_expert_comm``: bias handed back separately).

    Why: at expert TP = EP = 1 megatron-core 0.19 returns this layer's output through an
    identity autograd function (a view), then adds the expert bias to it in place
    (``transformer/mlp.py``), and autograd raises "... is a view and is being modified
    inplace". Same numbers, parameters and checkpoint keys as ``RowParallelLinear``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Larger expert-TP or EP sizes set this already; at size 1 the skipped reduce is a no-op.
        self.explicit_expert_comm = self.is_expert


def _submodules(spec):
    """The ``submodules`` of a spec: a ``ModuleSpec``'s or, for megatron-core 0.19's MoE
    layers and experts, a ``functools.partial(Module, submodules=...)``'s."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def _with_submodules(spec, submodules):
    """``spec`` (``ModuleSpec`` or ``functools.partial``) with its ``submodules`` replaced."""
    if isinstance(spec, functools.partial):
        return functools.partial(
            spec.func, *spec.args, **{**spec.keywords, "submodules": submodules}
        )
    return dataclasses.replace(spec, submodules=submodules)


def _with_expert_fc2(spec) -> object:
    """Return the layer ``spec`` with a local MoE's expert ``linear_fc2`` set to
    :class:`ExpertRowParallelLinear` (dense layers are returned unchanged)."""
    mlp = getattr(_submodules(spec), "mlp", None)
    experts = getattr(_submodules(mlp), "experts", None)
    fc2 = getattr(_submodules(experts), "linear_fc2", None)
    if fc2 is not RowParallelLinear:
        return spec
    experts = _with_submodules(
        experts, dataclasses.replace(_submodules(experts), linear_fc2=ExpertRowParallelLinear)
    )
    mlp = _with_submodules(mlp, dataclasses.replace(_submodules(mlp), experts=experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=mlp))


def _with_norm(spec, norm) -> object:
    """Return ``spec`` with every norm slot of a local transformer layer set to ``norm``."""
    if not isinstance(spec, ModuleSpec) or spec.submodules is None:
        return spec
    sub = spec.submodules
    changes = {}
    for slot in ("input_layernorm", "pre_mlp_layernorm", "pre_cross_attn_layernorm"):
        current = getattr(sub, slot, None)
        if current is not None and current is not IdentityOp:
            changes[slot] = norm
    attention = getattr(sub, "self_attention", None)
    if isinstance(attention, ModuleSpec) and attention.submodules is not None:
        att_changes = {
            slot: norm
            for slot in ("q_layernorm", "k_layernorm")
            if getattr(attention.submodules, slot, None) not in (None, IdentityOp)
            and getattr(getattr(attention.submodules, slot), "__name__", "") != "L2Norm"
        }
        if att_changes:
            changes["self_attention"] = dataclasses.replace(
                attention, submodules=dataclasses.replace(attention.submodules, **att_changes)
            )
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))


def gpt_block_spec(config: TransformerConfig, *, vp_stage: Optional[int] = None):
    """megatron-core's local decoder block spec (``get_gpt_decoder_block_spec``, dense/MoE
    layers by ``config.moe_layer_freq``) for this pipeline (and virtual) stage, with every norm
    a :class:`~tst_megatron.runtime.norm.SequenceParallelNorm` (TP + SP + MoE without TE or
    Apex) and the experts' second linear layer an :class:`ExpertRowParallelLinear` (MoE with
    biases). Returns a ``TransformerBlockSubmodules``."""
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    return TransformerBlockSubmodules(
        layer_specs=[
            _with_expert_fc2(_with_norm(spec, SequenceParallelNorm)) for spec in block.layer_specs
        ],
        layer_norm=SequenceParallelNorm,
    )


def local_layer_specs(config: TransformerConfig):
    """megatron-core's local dense and MoE transformer layer specs (``get_gpt_layer_local_spec``,
    as ``get_gpt_decoder_layer_specs`` builds them for ``--transformer-impl local``) with
    :func:`gpt_block_spec`'s norms and expert fc2: ``(dense, moe)``, ``moe`` None without
    ``--num-experts``. The layers of :func:`tst_megatron.training.hybrid.local_hybrid_stack_spec`.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    def local(num_experts):
        spec = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=config.moe_grouped_gemm if num_experts else False,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        )
        return _with_expert_fc2(_with_norm(spec, SequenceParallelNorm))

    return local(None), (local(config.num_moe_experts) if config.num_moe_experts else None)


def local_mtp_block_spec(config: TransformerConfig, *, vp_stage: Optional[int] = None):
    """megatron-core's local multi-token prediction block spec (``get_gpt_mtp_block_spec`` on
    the last decoder layer's spec, as Megatron-LM's ``mtp_block_spec`` builds it) with
    :func:`gpt_block_spec`'s norms and expert fc2; None when this stage has no MTP layer."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_layer_specs,
        get_gpt_mtp_block_spec,
    )

    layers = get_gpt_decoder_layer_specs(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    last = _with_expert_fc2(_with_norm(layers[-1], SequenceParallelNorm))
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


def tag_expert_grad_reduction(model, config: TransformerConfig) -> None:
    """Tag every expert parameter of ``model`` to have its gradient summed over its expert-DP
    group only (``allreduce = False``, ``sequence_parallel = False``), when EP > 1 or expert
    TP differs from TP; otherwise megatron-core's tags stay.

    Why: megatron-core 0.19 also tags the experts' fc2 bias ``sequence_parallel``, so
    ``finalize_model_grads`` sums it over TP on top: twice the gradient at EP 1, another
    expert's gradient added at EP > 1. Call before DDP wraps the model (DDP and the
    optimizer read the tags); shared experts are dense layers and keep theirs.
    """
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if config.expert_model_parallel_size == 1 and etp == config.tensor_model_parallel_size:
        return
    for module in model.modules():
        if isinstance(module, BaseMoELayer) and module.experts is not None:
            for param in module.experts.parameters():
                param.allreduce = False
                if getattr(param, "sequence_parallel", False):
                    param.sequence_parallel = False


# --- Megatron-LM's model provider ------------------------------------------------------

_recording: list = []  # not empty once model_provider has started the memory history


def model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """Megatron-LM model provider of ``pretrain_gpt.py``: :func:`build_model_from_args` on
    Megatron-LM's global ``args`` (``megatron.training.get_args()``). The first call starts
    CUDA's allocator history with ``--record-memory-history``, as ``pretrain_gpt.py``'s provider
    does (Megatron-LM's ``start_memory_history_recording``, which reads those flags of
    ``args``)."""
    return _provide(
        build_model_from_args, pre_process, post_process, vp_stage, config, pg_collection
    )


def hybrid_model_provider(
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
    config=None,
    pg_collection=None,
):
    """:func:`model_provider` for ``pretrain_hybrid.py``:
    :func:`~tst_megatron.training.hybrid.build_hybrid_model_from_args`."""
    from tst_megatron.training.hybrid import build_hybrid_model_from_args

    return _provide(
        build_hybrid_model_from_args, pre_process, post_process, vp_stage, config, pg_collection
    )


def _provide(build, pre_process, post_process, vp_stage, config, pg_collection):
    from megatron.training import get_args
    from megatron.training.utils import start_memory_history_recording

    if not _recording:  # once per process
        start_memory_history_recording(get_args())
        _recording.append(True)
    return build(
        get_args(),
        pre_process=pre_process,
        post_process=post_process,
        vp_stage=vp_stage,
        config=config,
        pg_collection=pg_collection,
    )


def build_model_from_args(
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
    Expert parameters are tagged by :func:`tag_expert_grad_reduction`.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.heterogeneous.heterogeneous_config import (
        HeterogeneousTransformerConfig,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import default_layer_spec, mtp_block_spec

    from tst_megatron.runtime import cpu

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
        # Apex) and expert fc2 (MoE with biases): tst_megatron.training.model.gpt_block_spec
        spec = gpt_block_spec(cfg.transformer, vp_stage=vp_stage)
    elif spec is None:
        spec = default_layer_spec(cfg, vp_stage)
    elif not isinstance(spec, ModuleSpec) and callable(spec):  # as GPTModelBuilder calls it
        takes_stage = "vp_stage" in inspect.signature(spec).parameters
        spec = spec(cfg, vp_stage=vp_stage) if takes_stage else spec(cfg)
    if cfg.attention_backend == AttnBackend.local and hasattr(spec, "submodules"):
        spec.submodules.self_attention.submodules.core_attention = DotProductAttention
    model = TSTGPTModel(
        config=cfg.transformer,
        transformer_layer_spec=spec,
        mtp_block_spec=(
            local_mtp_block_spec(cfg.transformer, vp_stage=vp_stage)  # the same norms
            if local
            else mtp_block_spec(cfg, spec, vp_stage=vp_stage)
        ),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=cfg.seq_length,
        fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
        parallel_output=cfg.parallel_output,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling,
        rope_scaling_factor=cfg.rope_scaling_factor,
        seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
        scatter_embedding_sequence_parallel=cfg.scatter_embedding_sequence_parallel,
        pre_process=pre_process,
        post_process=post_process,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    # experts summed over their expert-DP group only (megatron-core also sums the fc2 bias
    # over TP at expert TP 1 < TP): before DDP reads the tags
    tag_expert_grad_reduction(model, cfg.transformer)
    return cpu.keep_on_cpu(model) if cpu.is_enabled() else model
