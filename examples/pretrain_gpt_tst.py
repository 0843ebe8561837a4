"""pretrain_gpt-style TST pretraining: Megatron-LM's flags plus --tst-*.

    torchrun --nproc_per_node 2 examples/pretrain_gpt_tst.py --device cpu --mock-data \
        --vocab-size 512 --untie-embeddings-and-output-weights --num-experts 4 \
        --expert-model-parallel-size 2 --tst-bag-size 4 --tst-phase1-fraction 0.3

Run with --help for every flag. All logic lives in tst_megatron.training.trainer.
"""

import sys

from tst_megatron.quiet import quiet_known_warnings

quiet_known_warnings()  # before megatron-core is imported

from tst_megatron.training.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
