"""benchmarks/tst_vs_baseline.py --horizons (``benchmarks/study/``): the crossing arithmetic,
the arms' names and seeds, the runner's reuse and scoring, and the whole script in --smoke
mode, so the 2-hour measurement cannot rot."""

import math
import os
import sys

import pytest

from tests.launcher import ROOT, run_benchmark

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from study.analysis import arm_lr, crossing, gaps, seed_gaps  # noqa: E402
from study.definitions import (  # noqa: E402
    Corpus,
    Run,
    arm_name,
    horizon_lrs,
    horizon_seeds,
    parse_arms,
    report_name,
    run_of,
)
from study.report import below_text, crossing_text, gap_cell  # noqa: E402
from study.runner import corpus_digest, run_arm  # noqa: E402
from tst_vs_baseline import parse  # noqa: E402


def test_corpus_digest_follows_the_tokens_not_the_path(tmp_path):
    tokens = bytes(range(256)) * 64
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "c_text_document.idx").write_bytes(b"MMIDIDX\x00\x00" + tokens[:40])
        (tmp_path / folder / "c_text_document.bin").write_bytes(tokens)
    a, b = (str(tmp_path / f / "c_text_document") for f in ("a", "b"))
    assert len(corpus_digest(a)) == 16
    assert corpus_digest(a) == corpus_digest(b)  # the same tokens elsewhere: the same digest
    changed = bytearray(tokens)
    changed[1000] ^= 1  # one token's low bit
    (tmp_path / "b" / "c_text_document.bin").write_bytes(bytes(changed))
    assert corpus_digest(a) != corpus_digest(b)
    (tmp_path / "b" / "c_text_document.bin").write_bytes(tokens + b"\x00\x00")  # 2 more bytes
    assert corpus_digest(a) != corpus_digest(b)
    with pytest.raises(FileNotFoundError):
        corpus_digest(str(tmp_path / "missing"))


def test_an_arm_of_another_corpus_is_not_reused(tmp_path, capsys):
    """An arm file records its corpus digest; ``--reuse``/``--report-only`` read back only
    arms of this run's corpus (the python-site-packages source depends on the venv)."""
    import argparse
    import json

    args = argparse.Namespace(work_dir=str(tmp_path), reuse=False, report_only=True)
    for name, digest in (("same", "aaaa"), ("other", "bbbb"), ("old", None)):
        (tmp_path / name).mkdir()
        arm = {"name": name, "valid": [[10, 1.0]]}
        if digest:
            arm["corpus_digest"] = digest
        (tmp_path / name / "arm.json").write_text(json.dumps(arm))
    run, corpus = Run(10, 1, 1), Corpus("c", "c", digest="aaaa")
    assert run_arm(args, "same", [], run, corpus)["name"] == "same"
    assert run_arm(args, "old", [], run, corpus)["name"] == "old"  # before digests were kept
    assert run_arm(args, "other", [], run, corpus) is None
    assert "other: trained on corpus bbbb, not aaaa; not reused" in capsys.readouterr().out


def test_crossing_is_linear_in_log_steps():
    # the S = 2 numbers plus a negative point: the sign changes between 3000 and 6000
    points = [(600, 0.33), (1500, 0.11), (3000, 0.007), (6000, -0.02)]
    n0, n1, estimate = crossing(points)
    expected = math.exp(math.log(3000) + math.log(2) * 0.007 / 0.027)
    assert (n0, n1, estimate) == (3000, 6000, round(expected))
    assert crossing([(600, 0.3), (1500, 0.1)]) is None
    assert "above the baseline at every length" in crossing_text("S=2 full", [(600, 0.3)])
    assert "at or below the baseline at every length" in crossing_text("x", [(600, -0.1)])
    assert "between 3000 and 6000 steps" in crossing_text("x", points)
    # the 3000-step S = 2 output gaps of three seeds: the mean is above, the seeds straddle 0
    straddle = crossing_text("x", [(3000, 0.0009)], [-0.0088, -0.0001, 0.0114])
    assert "above the baseline" in straddle and "a tie within the seeds' spread" in straddle
    assert "tie" not in crossing_text("x", [(3000, 0.02)], [0.013, 0.017, 0.031])
    assert parse_arms("2:full,4:output") == [(2, "full"), (4, "output")]
    with pytest.raises(SystemExit):
        parse_arms("2:both")


def test_lr_sweep_follows_the_best_lr_downwards_beyond_its_limit():
    args = parse(
        ["--horizons", "600,3000", "--lrs", "1e-3,2e-3,4e-3", "--lr-sweep-max-steps", "1500"]
    )
    assert horizon_lrs(args, 600, None) == [1e-3, 2e-3, 4e-3]
    assert horizon_lrs(args, 1500, 2e-3) == [1e-3, 2e-3, 4e-3]
    assert horizon_lrs(args, 3000, 2e-3) == [2e-3, 1e-3]
    args = parse(["--horizons", "600,3000", "--baseline-lr", "3000=5e-4"])
    assert horizon_lrs(args, 3000, 2e-3) == [5e-4]  # --baseline-lr wins
    assert horizon_lrs(args, 6000, 2e-3) == [1e-3, 2e-3, 4e-3]  # no limit: the whole sweep
    assert (
        arm_lr({"command": "torchrun x.py --lr-decay-style WSD --lr 0.002 --min-lr 2e-4"}) == 2e-3
    )


def test_every_seed_is_named_and_run_alike():
    """No seed is special: every arm's folder names its seed; the first seed of ``--seeds``
    (or ``--seed``) picks the LR and the others run at lengths within the seeds' range."""
    args = parse(["--horizons", "600,3000"])
    assert args.seeds_list == [1234] and report_name(args) == "tst_horizons"
    assert arm_name(run_of(args, 600), "baseline-lr0.001") == "h600-seed1234-baseline-lr0.001"
    replicate = parse(["--horizons", "600", "--seed", "7"])
    assert replicate.seeds_list == [7] and report_name(replicate) == "tst_horizons_seed7"
    assert arm_name(run_of(replicate, 600), "s2-full-r0.3") == "h600-seed7-s2-full-r0.3"
    seeded = ["--horizons", "600,3000", "--seeds", "1235,1234,1235", "--seeds-min-steps", "3000"]
    args = parse(seeded)
    assert args.seeds_list == [1235, 1234]  # the first given picks the LR; repeats dropped
    assert horizon_seeds(args, 600) == [1235] and horizon_seeds(args, 3000) == [1235, 1234]
    assert parse([*seeded, "--seed", "1234"]).seeds_list == [1234, 1235]
    assert run_of(args, 3000, 1234) == Run(3000, 1234, 500)  # N/6 in --horizons
    # a replicate set's report does not replace the default seed's
    assert report_name(args) == "tst_horizons_seed1235"
    assert report_name(parse(["--horizons", "600", "--seed", "1234"])) == "tst_horizons"
    assert report_name(parse(["--horizons", "600", "--seed", "0"])) == "tst_horizons_seed0"


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--seeds", "1,2"], "--seeds runs replicates of --horizons lengths"),
        (["--keep-arms", "k"], "--keep-arms keeps --horizons arms"),
        (
            ["--nnodes", "2", "--master-addr", "n0", "--master-port", "1", "--lrs", "1e-3,2e-3"],
            "--nnodes > 1 needs one LR",
        ),
        (["--nnodes", "2", "--master-addr", "n0", "--master-port", "1"], "needs one LR"),
        (
            ["--horizons", "600", "--nnodes", "2", "--master-addr", "n0", "--master-port", "1"]
            + ["--lrs", "1e-3", "--lr-sweep-max-steps", "300"],
            "--nnodes > 1 needs one LR",
        ),
    ],
)
def test_flags_that_would_be_ignored_or_disagree_across_nodes_are_refused(argv, error, capsys):
    with pytest.raises(SystemExit):
        parse(argv)
    assert error in capsys.readouterr().err


def test_the_study_is_not_changed_once_parsed():
    args = parse(["--horizons", "600"])
    for name in ("seed", "train_iters", "corpus_label", "bag_size"):
        with pytest.raises(AttributeError, match="fixed once parsed"):
            setattr(args, name, 1)


def test_seed_gaps_are_paired_by_seed():
    def arm(loss):
        return {"valid": [(10, 9.0), (100, loss)]}

    row = {
        "steps": 100,
        "seeds": [
            {"seed": 1, "best": arm(3.0), "arms": {"S=2 full": arm(3.1)}},
            {"seed": 2, "best": arm(3.5), "arms": {"S=2 full": arm(3.4)}},
            {"seed": 3, "best": arm(2.9), "arms": {}},  # an arm not run at this seed
        ],
    }
    got = seed_gaps(row, "S=2 full")  # each seed's arm minus the same seed's baseline
    assert got == pytest.approx([0.1, -0.1])
    assert gaps([row], "S=2 full") == [(100, pytest.approx(0.0))]
    assert gap_cell(got) == "+0.0000 [-0.1000, +0.1000] (2 seeds)"
    assert gap_cell([0.05]) == "+0.0500"


def test_below_the_baseline_needs_every_seed():
    def row(steps, *seed_pairs):  # (baseline, arm) final validation loss per seed
        runs = [
            {"best": {"valid": [(steps, b)]}, "arms": {"S=2 full": {"valid": [(steps, a)]}}}
            for b, a in seed_pairs
        ]
        return {"steps": steps, "seeds": runs}

    rows = [
        row(100, (3.0, 3.1)),  # above
        row(200, (3.0, 2.9), (3.0, 2.95)),  # below at both seeds
        row(400, (3.0, 2.9), (3.0, 3.05)),  # mean -0.025, seeds on both sides
    ]
    assert below_text(rows, ["S=2 full"]) == (
        "TST below the baseline at equal steps, at every seed run: S=2 full at 200 steps "
        "(-0.0750 [-0.1000, -0.0500] (2 seeds)); below on the mean only, not at every seed "
        "(a tie): S=2 full at 400 steps (-0.0250 [-0.1000, +0.0500] (2 seeds))."
    )
    assert below_text(rows[:1], ["S=2 full"]) == (
        "TST below the baseline at equal steps, at every seed run: none."
    )
    assert below_text([row(800, (3.0, 2.9))], ["S=2 full"]) == (
        "TST below the baseline at equal steps, at every seed run: S=2 full at 800 steps "
        "(-0.1000, one seed)."
    )


def test_the_final_point_is_megatron_lms_score_of_the_whole_split(monkeypatch, tmp_path):
    import subprocess as sp

    from study import definitions, runner

    args = parse(["--smoke", "--horizons", "8", "--work-dir", str(tmp_path)])
    corpus = Corpus("c", "c", "aaaa", 100, 8 * 32 * 5 + 7)  # 40 windows of T = 32: 5 batches
    assert definitions.whole_split_iters(args, corpus) == 5
    commands = []
    line = " validation loss at iteration 8 on validation set | lm loss value: 4.250000E+00 |"

    def fake_run(command, **kwargs):  # subprocess.run for everyone: keep the torchruns only
        if command[0] == runner.TORCHRUN:
            commands.append(command)
        scored = "--skip-train" in command
        return sp.CompletedProcess(command, 0, stdout=line if scored else "", stderr="")

    monkeypatch.setattr(runner.subprocess, "run", fake_run)
    monkeypatch.setattr(
        runner, "read_arm", lambda tb, flags: {"valid": [(4, 5.0), (8, 4.9)], "tokens": 1}
    )
    arm = runner.run_arm(args, "arm", ["--seq-length", "32"], run_of(args, 8), corpus)
    assert arm["valid"] == [(4, 5.0), (8, 4.25)] and arm["valid_whole_split"] == 4.25
    assert arm["corpus_digest"] == "aaaa"
    train, score = commands
    ckpt = os.path.join(str(tmp_path), "arm", "checkpoint")
    assert train[train.index("--save") + 1] == ckpt and "--skip-train" not in train
    assert train[train.index("--save-interval") + 1] == "8"
    assert score[score.index("--load") + 1] == ckpt and "--skip-train" in score
    assert score[score.index("--eval-iters") + 1] == "5"
    assert definitions.LAUNCHER in train and definitions.LAUNCHER in score


@pytest.mark.slow
def test_horizons_smoke(tmp_path):
    out = tmp_path / "results"
    dirs = ["--output-dir", str(out), "--work-dir", str(tmp_path / "work")]
    dirs += ["--data-dir", str(tmp_path / "data")]
    flags = ["--smoke", "--horizons", "8", "--arms", "2:full", "--lrs", "2e-3"] + dirs
    # 2 arms and their 2 whole-split scoring runs
    run_benchmark("benchmarks/tst_vs_baseline.py", *flags, timeout=1800)
    report = (out / "tst_horizons_smoke.md").read_text()
    table = report.split("## Where the curves cross")[0]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| 8 ")]
    assert len(rows) == 1
    for row in rows:
        passes = [cell.strip().rsplit("(", 1)[1].rstrip(")") for cell in row[2:]]
        base, full = (float(p) for p in passes)
        assert full > base > 0  # S = 2 full reads more text than the baseline
    assert "## Where the curves cross" in report and "- S=2 full:" in report
    data = str(tmp_path / "data" / "stdlib_text_document")
    assert f"`{corpus_digest(data)}`" in report  # the report names the corpus it ran on
    assert (out / "tst_horizons_smoke.png").read_bytes()[:4] == b"\x89PNG"
    assert "tst_horizons_smoke" in (tmp_path / "results.md").read_text()
