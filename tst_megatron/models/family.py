"""The model families a TST launch builds, one :class:`ModelFamily` object each (as
torchtitan's ``TrainSpec``): :data:`GPT` (Megatron-LM's ``pretrain_gpt.py``, a
``GPTModel``: :mod:`.gpt`) and :data:`HYBRID` (``pretrain_hybrid.py``, a ``HybridModel``:
:mod:`.hybrid`). The launcher (:mod:`tst_megatron.training.cli`), the checks (the launch
record :class:`~tst_megatron.training.checks.Launch`) and the checkpoint converter
(:mod:`tst_megatron.conversion`) take the object. Each family's own launch rules live in the
launch layer (:data:`tst_megatron.training.checks.model.FAMILY_RULES`), which imports this
module and never the other way.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from tst_megatron.models.gpt import build_gpt_model_from_args
from tst_megatron.models.hybrid import build_hybrid_model_from_args


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    """One model family.

    Attributes:
        name: ``"gpt"`` or ``"hybrid"``: Megatron-LM's script name without ``pretrain_``.
        launcher: the launch script (``examples/pretrain_gpt_tst.py``, ...).
        build: ``build(args, *, pre_process, post_process, vp_stage, config,
            pg_collection)`` -> the TST model for Megatron-LM's ``args``.
    """

    name: str
    launcher: str
    build: Callable

    def model_provider(
        self,
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: Optional[int] = None,
        config=None,
        pg_collection=None,
    ):
        """Megatron-LM's model provider (``pretrain_gpt.py``'s or ``pretrain_hybrid.py``'s):
        :attr:`build` on Megatron-LM's global ``args``. The first call starts CUDA's allocator
        history with ``--record-memory-history``, as Megatron-LM's providers do
        (``start_memory_history_recording``, which reads those flags of ``args``)."""
        # megatron.training (Megatron-LM) is heavy and optional for megatron-core users
        from megatron.training import get_args
        from megatron.training.utils import start_memory_history_recording

        if not _recording:  # once per process
            start_memory_history_recording(get_args())
            _recording.append(True)
        return self.build(
            get_args(),
            pre_process=pre_process,
            post_process=post_process,
            vp_stage=vp_stage,
            config=config,
            pg_collection=pg_collection,
        )


_recording: list = []  # not empty once a model provider has started the memory history

GPT = ModelFamily(
    name="gpt", launcher="examples/pretrain_gpt_tst.py", build=build_gpt_model_from_args
)
HYBRID = ModelFamily(
    name="hybrid", launcher="examples/pretrain_hybrid_tst.py", build=build_hybrid_model_from_args
)
#: The families by :attr:`ModelFamily.name`.
FAMILIES = {family.name: family for family in (GPT, HYBRID)}


def family_of(args) -> ModelFamily:
    """The family of Megatron-LM's ``args`` (a checkpoint's): :data:`HYBRID` with a
    ``--hybrid-layer-pattern``, else :data:`GPT`."""
    return HYBRID if getattr(args, "hybrid_layer_pattern", None) else GPT
