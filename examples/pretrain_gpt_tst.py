"""Megatron-LM's ``pretrain_gpt.py`` with Token Superposition Training: Megatron-LM's own
training loop (``megatron.training.pretrain()``, megatron-core 0.19) with the ``--tst-*``
flags. Launch it as ``pretrain_gpt.py`` (torchrun, the same flags) with ``--tst-bag-size`` added;
``--device cpu`` (or no CUDA) runs on the CPU with gloo. See
``tst_megatron/training/cli.py``.
"""

from tst_megatron.quiet import quiet_missing_package_notices

quiet_missing_package_notices()  # before megatron-core is imported

from tst_megatron.training.cli import main  # noqa: E402

if __name__ == "__main__":  # dist_checkpointing spawns processes: keep the guard
    main()
