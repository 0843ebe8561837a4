"""The local layer pieces both model families share (``GPTModel``: :mod:`.gpt`;
``HybridModel``: :mod:`.hybrid`): a norm that runs sequence parallelism, megatron-core's local
layer specs with it, the experts' second linear layer, the expert-gradient tags, and the
constructor arguments both models take from Megatron-LM's config.

:class:`SequenceParallelNorm`: A norm for megatron-core's local (non-Transformer-Engine) layer spec that supports
sequence parallelism, so TP > 1 with MoE runs without TE or Apex.

megatron-core's ``WrappedTorchNorm`` refuses ``config.sequence_parallel``, and
megatron-core refuses MoE with TP > 1 unless sequence parallelism is on. Under SP each TP
rank normalises its own ``T/tp`` slice of the sequence, so the norm's weight gradient is
partial on each rank; ``finalize_model_grads`` sums it across the TP group for every
parameter marked ``sequence_parallel = True`` (megatron-core
``distributed/finalize_model_grads.py``, ``_allreduce_non_tensor_model_parallel_grads``).
That marking is all this module adds to ``torch.nn.RMSNorm`` / ``torch.nn.LayerNorm``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import BaseMoELayer
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from tst_megatron.runtime import cpu


class SequenceParallelNorm:
    """Factory with the signature megatron-core's ``build_module`` gives a norm.

    ``SequenceParallelNorm(config, hidden_size, eps)`` returns a ``torch.nn.RMSNorm`` or
    ``torch.nn.LayerNorm`` (by ``config.normalization``) over the last dimension ``h``,
    input ``[..., h]`` in any float dtype, parameters in ``config.params_dtype``, with
    ``param.sequence_parallel = config.sequence_parallel`` on every parameter.

    Raises:
        ValueError: ``config.normalization`` is not ``"LayerNorm"`` or ``"RMSNorm"``, or a
            setting this plain torch norm cannot honour is on
            (``layernorm_zero_centered_gamma``).
    """

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine or Apex")
        if config.normalization == "RMSNorm":
            norm_cls = torch.nn.RMSNorm
        elif config.normalization == "LayerNorm":
            norm_cls = torch.nn.LayerNorm
        else:
            raise ValueError(
                f"normalization {config.normalization!r} is not supported by the local spec; "
                "use LayerNorm or RMSNorm"
            )
        device = "cpu" if config.use_cpu_initialization else None
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


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


def local_layer(spec):
    """A local transformer layer ``spec`` with the project's pieces: every norm a
    :class:`SequenceParallelNorm` (TP + SP + MoE without TE or Apex) and a local MoE's expert
    ``linear_fc2`` an :class:`ExpertRowParallelLinear` (MoE with biases)."""
    return _with_expert_fc2(_with_norm(spec, SequenceParallelNorm))


def local_layer_specs(config: TransformerConfig):
    """megatron-core's local dense and MoE transformer layer specs (``get_gpt_layer_local_spec``,
    as ``get_gpt_decoder_layer_specs`` builds them for ``--transformer-impl local``) with
    :class:`SequenceParallelNorm` norms and :class:`ExpertRowParallelLinear` expert fc2:
    ``(dense, moe)``, ``moe`` None without ``--num-experts``. The layers of
    :func:`tst_megatron.models.hybrid.local_hybrid_stack_spec`.
    """

    def local(num_experts):
        spec = get_gpt_layer_local_spec(
            num_experts=num_experts,
            moe_grouped_gemm=config.moe_grouped_gemm if num_experts else False,
            qk_layernorm=config.qk_layernorm,
            multi_latent_attention=config.multi_latent_attention,
            normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm,
        )
        return local_layer(spec)

    return local(None), (local(config.num_moe_experts) if config.num_moe_experts else None)


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


def model_arguments(args, cfg, **stage) -> dict:
    """The constructor arguments ``GPTModel`` and ``HybridModel`` share, as Megatron-LM 0.19.2's
    ``GPTModelBuilder``/``HybridModelBuilder.build_model`` pass them (those builders name their
    own class, so they cannot build a subclass): from Megatron-LM's ``args`` (the padded
    vocabulary), its model config ``cfg`` (``gpt_config_from_args`` or
    ``hybrid_config_from_args``) and this ``stage`` (``pre_process``, ``post_process``,
    ``vp_stage``, ``pg_collection``)."""
    return dict(
        config=cfg.transformer,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=cfg.seq_length,
        fp16_lm_cross_entropy=cfg.fp16_lm_cross_entropy,
        parallel_output=cfg.parallel_output,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base,
        seq_len_interpolation_factor=cfg.seq_len_interpolation_factor,
        **stage,
    )


def ready_for_ddp(model, config: TransformerConfig):
    """``model`` ready for Megatron-LM's DDP: expert gradients tagged
    (:func:`tag_expert_grad_reduction`, before DDP reads the tags) and, in a CPU run, kept on
    the CPU (:func:`tst_megatron.runtime.cpu.keep_on_cpu`)."""
    tag_expert_grad_reduction(model, config)
    return cpu.keep_on_cpu(model) if cpu.is_enabled() else model
