"""A preemption notice (SIGTERM to the tasks) that arrives while the trainer is still setting
up (building the model, loading a checkpoint: minutes on a cluster) is not lost: the trainer
takes one step, saves and exits, instead of dying without a status the batch script trusts."""

import os
import signal

from tests.distributed.harness import run_distributed
from tests.distributed.test_trainer import BASE


def _signal_during_setup_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    real_setup = trainer.setup

    def setup_after_signal(cfg):
        os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives before the model exists
        return real_setup(cfg)

    trainer.setup = setup_after_signal
    return trainer.train(parse_args(argv))


def test_sigterm_during_setup_saves_after_first_step(tmp_path):
    (history,) = run_distributed(
        _signal_during_setup_child,
        1,
        argv=BASE + ["--exit-signal-handler", "--save", str(tmp_path), "--train-iters", "50"],
    )
    assert history["exit"] == "signal"
    assert sorted(history["train"]) == [1]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
