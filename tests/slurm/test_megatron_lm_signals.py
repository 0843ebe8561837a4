"""A preemption notice (SIGTERM to the tasks) that arrives while Megatron-LM's loop is still
setting up (building the model, loading a checkpoint: minutes on a cluster) is not lost: with
``--exit-signal-handler`` the run takes one step, saves and exits with status 0, which the
sbatch template trusts before requeueing."""

import contextlib
import io
import os
import signal

from tests.distributed.harness import run_distributed
from tests.distributed.test_megatron_lm import BASE


def _signal_during_setup_child(rank, world, *, argv):
    import dataclasses

    from tst_megatron.models.family import GPT
    from tst_megatron.training.cli import main

    def build_after_signal(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the notice arrives before the model exists
        return GPT.build(*args, **kwargs)

    family = dataclasses.replace(GPT, build=build_after_signal)
    out = io.StringIO()
    status = None
    with contextlib.redirect_stdout(out):
        try:
            main(argv, family=family)
        except SystemExit as exc:  # Megatron-LM's train() exits after a signal save
            status = exc.code
    return status, out.getvalue()


def test_sigterm_during_setup_saves_after_first_step(tmp_path):
    argv = BASE + ["--exit-signal-handler", "--save", str(tmp_path), "--save-interval", "1000"]
    argv += ["--train-iters", "50"]
    ((status, printed),) = run_distributed(_signal_during_setup_child, 1, argv=argv)
    assert status in (0, None), printed[-3000:]
    assert "exiting program after receiving SIGTERM" in printed, printed[-3000:]
    assert " iteration        1/      50 |" in printed
    assert " iteration        2/" not in printed
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert (tmp_path / "iter_0000001").is_dir()
