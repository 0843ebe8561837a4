"""A ``HybridModel``'s ``--hybrid-layer-pattern``, read once by megatron-core's own
``parse_hybrid_pattern`` (``hybrid_layer_allocation.py``) for the dry run, the launch rules and
the checkpoint converter (a launch parses it once, into ``Launch.pattern``): the layer kinds
by symbol (:data:`LAYER_KINDS`), the pipeline stages, the MTP part, and
the ``GPTModel`` a GPT-shaped pattern equals (:func:`gpt_equivalent`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Optional

from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols, parse_hybrid_pattern


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of ``HybridModel`` layer.

    Attributes:
        name: what the dry run and the rules call it.
        needs: what it needs beyond megatron-core's local modules (which build attention,
            MLP and MoE layers only: :func:`~tst_megatron.models.hybrid.local_hybrid_stack_spec`),
            or None.
        package: the package megatron-core 0.19.2 imports for it on a GPU (``ssm/mamba_mixer.py``
            imports ``mamba_ssm``, ``ssm/gated_delta_net.py`` ``fla``), or None.
    """

    name: str
    needs: Optional[str] = None
    package: Optional[str] = None


#: The layer kinds of ``--hybrid-layer-pattern`` by megatron-core's symbol (``Symbols``): the
#: one table of them.
LAYER_KINDS = {
    Symbols.MAMBA: LayerKind(
        "Mamba-2", "the mamba_ssm package (its Triton kernels need a GPU)", "mamba_ssm"
    ),
    Symbols.GDN: LayerKind(
        "gated delta net", "the fla package (flash-linear-attention; Triton, a GPU)", "fla"
    ),
    Symbols.ATTENTION: LayerKind("attention"),
    Symbols.DS_ATTENTION: LayerKind(
        "DeepSeek sparse attention", "Transformer Engine (megatron-core's TE spec)"
    ),
    Symbols.MLA: LayerKind(
        "MLA", "Transformer Engine (megatron-core's TE spec; its local MLA does not run)"
    ),
    Symbols.MLP: LayerKind("MLP"),
    Symbols.MOE: LayerKind("MoE"),
}

#: The main part of a ``HybridModel`` pattern that is a ``GPTModel``: each attention layer
#: ``*`` followed by its MLP (``-``) or MoE (``E``) layer. megatron-core's migration guide
#: (``docs/user-guide/hybrid-model-migration.md``) maps a GPT block onto ``*-`` / ``*E``, and
#: ``dist_checkpointing.gpt_checkpoint_interop.gpt_compatible_layer_maps`` pairs the i-th
#: ``*`` and the i-th MLP layer with GPT layer i; adjacent pairs compute what the GPT layer
#: computes (a pre-norm residual attention block, then a pre-norm residual MLP block).
GPT_SHAPED = re.compile(r"(\*[-E])+")


@dataclasses.dataclass(frozen=True)
class HybridPattern:
    """``--hybrid-layer-pattern`` ``text``, split as megatron-core 0.19.2 splits it.

    Attributes:
        text: the pattern as given.
        segments: the main part's pipeline segments (split at ``|``; one without ``|``).
        mtp: the layers of one MTP depth (after ``/``), or ``""``.
        mtp_depths: how many MTP depths (``/`` parts).
    """

    text: str
    segments: tuple
    mtp: str
    mtp_depths: int

    @classmethod
    def parse(cls, text: str) -> "HybridPattern":
        """``text`` by ``parse_hybrid_pattern``.

        Raises:
            ValueError: megatron-core's: a symbol it does not know, MTP parts that differ,
                attention together with MLA or DSA.
        """
        parsed = parse_hybrid_pattern(text)
        main = parsed.main_pattern or ""
        return cls(
            text=text,
            segments=tuple(main.split(Symbols.PIPE)),
            mtp=parsed.mtp_pattern or "",
            mtp_depths=parsed.mtp_num_depths,
        )

    @staticmethod
    def main_of(text: str) -> str:
        """The main layers of ``text`` without ``|`` and the MTP part, split as megatron-core
        does but without its symbol checks (for a command line not yet parsed)."""
        return text.split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, "")

    @property
    def main(self) -> str:
        """The main layers, one symbol each, without ``|``."""
        return "".join(self.segments)

    def count(self, symbol: str) -> int:
        """How many main layers of ``symbol``."""
        return self.main.count(symbol)

    def has(self, symbol: str) -> bool:
        """Whether ``symbol`` is a layer of the main part or of the MTP part."""
        return symbol in self.main or symbol in self.mtp

    def stage_layers(self, pp: int) -> list[str]:
        """The layer symbols of each pipeline rank at PP ``pp``, as megatron-core 0.19.2's
        ``select_pipeline_segment`` assigns them: with ``|``, segment ``v * pp + r`` to rank
        ``r`` (virtual stage ``v``); without, an even split of the layers
        (``--decoder-first/last-pipeline-num-layers`` are not modelled)."""
        if len(self.segments) > 1:
            return [
                "".join(self.segments[i] for i in range(r, len(self.segments), pp))
                for r in range(pp)
            ]
        per = len(self.main) // pp
        return [self.main[r * per : (r + 1) * per] for r in range(pp)]

    @property
    def gpt_shaped(self) -> bool:
        """Whether the main part is ``*-``/``*E`` pairs (:data:`GPT_SHAPED`) without MTP."""
        return not self.mtp_depths and bool(GPT_SHAPED.fullmatch(self.main))

    @property
    def counted_as_gpt(self) -> bool:
        """:attr:`gpt_shaped` with pipeline segments of equal length: Megatron-LM's
        parameter arithmetic then counts it as :func:`gpt_equivalent`'s model."""
        return (
            self.gpt_shaped
            and all(GPT_SHAPED.fullmatch(s) for s in self.segments)
            and len({len(s) for s in self.segments}) == 1
        )


def pattern_of(args) -> Optional[HybridPattern]:
    """The :class:`HybridPattern` of Megatron-LM's ``args`` (a launch's or a checkpoint's), or
    None for a ``GPTModel``'s."""
    text = getattr(args, "hybrid_layer_pattern", None)
    return HybridPattern.parse(text) if text else None


def gpt_arguments(args, pattern: Optional[HybridPattern]):
    """The arguments of the ``GPTModel`` a model equals, which Megatron-LM's parameter
    arithmetic counts: ``args`` for a ``GPTModel`` (``pattern`` None), :func:`gpt_equivalent`
    for a :attr:`~HybridPattern.gpt_shaped` ``HybridModel``, else None (Mamba, gated delta net
    layers)."""
    if pattern is not None and not pattern.gpt_shaped:
        return None
    return gpt_equivalent(args, pattern)


def gpt_equivalent(args, pattern: Optional[HybridPattern] = None):
    """The ``args`` of the ``GPTModel`` a GPT-shaped ``HybridModel``'s ``args`` equals
    (``args`` itself for a ``GPTModel``): no pattern, one layer per ``*X`` pair, MoE layers
    where the pattern has ``E`` (``--moe-layer-freq`` as a 0/1 list), no experts without any
    ``E``. The pattern must be :attr:`HybridPattern.gpt_shaped`; ``pattern``: ``args``'s
    parsed one where the caller holds it (a launch's ``Launch.pattern``), else parsed here."""
    pattern = pattern or pattern_of(args)
    if pattern is None:
        return args
    out = copy.copy(args)
    out.hybrid_layer_pattern = None
    kinds = pattern.main[1::2]
    out.num_layers = len(kinds)
    if Symbols.MOE in kinds:
        out.moe_layer_freq = [int(k == Symbols.MOE) for k in kinds]
    else:  # and what validate_args filled in for --num-experts
        out.num_experts = None
        out.moe_layer_freq = 1
        out.moe_ffn_hidden_size = out.moe_shared_expert_intermediate_size = None
    return out
