"""Megatron-LM's ``pretrain_hybrid.py`` with Token Superposition Training: megatron-core's
``HybridModel`` (``--hybrid-layer-pattern``) in Megatron-LM's own training loop
(``megatron.training.pretrain()``, megatron-core 0.19) with the ``--tst-*`` flags. Launch it
as ``pretrain_hybrid.py`` (torchrun, the same flags) with ``--tst-bag-size`` added;
``--device cpu`` (or no CUDA) runs attention, MLP and MoE layers (``*``, ``-``, ``E``) on the
CPU with gloo. See ``tst_megatron/training/cli.py`` and ``tst_megatron/training/hybrid.py``.
"""

import warnings

# megatron-core announces at import each optional package it lacks (Transformer Engine, Apex):
# about ten UserWarning lines before any output. The launcher refuses in one line every
# setting that needs one of them, so these notices are hidden.
for _notice in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    r"Only transformer-engine>=1\.7\.0 supports MoE experts",
):
    warnings.filterwarnings("ignore", message=_notice, category=UserWarning)

from tst_megatron.training.cli import main  # noqa: E402

if __name__ == "__main__":  # dist_checkpointing spawns processes: keep the guard
    main(model="hybrid")
