"""The settings the tests were written for, passed explicitly.

The trainer's flags default to Megatron-LM's (``--position-embedding-type learned_absolute``,
``--normalization LayerNorm``, ``--adam-beta2 0.999``, ...) and some are required
(``--num-layers``, ``--lr``, ``--train-iters`` ...). Tests put this list first and
override single values after it (argparse keeps the last value).
"""

TEST_DEFAULTS = [
    "--num-layers", "4",
    "--hidden-size", "128",
    "--num-attention-heads", "4",
    "--seq-length", "128",
    "--micro-batch-size", "2",
    "--train-iters", "100",
    "--lr", "3e-4",
    "--tokenizer-type", "NullTokenizer",
    "--position-embedding-type", "rope",
    "--normalization", "RMSNorm",
    "--adam-beta2", "0.95",
    "--lr-decay-style", "WSD",
    "--lr-wsd-decay-style", "linear",
    "--moe-token-dispatcher-type", "alltoall",
    "--log-interval", "10",
    "--eval-iters", "2",
    "--num-workers", "0",
    "--transformer-impl", "local",
]  # fmt: skip
