"""pretrain_gpt-style TST pretraining: Megatron-LM's flags plus --tst-*.

    torchrun --nproc_per_node 2 examples/pretrain_gpt_tst.py --mock-data --vocab-size 512 \
        --num-experts 4 --expert-model-parallel-size 2 --tst-bag-size 4 --tst-phase1-fraction 0.3

Run with --help for every flag. All logic lives in tst_megatron.training.trainer.
"""

import sys

from tst_megatron.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
