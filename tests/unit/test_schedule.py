"""The phase plan and the loop's decisions, as tables (TorchTitan decides checkpoints and
validation the same way: pure functions of the step, tested row by row)."""

import types

import pytest

from tst_megatron.superposition.schedule import (
    Phase,
    Schedule,
    TSTConfig,
    should_eval,
    should_exit,
    should_save,
)


def test_phase_schedule_is_a_pure_function_of_the_step():
    schedule = Schedule.plan(
        TSTConfig(bag_size=4, phase1_fraction=0.3), seq_length=32, train_iters=10
    )
    phases = [schedule.phase_at(i) for i in range(10)]
    assert schedule.n1 == 3
    assert phases[:3] == [Phase(1, 4, 128, 32, 0)] * 3
    assert phases[3:] == [Phase(2, 1, 32, 32, 3)] * 7
    # phase-local data steps: phase 2 starts its own data at 0
    assert [p.data_step(i) for i, p in enumerate(phases)] == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6]
    assert [i for i in range(11) if schedule.switches_after(i)] == [3]
    assert TSTConfig(bag_size=4).phase1_steps(100) == 30  # the paper's r = 0.3 by default
    assert TSTConfig(bag_size=1, phase1_iters=5).phase1_steps(100) == 0  # S = 1 is a baseline
    assert TSTConfig(bag_size=6, phase1_iters=7).phase1_steps(100) == 7


def test_baseline_never_switches_and_bound_phases_carry_reader_and_step():
    baseline = Schedule.plan(TSTConfig(bag_size=1), seq_length=8, train_iters=5)
    assert baseline.n1 == 0 and all(baseline.phase_at(i).index == 2 for i in range(5))
    assert not any(baseline.switches_after(i) for i in range(6))
    whole = Schedule.plan(TSTConfig(bag_size=2, phase1_iters=5), seq_length=8, train_iters=5)
    assert [i for i in range(6) if whole.switches_after(i)] == [5]  # r = 1: switch at the end
    bound = whole.bind(phase1=("read1", "step1"), phase2=("read2", "step2"))
    assert (bound.phase_at(0).read_sample, bound.phase_at(0).forward_step) == ("read1", "step1")
    assert bound.phase2.read_sample == "read2" and bound.phase1 == whole.phase1


# (iteration, eval_interval, eval_iters, at_switch) -> validate?
EVAL = [
    (5, 5, 2, False, True),
    (10, 5, 2, False, True),
    (6, 5, 2, False, False),
    (3, 5, 2, True, True),  # at the switch too
    (5, None, 2, False, False),  # no --eval-interval: never
    (3, None, 2, True, False),
    (5, 5, 0, False, False),  # --eval-iters 0: no batches, so no validation
    (3, 5, 0, True, False),
]


@pytest.mark.parametrize("iteration, interval, iters, at_switch, expected", EVAL)
def test_should_eval(iteration, interval, iters, at_switch, expected):
    assert (
        should_eval(iteration, eval_interval=interval, eval_iters=iters, at_switch=at_switch)
        is expected
    )


# (iteration, train_iters, signalled, exit_interval, minutes, duration) -> reason
EXIT = [
    (3, 10, False, None, None, None, None),
    (10, 10, False, None, None, None, "finished"),
    (12, 10, False, None, None, None, "finished"),  # resumed past the end: nothing to do
    (3, 10, True, None, None, None, "signal"),
    (10, 10, True, None, None, None, "finished"),
    (4, 10, False, 2, None, None, "interval"),
    (3, 10, False, 2, None, None, None),
    (3, 10, False, None, 5.0, 5.0, "duration"),
    (3, 10, False, None, 4.9, 5.0, None),
]


@pytest.mark.parametrize("iteration, n, signalled, interval, minutes, duration, expected", EXIT)
def test_should_exit(iteration, n, signalled, interval, minutes, duration, expected):
    assert (
        should_exit(
            iteration,
            train_iters=n,
            signalled=signalled,
            exit_interval=interval,
            minutes_elapsed=minutes,
            exit_duration_in_mins=duration,
        )
        == expected
    )


# (iteration, save, save_interval, at_switch, save_at_switch, exiting) -> save?
SAVE = [
    (2, "ckpt", 2, False, True, False, True),
    (3, "ckpt", 2, False, True, False, False),
    (3, "ckpt", 2, True, True, False, True),  # the switch checkpoint
    (3, "ckpt", 2, True, False, False, False),  # --no-tst-save-at-switch
    (5, "ckpt", None, False, True, True, True),  # the end of training / a signal
    (5, "ckpt", None, False, True, False, False),
    (4, "ckpt", 2, True, True, True, True),  # all at once: still one save
    (2, None, 2, True, True, True, False),  # no --save: never
]


@pytest.mark.parametrize(
    "iteration, save, interval, at_switch, at_switch_on, exiting, expected", SAVE
)
def test_should_save(iteration, save, interval, at_switch, at_switch_on, exiting, expected):
    decision = should_save(
        iteration,
        save=save,
        save_interval=interval,
        at_switch=at_switch,
        save_at_switch=at_switch_on,
        exiting=exiting,
    )
    assert decision is expected


class _Writer:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, step):
        self.scalars.append(name)


def _run():
    from tests.defaults import TEST_DEFAULTS
    from tst_megatron.training.config import parse_args

    argv = ["--mock-data", "--vocab-size", "64", "--train-iters", "4", "--log-interval", "1"]
    cfg = parse_args(TEST_DEFAULTS + argv)
    return types.SimpleNamespace(
        cfg=cfg, writer=_Writer(), wandb=None, history={"train": {}, "valid": {}}
    )


@pytest.mark.parametrize("phase", [1, 2])
def test_a_step_that_scores_no_token_prints_a_marker_not_zero(phase, capsys):
    """An all-masked step (e.g. all-EOD data with --eod-mask-loss): [loss_sum, tokens] = [0, 0]."""
    from tst_megatron.training import trainer

    loss = trainer.mean_loss(0.0, 0.0)
    assert loss is None and trainer.mean_loss(3.0, 2.0) == 1.5
    run = _run()
    metrics = dict(loss=loss, moe_aux_loss=None, grad_norm=0.0, lr=1e-3, tokens=64, step_time=0.5)
    trainer.log_step(run, 2, Phase(phase, 1, 16, 16), metrics, tokens_seen=128)
    line = capsys.readouterr().out
    kind = "mce loss" if phase == 1 else "lm loss"
    assert f"{kind}: n/a (no tokens scored) |" in line and "0.000000E+00" not in line
    assert kind not in run.writer.scalars and "learning-rate" in run.writer.scalars
    assert run.history["train"][2] is None


def test_a_validation_round_that_scores_no_token_prints_a_marker_not_ppl_one(capsys):
    from tst_megatron.training import trainer

    run = _run()
    trainer.log_validation(run, 3, trainer.mean_loss(0.0, 0.0), tokens_seen=10)
    line = capsys.readouterr().out
    assert "lm loss: n/a (no tokens scored) | lm loss PPL: n/a (no tokens scored) |" in line
    assert "1.000E+00" not in line and run.writer.scalars == []
    trainer.log_validation(run, 4, 2.0, tokens_seen=10)
    assert "lm loss: 2.000000E+00 | lm loss PPL: 7.389E+00 |" in capsys.readouterr().out
    assert run.writer.scalars == ["validation lm loss", "validation lm loss vs tokens"]
