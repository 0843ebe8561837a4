"""Model construction: a plain megatron-core ``GPTModel`` in both TST phases.

All construction lives here so a later move to megatron-core's ``HybridModel`` touches one
file: :func:`build_model` builds the model a run configuration describes (the trainer, per
virtual pipeline stage, and the checkpoint converter both call it), on top of
:func:`build_gpt_model`. TST adds no module and no parameter: its state dict has exactly the
keys of a baseline model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from tst_megatron.errors import ConfigError
from tst_megatron.runtime.norm import SequenceParallelNorm
from tst_megatron.training.gpt import TSTGPTModel

TransformerImpl = Literal["local", "transformer_engine"]


def ffn_hidden_size(
    ffn_hidden_size: Optional[int], hidden_size: int, *, swiglu: bool = False
) -> int:
    """The dense MLP width: ``--ffn-hidden-size``, or Megatron-LM's default
    (``megatron/training/arguments.py``): ``4 * h``, or ``int(4h * 2/3 / 64) * 64`` with
    ``--swiglu`` (the parameter count of the 4h non-gated MLP, a multiple of 64)."""
    if ffn_hidden_size:
        return ffn_hidden_size
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's ``RowParallelLinear``, for the second linear layer of local experts.

    Why: when the experts are neither tensor- nor expert-parallel (expert TP = EP = 1),
    megatron-core passes this layer's output through an identity autograd function (the
    TP reduction over one rank), so it is a view; with biases on, megatron-core's expert MLP
    then adds the probability-scaled bias *in place* (``output += bias * per_token_scale`` in
    ``transformer/mlp.py``) and autograd raises "... is a view and is being modified
    inplace" at the first step. Over one rank that reduction is the identity, so this layer
    always takes megatron-core's own expert path (``explicit_expert_comm``: the output
    returned as computed, the bias handed back separately): the same numbers, no view.
    Parameters and checkpoint keys are those of ``RowParallelLinear``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Larger expert-TP or EP sizes set this already; at size 1 the skipped reduce is a no-op.
        self.explicit_expert_comm = self.is_expert


def _submodules(spec):
    """The ``submodules`` of a spec: a ``ModuleSpec`` (megatron-core <= 0.18) or, for MoE
    layers and experts from 0.19 on, a ``functools.partial(Module, submodules=...)``."""
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


def gpt_block_spec(
    config: TransformerConfig,
    *,
    transformer_impl: TransformerImpl = "local",
    vp_stage: Optional[int] = None,
) -> TransformerBlockSubmodules:
    """The decoder block spec for this pipeline stage (and virtual stage).

    ``transformer_impl="transformer_engine"`` returns megatron-core's TE spec (GPU; FP8).
    ``"local"`` returns megatron-core's local spec with every norm replaced by
    :class:`~tst_megatron.runtime.norm.SequenceParallelNorm`, so TP + SP + MoE runs without
    TE or Apex, and the experts' second linear layer by :class:`ExpertRowParallelLinear`, so
    MoE runs with biases. Dense/MoE layers follow ``config.moe_layer_freq`` as in megatron-core's
    ``get_gpt_decoder_block_spec``.

    Raises:
        ImportError: ``transformer_engine`` requested but Transformer Engine does not import.
        ConfigError: unknown ``transformer_impl``.
    """
    if transformer_impl == "transformer_engine":
        try:
            import transformer_engine  # noqa: F401
        except Exception as exc:  # ImportError, or OSError without CUDA libraries
            raise ImportError(
                "--transformer-impl transformer_engine needs Transformer Engine "
                f"(pip install 'tst-megatron[te]' on a CUDA machine): {exc}"
            ) from exc
        return get_gpt_decoder_block_spec(
            config,
            use_transformer_engine=True,
            normalization=config.normalization,
            vp_stage=vp_stage,
        )
    if transformer_impl != "local":
        raise ConfigError(
            f"--transformer-impl must be local or transformer_engine, got {transformer_impl!r}"
        )
    block = get_gpt_decoder_block_spec(
        config,
        use_transformer_engine=False,
        normalization=config.normalization,
        vp_stage=vp_stage,
    )
    return TransformerBlockSubmodules(
        layer_specs=[
            _with_expert_fc2(_with_norm(spec, SequenceParallelNorm)) for spec in block.layer_specs
        ],
        layer_norm=SequenceParallelNorm,
    )


def local_mtp_block_spec(config: TransformerConfig, *, vp_stage: Optional[int] = None):
    """The multi-token prediction block spec matching :func:`gpt_block_spec`'s local spec, or
    None when this stage builds no MTP layer (or ``config.mtp_num_layers`` is unset).

    megatron-core's ``get_gpt_mtp_block_spec`` (``use_transformer_engine=False``) on the last
    decoder layer's spec, as Megatron-LM's ``megatron.training.models.gpt.mtp_block_spec``
    builds it, with the changes :func:`gpt_block_spec` makes: every norm (the MTP layer's
    ``enorm``, ``hnorm``, ``layer_norm`` and those of its transformer layer) is
    :class:`~tst_megatron.runtime.norm.SequenceParallelNorm` (megatron-core's local norm
    refuses sequence parallelism) and the experts' second linear layer is
    :class:`ExpertRowParallelLinear`.
    """
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


def build_gpt_model(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope",
    rotary_base: int = 10000,
    rotary_percent: float = 1.0,
    seq_len_interpolation_factor: Optional[float] = None,
    share_embeddings_and_output_weights: bool = False,
    transformer_impl: TransformerImpl = "local",
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
) -> GPTModel:
    """Build one pipeline stage (or virtual stage) of a megatron-core ``GPTModel``.

    Args:
        config: the megatron-core ``TransformerConfig`` (MoE settings included).
        vocab_size: padded vocabulary size ``V`` (a multiple of TP).
        max_sequence_length: ``--max-position-embeddings``; also bounds learned positions.
        position_embedding_type: ``"rope"`` or ``"learned_absolute"``.
        rotary_base: RoPE base (``--rotary-base``).
        rotary_percent: share of each head's channels RoPE rotates (``--rotary-percent``).
        seq_len_interpolation_factor: ``--rotary-seq-len-interpolation-factor``.
        share_embeddings_and_output_weights: tied embeddings (not
            ``--untie-embeddings-and-output-weights``).
        transformer_impl: see :func:`gpt_block_spec`.
        pre_process / post_process: whether this stage holds the embedding / output layer.
        vp_stage: virtual pipeline stage index for interleaved schedules.

    Returns:
        The ``GPTModel`` with ``parallel_output=True`` (logits stay vocab-parallel,
        ``[b, T, V/tp]`` when called with ``labels=None``).

    Raises:
        ConfigError / ImportError: see :func:`gpt_block_spec`.
    """
    model = TSTGPTModel(  # a GPTModel with the bag loss in its loss seam (see training/gpt.py)
        config=config,
        transformer_layer_spec=gpt_block_spec(
            config, transformer_impl=transformer_impl, vp_stage=vp_stage
        ),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        position_embedding_type=position_embedding_type,
        rotary_base=rotary_base,
        rotary_percent=rotary_percent,
        seq_len_interpolation_factor=seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )
    tag_expert_grad_reduction(model, config)
    return model


def tag_expert_grad_reduction(model, config: TransformerConfig) -> None:
    """Tag every expert parameter of ``model`` with the group its gradient is summed over.

    An expert's gradient is the sum over the ranks that run it on some tokens: its expert
    data-parallel group whenever EP > 1 or expert TP differs from TP (megatron-core's DDP
    and optimizer take ``allreduce=False`` for that group; ``True`` means the DP group).
    megatron-core 0.19 tags so (``use_expert_pgs`` in ``tensor_parallel/layers.py``);
    0.16.1 tags ``allreduce=True`` whenever EP = 1, so at expert TP 1 < TP each TP rank kept
    the gradient of its own ``T/tp`` positions (the replicas drifted), and at expert TP > TP
    the DP sum added different shards. Both releases also tag the experts' second-layer bias
    ``sequence_parallel`` (a ``RowParallelLinear`` bias), which ``finalize_model_grads`` sums
    over TP on top: twice the gradient at EP 1, another expert's gradient added at EP > 1.
    Such a parameter is whole on each rank of its expert-DP group, which already holds
    every contribution, so the TP sum is dropped. Expert TP = TP with EP 1 keeps
    megatron-core's tags (the DP group; biases there need TP = expert TP = 1, no SP).

    Args:
        model: a freshly built ``GPTModel`` stage, before DDP wraps it (DDP and the optimizer
            read the tags when they are built). Changed in place; shared experts are dense
            layers and keep their tags.
        config: its ``TransformerConfig`` (``expert_model_parallel_size``,
            ``expert_tensor_parallel_size``, ``tensor_model_parallel_size``).
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


def build_model(cfg, config: TransformerConfig, *, vocab_size: int, vp_stage: Optional[int] = None):
    """The ``GPTModel`` of run configuration ``cfg`` for this pipeline stage (and virtual stage).

    The one place that turns a :class:`~tst_megatron.training.config.RunConfig` into a model:
    the trainer calls it per virtual pipeline stage, the checkpoint converter in a 1-process
    world. Whether the stage holds the embedding / output layer comes from megatron-core's
    parallel state (initialised before the call). The ``GPTModel`` arguments are those
    Megatron-LM's GPT builder passes (``megatron/training/models/gpt.py``, megatron-core
    0.19): ``--max-position-embeddings``, ``--position-embedding-type``, ``--rotary-base``,
    ``--rotary-percent``, ``--rotary-seq-len-interpolation-factor`` and tied embeddings.

    Args:
        cfg: the run configuration (``cfg.model`` and ``cfg.train.transformer_impl`` are read).
        config: ``transformer_config(cfg, ...)`` (shared by all stages of a rank).
        vocab_size: padded vocabulary size ``V`` (:func:`padded_vocab_size`).
        vp_stage: virtual pipeline stage index, or None when not interleaved.

    Returns:
        The ``GPTModel`` on the CPU (or where ``config`` initialises it); see :func:`build_gpt_model`.
    """
    m = cfg.model
    return build_gpt_model(
        config,
        vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings or m.seq_length,
        position_embedding_type=m.position_embedding_type,
        rotary_base=m.rotary_base,
        rotary_percent=m.rotary_percent,
        seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        transformer_impl=cfg.train.transformer_impl,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )


def padded_vocab_size(vocab_size: int, *, divisible_by: int, tp: int) -> int:
    """Megatron-LM's padding: the smallest multiple of ``divisible_by * tp`` >= ``vocab_size``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def transformer_config(cfg, *, use_cpu_initialization: bool) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` from a :class:`~tst_megatron.training.config.RunConfig`."""
    import torch
    from megatron.core.transformer.enums import AttnBackend

    from tst_megatron.training.config import moe_layer_pattern

    m, moe, p, t = cfg.model, cfg.moe, cfg.parallel, cfg.train
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    pcfg = p.to_parallel_config(m.num_layers)
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_size(),
        num_attention_heads=m.num_attention_heads,
        kv_channels=m.kv_channels,
        layernorm_epsilon=m.norm_epsilon,
        num_query_groups=m.num_query_groups if m.group_query_attention else None,
        normalization=m.normalization,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        add_bias_linear=not m.disable_bias_linear,
        add_qkv_bias=not m.disable_bias_linear,  # Megatron-LM's validate_args keeps them equal
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        layernorm_zero_centered_gamma=m.apply_layernorm_1p,
        attention_backend=AttnBackend[m.attention_backend],
        masked_softmax_fusion=m.masked_softmax_fusion and not use_cpu_initialization,  # CUDA
        cross_entropy_loss_fusion=t.cross_entropy_loss_fusion,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        **dataclasses.asdict(pcfg),  # the same names as megatron-core's ModelParallelConfig
        sequence_parallel=t.sequence_parallel,
        use_cpu_initialization=use_cpu_initialization,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.moe_ffn_hidden_size or m.ffn_size(),
        moe_router_topk=moe.moe_router_topk,
        moe_router_load_balancing_type=moe.moe_router_load_balancing_type,
        moe_aux_loss_coeff=moe.moe_aux_loss_coeff,
        moe_z_loss_coeff=moe.moe_z_loss_coeff,
        moe_router_score_function=moe.moe_router_score_function,
        moe_router_pre_softmax=moe.moe_router_pre_softmax,
        moe_router_dtype=moe.moe_router_dtype,
        moe_token_dispatcher_type=moe.moe_token_dispatcher_type,
        moe_grouped_gemm=moe.moe_grouped_gemm,
        moe_layer_recompute=moe.moe_layer_recompute,
        moe_layer_freq=moe.moe_layer_freq
        if isinstance(moe.moe_layer_freq, int)
        else moe_layer_pattern(moe.moe_layer_freq, m.num_layers),
        moe_router_enable_expert_bias=moe.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=moe.moe_router_bias_update_rate,
        moe_router_topk_scaling_factor=moe.moe_router_topk_scaling_factor,
        moe_router_num_groups=moe.moe_router_num_groups,
        moe_router_group_topk=moe.moe_router_group_topk,
        moe_router_force_load_balancing=moe.moe_router_force_load_balancing,
        moe_permute_fusion=moe.moe_permute_fusion,
        moe_shared_expert_intermediate_size=moe.moe_shared_expert_intermediate_size,
        moe_expert_capacity_factor=moe.moe_expert_capacity_factor,
        calculate_per_token_loss=True,
        # Megatron-LM's pipeline p2p settings: the interleaved schedule overlaps separate
        # isend/irecv calls with compute, the others batch them. Separate calls also keep
        # PP = 2 with virtual stages exact: there the previous and the next stage are the
        # same rank, and a batch of sends and receives to it pairs them up in the wrong order
        # (activations arrive as gradients and back), silently.
        overlap_p2p_comm=pcfg.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=pcfg.virtual_pipeline_model_parallel_size is None,
    )
    if t.recompute_modules is not None:
        kwargs["recompute_modules"] = list(t.recompute_modules)
    if t.fp8_format:
        kwargs.update(
            fp8=t.fp8_format,
            fp8_recipe=t.fp8_recipe,
            fp8_amax_history_len=t.fp8_amax_history_len,
            fp8_amax_compute_algo=t.fp8_amax_compute_algo,
            fp8_param=t.fp8_param_gather,
        )
    if not moe.num_experts:
        for key in [k for k in kwargs if k.startswith("moe_")]:
            kwargs.pop(key)
    return TransformerConfig(**kwargs)
