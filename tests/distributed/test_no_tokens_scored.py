"""A step or validation round that scores no token says so, and
``--eval-iters 0`` skips validation: never a made-up loss of 0.000 / PPL 1.0.

Input: every token is the end-of-document id and ``--eod-mask-loss`` masks every label,
through the TST switch (phase 1 and phase 2, validation in both).
"""

import numpy as np
import pytest
import torch

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

V = 128  # NullTokenizer: EOD is the last id
ARGV = [
    *TEST_DEFAULTS,
    "--vocab-size",
    str(V),
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "2",
    "--tst-bag-size",
    "2",
    "--tst-phase1-iters",
    "1",
    "--log-interval",
    "1",
    "--eval-interval",
    "1",
    "--device",
    "cpu",
]


def _write_all_eod(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(64):
        builder.add_document(torch.full((32,), V - 1, dtype=torch.int32), [32])
    builder.finalize(prefix + ".idx")


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    return trainer.train(parse_args(argv))


@pytest.mark.slow
def test_all_masked_run_reports_no_tokens_and_eval_iters_0_skips_validation(tmp_path, capfd):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    prefix = str(tmp_path / "eod")
    _write_all_eod(prefix)
    data = ["--data-path", prefix, "--split", "80,20,0", "--eod-mask-loss"]
    tb = tmp_path / "tb"
    (history,) = run_distributed(
        _train_child,
        1,
        argv=ARGV + data + ["--eval-iters", "1", "--tensorboard-dir", str(tb)],
    )
    assert history["train"] == {1: None, 2: None}  # phase 1, then phase 2
    assert history["valid"] == {1: None, 2: None}
    out = capfd.readouterr().out
    assert out.count("mce loss: n/a (no tokens scored) |") == 1
    assert out.count("| lm loss: n/a (no tokens scored) |") == 1 + 2  # 1 train, 2 validation
    assert "lm loss PPL: n/a (no tokens scored)" in out and "0.000000E+00" not in out
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "learning-rate" in tags and not tags & {"mce loss", "lm loss", "validation lm loss"}

    (history,) = run_distributed(_train_child, 1, argv=ARGV + ["--mock-data", "--eval-iters", "0"])
    assert history["valid"] == {} and sorted(history["train"]) == [1, 2]
    assert "validation" not in capfd.readouterr().out
