"""benchmarks/tst_vs_baseline.py --model moe --horizons (``benchmarks/study/``): the paper's equal-loss speedup against
hand-computed cases, the dense table read back, the arm specs with their own r, the MoE
launch lines against the launcher's checks, and (slow) the MoE arm path end to end."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.launcher import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from study.analysis import (  # noqa: E402
    baseline_curve,
    dense_table,
    equal_loss_speedup,
    equal_loss_steps,
    paired_interval,
    router_verdict,
    seed_speedups,
)
from study.definitions import arm_label, parse_arms  # noqa: E402
from study.report import (  # noqa: E402
    ranking_lines,
    seeds_text,
    speedup_cell,
    statistics_section,
)
from tst_vs_baseline import parse  # noqa: E402


def test_equal_loss_steps_by_hand():
    curve = [(4000, 2.0), (1000, 3.0)]  # any order
    steps, where = equal_loss_steps(curve, 2.5)
    # halfway in loss between 1000 and 4000, so halfway in log steps: sqrt(1000 * 4000)
    assert where == "" and steps == pytest.approx(2000.0)
    assert equal_loss_speedup(curve, 1000, 2.5) == (pytest.approx(2.0), "")
    # a quarter of the way: 1000 * 4 ** 0.25
    assert equal_loss_steps(curve, 2.75)[0] == pytest.approx(1000 * math.sqrt(2))
    assert equal_loss_steps(curve, 3.0)[0] == pytest.approx(1000)  # the measured ends
    assert equal_loss_steps(curve, 2.0)[0] == pytest.approx(4000)
    # below the longest baseline's loss: more than longest / L; above the shortest: less
    assert equal_loss_steps(curve, 1.9) == (None, "beyond")
    assert equal_loss_speedup(curve, 1000, 1.9) == (4.0, ">")
    assert equal_loss_steps(curve, 3.2) == (None, "above")
    assert equal_loss_speedup(curve, 4000, 3.2) == (0.25, "<")
    # three lengths: the bracketing pair is used, 2000 -> 2.4, 4000 -> 2.0, loss 2.2
    three = [(1000, 3.0), (2000, 2.4), (4000, 2.0)]
    assert equal_loss_steps(three, 2.2)[0] == pytest.approx(2000 * math.sqrt(2))
    with pytest.raises(ValueError):
        equal_loss_steps([], 2.0)


def _arm(loss):
    return {"valid": [(0, 9.0), (100, loss)]}


def _row(steps, *seeds):
    """A horizons row: one ``(baseline loss, {label: arm loss})`` per seed, in order."""
    runs = [
        {"seed": i, "best": _arm(base), "arms": {k: _arm(v) for k, v in arms.items()}}
        for i, (base, arms) in enumerate(seeds)
    ]
    return {"steps": steps, "baselines": [run["best"] for run in runs[:1]], "seeds": runs}


#: Student's t quantiles t_{0.975, df} from a printed table (not from the code under test).
T975 = {2: 4.3027, 5: 2.5706}


def test_the_paired_interval_is_students_t_over_the_seeds():
    gaps = [-0.06, 0.014, -0.02, -0.05, 0.01, -0.03]
    n = len(gaps)
    mean = sum(gaps) / n
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    half = T975[n - 1] * sd / math.sqrt(n)
    got = paired_interval(gaps)
    assert got == pytest.approx((mean, mean - half, mean + half), abs=1e-5)
    assert paired_interval([-0.1, 0.0, 0.1]) == pytest.approx((0, -0.24841, 0.24841), abs=1e-4)
    one = paired_interval([0.05])
    assert one[0] == 0.05 and math.isnan(one[1]) and math.isnan(one[2])


def test_the_statistics_section_from_hand_made_arms():
    """Three seeds at 4000 steps, one at 1000: the section has the 4000-step row only, with
    the interval, the seeds below, the speedups read off the baseline curve at the mean gap
    and at the interval's ends, and the verdict."""
    rows = [
        _row(1000, (3.0, {"a": 2.9})),
        _row(4000, (2.0, {"a": 1.9}), (2.1, {"a": 1.95}), (2.2, {"a": 2.25})),  # -0.1, -0.15, +0.05
    ]
    lines = statistics_section(rows, ["a"])
    (row,) = [x for x in lines if x.startswith("| 4000 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    gaps = [-0.1, -0.15, 0.05]
    mean = sum(gaps) / 3
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / 2)
    low, high = mean - T975[2] * sd / math.sqrt(3), mean + T975[2] * sd / math.sqrt(3)
    assert cells[:5] == ["4000", "a", "3", f"{mean:+.4f}", f"[{low:+.4f}, {high:+.4f}]"]
    assert cells[5] == "2 of 3"
    # the baseline curve: 1000 -> 3.0, 4000 -> mean(2.0, 2.1, 2.2) = 2.1; the TST loss at a
    # gap g is 2.1 + g. The mean gap is below 2.1: beyond the longest baseline (> 4000/4000);
    # at the interval's upper end 2.1 + high lies between 3.0 and 2.1: linear in log steps
    fraction = (3.0 - (2.1 + high)) / (3.0 - 2.1)
    upper_end = 1000 * 4**fraction / 4000
    assert cells[6] == f">1.00 [{upper_end:.2f}, >1.00]"
    assert cells[7] == "tie (the interval holds 0)"
    assert not [x for x in lines if x.startswith("| 1000 |")]
    assert statistics_section(rows[:1], ["a"]) == []  # one seed: no section


def test_seed_speedups_pair_each_seed_with_its_own_baseline():
    # baselines: 1000 steps 3.0 (one seed); 4000 steps 2.0 and 2.2 at two seeds: mean 2.1
    rows = [_row(1000, (3.0, {"a": 2.55})), _row(4000, (2.0, {"a": 1.9}), (2.2, {"a": 2.3}))]
    assert baseline_curve(rows) == [(1000, 3.0), (4000, pytest.approx(2.1))]
    # 1000 steps: gap -0.45 on 3.0 -> 2.55: (3.0 - 2.55) / (3.0 - 2.1) = half way -> 2000
    ((value, where),) = seed_speedups(rows, rows[0], "a")
    assert where == "" and value == pytest.approx(2.0)
    # 4000 steps: gaps -0.1 (beyond the longest) and +0.1 (2.2: between 1000 and 4000)
    got = seed_speedups(rows, rows[1], "a")
    assert got[0] == (1.0, ">")
    fraction = (3.0 - 2.2) / (3.0 - 2.1)
    assert got[1][0] == pytest.approx(1000 * 4**fraction / 4000) and got[1][1] == ""
    assert speedup_cell([(2.0, "")]) == "2.00"
    assert speedup_cell([(2.0, ""), (1.0, ""), (1.5, "")]) == "1.50 [1.00, 2.00] (3 seeds)"
    assert speedup_cell([(1.0, ">"), (1.0, ">")]) == ">1.00, >1.00 (beyond the longest baseline)"
    assert speedup_cell([(1.0, ">"), (0.8, "")]) == ">1.00, 0.80"
    assert speedup_cell([]) == "not run"


def test_router_verdict_and_ranking():
    worse = router_verdict("a", [1.30, 1.20], [1.21, 1.20])  # +8.3 %, then +0.8 %
    assert "phase 1 routes less evenly than the baseline" in worse and "+8.3 %" in worse
    assert "level with the baseline" in worse
    kept = router_verdict("b", [1.10, 1.20], [1.30, 1.20])
    assert "more evenly" in kept and "still more imbalanced" in kept
    assert "as evenly as" in router_verdict("c", [1.21, 1.20], [1.10, 1.20])
    rows = [_row(100, (3.0, {"x": 3.1, "y": 2.9}))]
    assert ranking_lines(rows, ["x", "y"]) == [
        "Arms at 100 steps from the lowest final validation loss: y (-0.1000), x (+0.1000).",
        "",
    ]


def test_the_report_names_the_seeds_each_length_ran():
    one, two, three = (3.0, {"a": 2.9}), (3.1, {"a": 3.0}), (3.2, {"a": 3.3})
    rows = [_row(1000, one), _row(3000, one, two), _row(6000, one, two, three)]
    for r, seeds in zip(rows, ([7], [7, 8], [7, 8, 9])):
        for run, seed in zip(r["seeds"], seeds):
            run["seed"] = seed
    assert seeds_text(rows) == "8 at 3000 steps and 8, 9 at 6000 steps"
    rows.append(_row(12000, one, two, three))
    for run, seed in zip(rows[-1]["seeds"], (7, 8, 9)):
        run["seed"] = seed
    assert seeds_text(rows) == "8 at 3000 steps and 8, 9 at 6000, 12000 steps"
    assert seeds_text(rows[:1]) == ""


def test_dense_table_is_read_back():
    text = "\n".join(
        [
            "| steps | baseline LR | baseline final validation loss (passes) | S=2 full: TST - "
            "baseline (passes) | S=4 full: TST - baseline (passes) |",
            "|---|---|---|---|---|",
            "| 600 | 0.002 | 4.2951 (0.0476) | +0.1563 (0.0619) | not run |",
            "| 3000 | 0.002 | 3.4695 (0.238) | +0.0202 [+0.0134, +0.0305] (3 seeds) (0.309) "
            "| -0.0473 [-0.0905, -0.0227] (3 seeds) (0.904) |",
            "",
            "## next",
        ]
    )
    rows, labels = dense_table(text)
    assert labels == ["S=2 full", "S=4 full"]
    assert rows == [
        (600, 4.2951, [[0.1563], None]),
        (3000, 3.4695, [[0.0202, 0.0134, 0.0305], [-0.0473, -0.0905, -0.0227]]),
    ]


def test_arms_carry_their_own_phase1_fraction():
    assert parse_arms("16:full:0.25,2:output") == [(16, "full", 0.25), (2, "output")]
    assert arm_label(16, "full", 0.25) == "S=16 full r=0.25"
    assert arm_label(2, "full") == "S=2 full"
    with pytest.raises(SystemExit):
        parse_arms("4:full:0.25:1")


def test_moe_horizons_defaults():
    args = parse(["--horizons", "1500", "--model", "moe"])
    assert args.corpus_max_bytes == 120_000_000 and args.split == "99,1,0"
    assert args.work_dir.endswith(os.path.join("bench", "moe-horizons"))
    dense = parse(["--horizons", "1500"])
    assert dense.model == "dense" and dense.corpus_max_bytes == 40_000_000
    assert dense.split == "98,2,0" and dense.work_dir.endswith("full-horizons")


def test_moe_horizon_launch_lines_pass_the_launchers_checks(monkeypatch):
    from study.definitions import Corpus, lr_flags, model_flags, run_of, tst_flags

    from tst_megatron.training.validate import check

    args = parse(["--horizons", "1500", "--model", "moe"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    corpus = Corpus("/data/corpus_text_document", "corpus")
    flags = model_flags(args, corpus, run_of(args, 1500))
    for extra in (["--tst-bag-size", "1"], tst_flags(16, 0.25, "full")):
        result = check(flags + lr_flags(2e-3) + extra, dry_run=True)
        checked, problems = result.args, result.problems
        assert problems == [], problems
        assert checked.num_experts == 8 and checked.moe_router_topk == 2
        assert checked.expert_model_parallel_size == 2 and checked.qk_layernorm
        assert checked.group_query_attention and checked.num_query_groups == 2
        assert checked.moe_token_dispatcher_type == "alltoall"
        assert checked.moe_aux_loss_coeff == pytest.approx(1e-2)
        assert checked.untie_embeddings_and_output_weights and checked.swiglu
        assert checked.normalization == "RMSNorm" and checked.moe_per_layer_logging


@pytest.mark.slow
def test_moe_horizons_smoke(tmp_path):
    """The MoE arm path: a baseline and one TST arm (2 layers, 12 steps) through
    benchmarks/moe_launcher.py; the report, its speedup and router sections, the router's
    TensorBoard series in the arm files."""
    out, work = tmp_path / "results", tmp_path / "work"
    command = [sys.executable, "benchmarks/tst_vs_baseline.py", "--smoke", "--model", "moe"]
    command += ["--horizons", "12", "--lrs", "2e-3", "--arms", "4:full:0.25"]
    command += ["--output-dir", str(out), "--work-dir", str(work)]
    command += ["--data-dir", str(tmp_path / "data")]
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=ROOT)
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = (out / "tst_moe_smoke.md").read_text()
    assert "benchmarks/moe_launcher.py" in report and "--num-experts 8" in report
    assert "| 12 | >1.00 (beyond the longest baseline) |" in report or "| 12 | <1.00" in report
    assert "## Router health across the switch" in report
    assert "## Equal-loss speedup of the dense table" in report
    for png in ("tst_moe_smoke.png", "tst_moe_smoke_router.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    arm = json.loads((work / "h12-seed1234-s4-full-r0.25" / "arm.json").read_text())
    assert arm["switch"] == 3  # N1 = round(0.25 x 12)
    router = arm["router"]
    steps = [s for s, _ in router["load_imbalance"]]
    assert steps == list(range(1, 13))  # every training iteration
    for i, (_, mean) in enumerate(router["load_imbalance"]):
        layers = [router[f"moe/load_imbalance_layer_{k}"][i][1] for k in range(2)]
        assert all(1.0 <= v <= 4.0 for v in layers)  # max/mean of top-2 over 8 experts
        assert mean == pytest.approx(sum(layers) / 2, rel=1e-5)
    assert all(v > 0 for _, v in router["load_balancing_loss"])
    # --report-only writes the same tables from the arm files without running anything
    (out / "tst_moe_smoke.md").unlink()
    command += ["--report-only"]
    again = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    rewritten = (out / "tst_moe_smoke.md").read_text()
    head = rewritten.split("\n\nWritten from the recorded arm files (`arm.json`, nothing run) by")
    assert len(head) == 2 and head[0] == report.split("\n\nCommand:")[0]
