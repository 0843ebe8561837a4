"""Megatron-LM's ``pretrain_hybrid.py`` with Token Superposition Training: megatron-core's
``HybridModel`` (``--hybrid-layer-pattern``) in Megatron-LM's own training loop
(``megatron.training.pretrain()``, megatron-core 0.19) with the ``--tst-*`` flags. Launch it
as ``pretrain_hybrid.py`` (torchrun, the same flags) with ``--tst-bag-size`` added;
``--device cpu`` (or no CUDA) runs attention, MLP and MoE layers (``*``, ``-``, ``E``) on the
CPU with gloo. See ``tst_megatron/training/cli.py`` and ``tst_megatron/models/hybrid.py``.
"""

from tst_megatron.quiet import quiet_missing_package_notices

quiet_missing_package_notices()  # before megatron-core is imported

from tst_megatron.models.family import HYBRID  # noqa: E402
from tst_megatron.training.cli import main  # noqa: E402

if __name__ == "__main__":  # dist_checkpointing spawns processes: keep the guard
    main(family=HYBRID)
