"""The trainer with ``--tst-mode input`` and ``output`` at TP=2 + SP (2 gloo processes):
through the switch, the tokens each mode reads, and checkpoints with a baseline's keys."""

import os

import pytest
import torch

from tests.distributed.harness import run_distributed
from tests.distributed.test_trainer import BASE, N1, N, _keys_child, _train_child

GBS, T, S = 4, 16, 4  # BASE's global batch, sequence length and bag size


def _tokens_seen(tb):
    from tst_megatron.plots import read_scalars

    points = read_scalars(tb)["tst-phase vs tokens"]
    return int(points[-1][0])


@pytest.fixture(scope="module")
def baseline_keys(tmp_path_factory):
    """The checkpoint keys of a 1-step baseline run (S = 1) of the same model."""
    root = tmp_path_factory.mktemp("baseline")
    argv = [a for a in BASE]
    argv[argv.index("--tst-bag-size") + 1] = "1"
    argv[argv.index("--tst-phase1-iters") + 1] = "0"
    argv[argv.index("--lr-warmup-iters") + 1] = "0"
    run_distributed(_train_child, 1, argv=argv + ["--train-iters", "1", "--save", str(root)])
    (keys,) = run_distributed(_keys_child, 1, path=str(root / "iter_0000001"))
    return keys


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["input", "output"])
def test_mode_trains_through_switch_at_tp2(mode, tmp_path, baseline_keys):
    argv = BASE + [
        "--tst-mode",
        mode,
        "--tensor-model-parallel-size",
        "2",
        "--sequence-parallel",
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        str(N),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    ]
    ranks = run_distributed(_train_child, 2, argv=argv)
    history = ranks[0]["train"]
    assert sorted(history) == list(range(1, N + 1))
    assert all(torch.isfinite(torch.tensor(v)) for v in history.values())
    phase1_tokens = S * T if mode == "input" else T  # output reads what the baseline reads
    assert _tokens_seen(str(tmp_path / "tb")) == GBS * (N1 * phase1_tokens + (N - N1) * T)
    # the switch checkpoint (saved by default) has exactly a baseline run's keys
    (mode_keys,) = run_distributed(_keys_child, 1, path=str(tmp_path / "ckpt" / f"iter_{N1:07d}"))
    assert mode_keys == baseline_keys and "decoder.layers.mlp.router.weight" in mode_keys
    assert os.path.isdir(tmp_path / "ckpt" / f"iter_{N:07d}")
    if mode == "output":  # resuming under another mode would change the run: refused by name
        argv = BASE + ["--tst-mode", "input", "--load", str(tmp_path / "ckpt")]
        with pytest.raises(
            AssertionError, match="saved with tst mode='output' but this run has 'input'"
        ):
            run_distributed(_train_child, 1, argv=argv)
