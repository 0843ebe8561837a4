"""A norm for megatron-core's local (non-Transformer-Engine) layer spec that supports
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

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


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
