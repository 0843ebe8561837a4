"""The switch inside Megatron-LM's own loop (:mod:`tst_megatron.training`) on 2 gloo
processes: a checkpoint, a validation and a log line at iteration ``N1`` with intervals that
do not divide it, the user's intervals after it, a resume from the switch checkpoint, the
phase-1 loss as its own series, and the raw tokens read.

The expected values are read independently: Megatron-LM's own log lines and TensorBoard
events, the checkpoint directory, and averages recomputed here from the per-iteration
TensorBoard values. megatron-core releases without ``megatron.training`` skip.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import BASE, NO_DROPOUT  # noqa: E402
from tests.launcher import log_lines as _log_lines  # noqa: E402
from tests.launcher import pretrain_child_keep_going as _pretrain_child  # noqa: E402
from tests.launcher import scalars as _scalars  # noqa: E402
from tests.launcher import with_flag as _with  # noqa: E402

N1 = 3  # BASE: --tst-phase1-iters 3 of --train-iters 6, S = 2, --seq-length 16
#: every interval misses N1: saves at 4 (and pretrain()'s final save at 6), validation at
#: 4 (and the final one at 6), log lines at 2, 4, 6 (and 1, Megatron-LM's first iteration)
INTERVALS = ["--save-interval", "4", "--eval-interval", "4", "--log-interval", "2"]

_VALID = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([0-9.E+-]+)")
_SAVING = re.compile(r"saving checkpoint at iteration\s+(\d+) to")
_RAW = re.compile(r"TST: iteration\s+(\d+) \| raw tokens per sample: (\d+) \| raw tokens: (\d+)")


def _recorded_args(path):
    """The ``args`` namespace a torch_dist checkpoint directory records."""
    from megatron.core import dist_checkpointing

    with warnings.catch_warnings():  # read in this (non-distributed) process
        warnings.simplefilter("ignore", UserWarning)
        return dist_checkpointing.load_common_state_dict(str(path))["args"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One spawn of 2 processes, four ``pretrain()`` runs in sequence: DP=2 with intervals that
    miss the switch (saving, TensorBoard), the same resumed from its switch checkpoint,
    ``--no-tst-save-at-switch`` (4 iterations), and PP=2 with the intervals of the first."""
    root = tmp_path_factory.mktemp("switch")
    base = BASE + NO_DROPOUT + INTERVALS + ["--ckpt-format", "torch_dist"]
    save = str(root / "ckpt")
    argvs = {
        "switch": base + ["--save", save, "--tensorboard-dir", str(root / "tb")],
        "resumed": base
        + ["--load", save, "--ckpt-step", str(N1), "--tensorboard-dir", str(root / "tb_resumed")],
        "no_save": _with(base, "--train-iters", "4")
        + ["--save", str(root / "ckpt_no_save"), "--no-tst-save-at-switch"],
        # both stages must take the switch's save (a collective) and validation; 2
        # micro-batches per step; the last rank (stage 2) logs
        "pp2": base
        + ["--pipeline-model-parallel-size", "2", "--save", str(root / "ckpt_pp2")]
        + ["--tensorboard-dir", str(root / "tb_pp2")],
    }
    first, last = run_distributed(_pretrain_child, 2, runs=list(argvs.values()))
    out = {name: (first[i], last[i]) for i, name in enumerate(argvs)}
    return out, root


@pytest.mark.slow
def test_the_switch_is_saved_validated_and_logged_with_intervals_that_miss_it(runs):
    (first, last), root = runs[0]["switch"], runs[1]
    assert sorted(int(i) for i in _SAVING.findall(first)) == [N1, 4, 6], first[-3000:]
    iters = sorted(os.listdir(root / "ckpt"))
    assert [d for d in iters if d.startswith("iter_")] == [
        "iter_0000003",
        "iter_0000004",
        "iter_0000006",
    ]
    assert sorted(int(i) for i, _ in _VALID.findall(last)) == [N1, 4]  # then the final one
    assert sorted(_scalars(str(root / "tb"))["lm loss validation"]) == [N1, 4, 6]
    # the user's intervals after the switch: log lines at 2, 4, 6 (and 1), not every 3
    assert sorted(_log_lines(last)) == [1, 2, N1, 4, 6]
    assert "TST: at the switch (iteration 3): checkpoint, validation, log line" in first
    # what the checkpoints record: Megatron-LM pickles the live args, so the switch's holds
    # N1 for the intervals set for it (a resume reads the command line's, see below)
    recorded = {it: _recorded_args(root / "ckpt" / f"iter_{it:07d}") for it in (N1, 4)}
    intervals = {
        it: (a.save_interval, a.eval_interval, a.log_interval) for it, a in recorded.items()
    }
    assert intervals == {N1: (N1, N1, N1), 4: (4, 4, 2)}
    # the validation position after the switch's round (1 iteration of the global batch 4)
    assert recorded[N1].consumed_valid_samples == 4


@pytest.mark.slow
def test_resume_from_the_switch_checkpoint_continues_exactly(runs):
    (first_b, last_b), root = runs[0]["resumed"], runs[1]
    a, b = _scalars(str(root / "tb")), _scalars(str(root / "tb_resumed"))
    assert sorted(b["lm loss"]) == [4, 5, 6], last_b[-3000:]
    for i in (4, 5, 6):  # the same layout and data: bitwise
        assert b["lm loss"][i] == a["lm loss"][i], i
    # the command line's --eval-interval 4, not the checkpoint's 3
    assert [i for i, _ in _VALID.findall(last_b)] == ["4"]
    assert dict(_VALID.findall(last_b))["4"] == dict(_VALID.findall(runs[0]["switch"][1]))["4"]
    assert b["lm loss validation"][6] == a["lm loss validation"][6]
    assert "mce loss" not in b
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first_b


@pytest.mark.slow
def test_no_tst_save_at_switch_writes_no_checkpoint_there(runs):
    (first, last), root = runs[0]["no_save"], runs[1]
    assert sorted(int(i) for i in _SAVING.findall(first)) == [4], first[-3000:]
    assert sorted(d for d in os.listdir(root / "ckpt_no_save") if d.startswith("iter_")) == [
        "iter_0000004"
    ]
    assert sorted(int(i) for i, _ in _VALID.findall(last)) == [N1, 4]  # still validated


@pytest.mark.slow
def test_phase1_loss_is_its_own_series_and_log_averages_stay_in_one_phase(runs):
    (_, last), root = runs[0]["switch"], runs[1]
    tb = _scalars(str(root / "tb"))
    mce, lm = tb["mce loss"], tb["lm loss"]
    assert sorted(mce) == [1, 2, 3] and sorted(lm) == [4, 5, 6]
    logged = _log_lines(last)
    # Megatron-LM's averages since the last log line (its first logged iteration does not
    # reset the sums, so the line at 2 is the mean of 1 and 2)
    want = {
        1: ("mce loss", [mce[1]]),
        2: ("mce loss", [mce[1], mce[2]]),
        3: ("mce loss", [mce[3]]),
        4: ("lm loss", [lm[4]]),
        6: ("lm loss", [lm[5], lm[6]]),
    }
    for i, (key, values) in want.items():
        assert logged[i][key] == pytest.approx(sum(values) / len(values), rel=1e-5), (i, key)
    assert all("lm loss" not in logged[i] for i in (1, 2, 3))
    # training_log keeps every key it has seen: the phase-1 key prints 0 after the switch
    assert logged[4]["mce loss"] == 0.0 and logged[6]["mce loss"] == 0.0
    # next-token validation vs bag MCE: different quantities, both finite and positive
    assert all(v > 0 for v in (*mce.values(), *lm.values()))


def _raw(i):
    """Raw tokens read through iteration ``i`` of BASE (global batch 4, T = 16, S = 2): S*T
    per phase-1 sample, T after, summed plainly."""
    return 4 * (2 * 16 * min(i, N1) + 16 * max(i - N1, 0))


@pytest.mark.slow
def test_raw_tokens_and_the_phase_marker(runs):
    (_, last), root = runs[0]["switch"], runs[1]
    printed = {int(i): (int(n), int(r)) for i, n, r in _RAW.findall(last)}
    # at each log line (2, 4, 6) and the switch
    assert sorted(printed) == [2, N1, 4, 6], last[-3000:]
    assert printed == {i: (32 if i <= N1 else 16, _raw(i)) for i in printed}  # S*T, T
    tb = _scalars(str(root / "tb"))
    assert tb["raw-tokens"] == {i: _raw(i) for i in printed}
    assert tb["tst-phase"] == {1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0, 5: 2.0, 6: 2.0}
    # a resume at the switch counts the samples read before it (consumed_train_samples)
    resumed = _scalars(str(root / "tb_resumed"))
    assert resumed["raw-tokens"] == {i: _raw(i) for i in (4, 6)}


@pytest.mark.slow
def test_pipeline_stages_take_the_switch_together(runs):
    (first, last), root = runs[0]["pp2"], runs[1]
    assert sorted(int(i) for i in _SAVING.findall(first)) == [N1, 4, 6], first[-3000:]
    assert sorted(d for d in os.listdir(root / "ckpt_pp2") if d.startswith("iter_")) == [
        "iter_0000003",
        "iter_0000004",
        "iter_0000006",
    ]
    assert sorted(int(i) for i, _ in _VALID.findall(last)) == [N1, 4]
    assert sorted(_log_lines(last)) == [1, 2, N1, 4, 6]
    tb = _scalars(str(root / "tb_pp2"))
    assert sorted(tb["mce loss"]) == [1, 2, 3] and sorted(tb["lm loss"]) == [4, 5, 6]
    assert tb["raw-tokens"] == {i: _raw(i) for i in (2, N1, 4, 6)}
