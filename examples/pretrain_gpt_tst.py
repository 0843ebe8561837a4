"""pretrain_gpt-style TST pretraining: Megatron-LM's flags plus --tst-*.

    torchrun --nproc_per_node 2 examples/pretrain_gpt_tst.py --device cpu --mock-data \
        --vocab-size 512 --untie-embeddings-and-output-weights --num-experts 4 \
        --expert-model-parallel-size 2 --tst-bag-size 4 --tst-phase1-fraction 0.3

Run with --help for every flag. All logic lives in tst_megatron.training.trainer.
"""

import sys
import warnings

# Expected on machines without Transformer Engine/Apex, and upstream deprecations that the
# user cannot act on: keep them out of the training log.
for _message in ("Transformer Engine and Apex are not installed", "Apex is not installed",
                 "full scope is deprecated", r"`torch.distributed.\w+` is deprecated"):
    warnings.filterwarnings("ignore", message=_message)

from tst_megatron.training.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
