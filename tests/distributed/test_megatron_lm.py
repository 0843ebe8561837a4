"""TST inside Megatron-LM's own loop (``megatron.training.pretrain()``) on 2 gloo processes.

Each test spawns processes with the harness and runs :func:`tst_megatron.training.cli.main`
in-process, reading the losses Megatron-LM prints (``training_log``: last rank; the TST phase
lines: rank 0).
"""

from __future__ import annotations

import math
import re

import pytest

from tests.distributed.harness import run_distributed
from tests.launcher import BASE, EP2, NO_DROPOUT, switched_at_3
from tests.launcher import losses as _losses
from tests.launcher import pretrain_child as _pretrain_child
from tests.launcher import without as _without

#: Megatron-LM's thresholds are tokens (16 per sample): a global batch of 4 until 8 samples
#: are consumed, then 8. Consumed before the switch (3 steps): 4 + 4 + 8 = 16; in all: 40.
SCHEDULE = "0:4 128:8"


_CONSUMED = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) \|")
_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")


@pytest.fixture(scope="module")
def one_process():
    """What the runs' settings print on 1 process (2 micro-batches per step)."""
    ((printed,),) = run_distributed(_pretrain_child, 1, runs=[BASE + NO_DROPOUT])
    return printed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of 2 processes, four ``pretrain()`` runs in sequence (one start-up):
    DP=2 saving every 3 iterations (the switch), the same resumed from the switch's
    torch_dist checkpoint, EP=2 MoE with the alltoall dispatcher (DP=2 for the rest), and DP=2
    with a step batch-size schedule. Dropout is off: the losses depend on data and weights.
    TP, PP, PP with virtual stages and EP against the 1-process run: test_megatron_lm_layouts."""
    save = str(tmp_path_factory.mktemp("mlm") / "ckpt")
    base = BASE + NO_DROPOUT
    argvs = {
        "dp2": base + ["--save", save, "--save-interval", "3", "--ckpt-format", "torch_dist"],
        "resumed": base + ["--load", save, "--ckpt-step", "3", "--ckpt-format", "torch_dist"],
        "ep2": base + EP2,
        "schedule": _without(base, "--global-batch-size")
        + ["--step-batch-size-schedule", SCHEDULE],
    }
    first, last = run_distributed(_pretrain_child, 2, runs=list(argvs.values()))
    return {name: (first[i], last[i]) for i, name in enumerate(argvs)}


@pytest.mark.slow
def test_dp2_equals_the_one_process_run(runs, one_process):
    train_1, valid_1 = _losses(one_process)
    train_2, valid_2 = _losses(runs["dp2"][1])
    assert sorted(train_1) == sorted(train_2) == [1, 2, 3, 4, 5, 6]
    for i in train_1:  # both phases; fp32 sums in another order: not bitwise
        assert float(train_2[i]) == pytest.approx(float(train_1[i]), rel=2e-6), i
    assert float(valid_2[6]) == pytest.approx(float(valid_1[6]), rel=2e-6)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "ep2"])
def test_switches_in_process_with_losses_in_both_phases(runs, layout):
    first, last = runs[layout]
    switched_at_3(first, last)
    assert first.count("TST: phase 2") == 1  # the switch is announced once


@pytest.mark.slow
def test_resume_from_the_switch_checkpoint_continues_exactly(runs):
    (_, last_a), (first_b, last_b) = runs["dp2"], runs["resumed"]
    train_a, valid_a = _losses(last_a)
    train_b, valid_b = _losses(last_b)
    assert sorted(train_b) == [4, 5, 6], last_b[-3000:]
    # Megatron-LM's training_log does not reset its sums after the first logged iteration of
    # a (re)start (megatron/training/training.py: should_reset = not is_first_iteration), so
    # the 2nd logged value is the mean of two steps: compare the 1st and the 3rd.
    assert (train_a[4], train_a[6]) == (train_b[4], train_b[6])
    assert valid_a[6] == valid_b[6]
    assert "TST: phase 1" not in first_b  # resumed at the switch: next-token from its step 0
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first_b


@pytest.mark.slow
def test_step_batch_size_schedule_switches_at_the_consumed_samples_of_n1(runs):
    first, last = runs["schedule"]
    consumed = {int(i): int(c) for i, c in _CONSUMED.findall(last)}
    assert consumed == {1: 4, 2: 8, 3: 16, 4: 24, 5: 32, 6: 40}, last[-3000:]
    train, _ = _losses(last)
    assert sorted(train) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(float(v)) for v in train.values())
    # a phase-2 micro-batch holding a phase-1 sample (S*T tokens) would fail to collate
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first


@pytest.mark.slow
def test_intervals_that_divide_n1_save_and_validate_the_switch_once(runs):
    first, last = runs["dp2"]  # --save-interval 3 = --eval-interval 3 = N1
    saves = re.findall(r"saving checkpoint at iteration\s+(\d+) to", first)
    assert sorted(int(i) for i in saves) == [3, 6], first[-3000:]
    assert re.findall(r"validation loss at iteration (\d+) \|", last) == ["3", "6"]
    assert "TST: at the switch" not in first  # Megatron-LM's own intervals already hit it
