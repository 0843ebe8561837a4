"""Flags Megatron-LM 0.19.2 parses but no longer runs as written
(``tst_megatron.training.checks.deprecated``), and the launch printing every note the dry run
prints."""

from __future__ import annotations

import contextlib
import io
import math
import sys

import pytest

from tests.unit.test_dry_run import SMALL, dry
from tests.unit.test_megatron_lm_args import _TINY_RESUME
from tst_megatron.training.checks import deprecated
from tst_megatron.training.validate import check


def _errors(result):
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_every_listed_flag_is_one_megatron_lms_parser_accepts():
    """The tables name real Megatron-LM 0.19 flags (an upgrade that drops one fails here), and
    each flag of :data:`~deprecated.STOPS` is one on which ``validate_args`` exits."""
    from megatron.training.arguments import parse_args

    seen = {}

    def keep(parser):
        seen["parser"] = parser
        return parser

    saved, sys.argv = sys.argv, ["x"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            parse_args(extra_args_provider=keep)
    finally:
        sys.argv = saved
    options = {o for action in seen["parser"]._actions for o in action.option_strings}
    listed = [*deprecated.STOPS, *deprecated.IGNORED_NOTED]
    listed += [flag.split()[0] for flag in deprecated.TRANSLATED]
    listed += ["--rampup-batch-size", "--step-batch-size-schedule", "--recompute-activations"]
    assert [flag for flag in listed if flag not in options] == []


def _old_rampup_batch(consumed, start, increment, samples, global_batch):
    """Megatron-LM 0.13's ``RampupBatchsizeNumMicroBatchesCalculator.update``, written out."""
    if consumed > samples:
        return global_batch
    per_increment = samples / ((global_batch - start) // increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize(
    "start, increment, samples, global_batch, seq_length",
    [(2, 2, 16, 8, 16), (16, 8, 300, 64, 4), (4, 4, 10, 16, 8), (8, 8, 7, 32, 2)],
)
def test_the_suggested_step_schedule_steps_as_the_old_ramp_did(
    start, increment, samples, global_batch, seq_length
):
    """Megatron-LM's own step calculator, given the suggested schedule, returns at every
    consumed-sample count the global batch the removed ramp calculator returned."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    schedule = deprecated.rampup_schedule([start, increment, samples], global_batch, seq_length)
    steps = schedule.split()
    assert len(steps) == (global_batch - start) // increment + 1
    assert all(int(step.split(":")[0]) % seq_length == 0 for step in steps)  # whole samples
    calculator = StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=start // math.gcd(start, increment),
        data_parallel_size=1,
        decrease_batch_size_if_needed=False,
        rank=-1,
        schedule=schedule,
        seq_length=seq_length,
    )
    for consumed in range(samples + 3):
        calculator.update(consumed, consistency_check=False)
        want = _old_rampup_batch(consumed, start, increment, samples, global_batch)
        assert calculator.get_current_running_global_batch_size() == want, consumed


def test_a_ramp_the_old_calculator_refused_gets_no_schedule():
    assert deprecated.rampup_schedule([3, 2, 16], 8, 16) is None  # 5 is no multiple of 2
    assert deprecated.rampup_schedule([16, 8, 16], 8, 16) is None  # starts above the batch
    assert deprecated.rampup_schedule([8, 4, 16], 8, 16) == "0:8"  # no ramp at all


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--rampup-batch-size", "2", "2", "16"], ["'0:2 96:4 176:6 256:8'", "--global-batch-size 8 from the first step"]),  # noqa: E501
        (["--global-batch-size", "64", "--rampup-batch-size", "2", "2", "100000"], ["32 steps from '0:2' to '1600000:64'", "step j at ceil(j x 100000 / 31)"]),  # noqa: E501
        (["--fp8-interval", "4"], ["--fp8-interval 4", "every step"]),
        (["--use-dist-ckpt", "--ckpt-format", "torch"], ["--use-dist-ckpt", "--ckpt-format torch_dist"]),  # noqa: E501
        (["--dist-ckpt-format", "zarr"], ["--dist-ckpt-format zarr", "--ckpt-format torch_dist"]),  # noqa: E501
        (["--ckpt-fully-parallel-save", "--no-ckpt-fully-parallel-save"], ["keep one"]),
        (["--checkpoint-activations"], ["exits with status 0", "--recompute-activations"]),
    ],
)  # fmt: skip
def test_a_flag_that_would_change_the_run_is_refused_in_one_line(extra, expected):
    """Each is refused in one line naming what to give instead; without it the line passes."""
    assert dry(SMALL).returncode == 0  # global batch 8, --seq-length 16
    result = dry(SMALL + extra)
    errors = _errors(result)
    assert result.returncode == 2 and len(errors) == 1, result.stderr
    for part in expected:
        assert part in errors[0], errors[0]


def test_a_deprecated_flag_that_leaves_the_run_as_asked_is_noted():
    """Ignored but harmless, or translated by Megatron-LM: one ``note:`` each, no error."""
    extra = [
        "--use-mcore-models", "--disable-msc", "--ckpt-fully-parallel-save", "--use-dist-ckpt",
        "--dist-ckpt-format", "torch_dist", "--fp8-interval", "1", "--no-tp-comm-split-ag",
        "--use-rotary-position-embeddings", "--optimizer", "dist_muon",
    ]  # fmt: skip
    checked = check(SMALL + extra, dry_run=True)
    assert checked.problems == []
    flags = [note.split()[0] for note in checked.notes if "deprecated" in note]
    assert flags == [
        "--use-mcore-models", "--disable-msc", "--ckpt-fully-parallel-save", "--use-dist-ckpt",
        "--dist-ckpt-format", "--fp8-interval", "--no-tp-comm-split-ag",
        "--use-rotary-position-embeddings", "--optimizer",
    ]  # fmt: skip
    assert "--optimizer muon --use-distributed-optimizer" in checked.notes[-1]
    # the translation happened: the run is the one the note names
    assert checked.args.position_embedding_type == "rope" and checked.args.optimizer == "muon"
    assert not [n for n in check(SMALL, dry_run=True).notes if "deprecated" in n]


def test_an_exit_inside_megatron_lms_validation_is_an_error_not_a_silent_success(monkeypatch):
    """A ``validate_args`` that calls ``exit()`` for a flag not in ``STOPS`` (status 0 in
    Megatron-LM) still ends the check with one problem."""
    monkeypatch.setattr(deprecated, "STOPS", {})
    checked = check(SMALL + ["--checkpoint-activations"], dry_run=True)
    assert len(checked.problems) == 1 and "exited" in checked.problems[0], checked.problems


#: Launch lines that print notes: (extra flags, a note each must print).
NOTED = {
    "deprecated flag": (["--use-mcore-models"], "--use-mcore-models is deprecated"),
    "phase 1 fills the run": (["--tst-phase1-iters", "6"], "phase 1 fills all 6 iterations"),
    "phase-1 flag, no bag size": (
        ["--tst-bag-size", "1", "--tst-phase1-iters", "1"],
        "--tst-phase1-iters without --tst-bag-size > 1",
    ),
    "global_aux_loss": (
        ["--num-experts", "2", "--moe-router-load-balancing-type", "global_aux_loss"],
        "global_aux_loss: megatron-core counts the tokens",
    ),
}

#: the resume tests' tiny TST line (6 iterations, N1 = 3), stopped after its first step
_NOTED_BASE = _TINY_RESUME + ["--exit-interval", "1"]


def _with(argv, extra):
    argv = list(argv)
    for i, word in enumerate(extra):
        if word.startswith("--") and word in argv and i + 1 < len(extra):
            j = argv.index(word)
            if not argv[j + 1].startswith("--"):
                del argv[j : j + 2]
    return argv + extra


@pytest.mark.slow
@pytest.mark.parametrize("case", list(NOTED))
def test_the_launch_prints_every_note_the_dry_run_prints(case, run_launcher):
    """The real launch (rank 0, before work) and ``--dry-run`` print the same ``note:`` lines;
    what a dry run assumed of the cluster is marked ``assumed:``, not ``note:``."""
    extra, expected = NOTED[case]
    argv = _with(_NOTED_BASE, extra)
    dry_run = run_launcher(*argv, "--dry-run")
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    dry_notes = [line[len(" note: ") :] for line in dry_run.stdout.splitlines()
                 if line.startswith(" note: ")]  # fmt: skip
    launch = run_launcher(*argv)
    assert launch.returncode == 0, launch.stderr[-3000:]
    lines = launch.stdout.splitlines()
    launch_notes = [line[len("note: ") :] for line in lines if line.startswith("note: ")]
    assert [n for n in dry_notes if expected in n], dry_notes
    assert launch_notes == dry_notes
    first_step = next(i for i, line in enumerate(lines) if "iteration        1/" in line)
    assert all(lines.index(f"note: {n}") < first_step for n in launch_notes)
    assert "assumed:" not in launch.stdout
