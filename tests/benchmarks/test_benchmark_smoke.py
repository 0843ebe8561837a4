"""The benchmark scripts run (``--smoke``, through the launcher
``examples/pretrain_gpt_tst.py`` where they train) and print the expected tables, so they
cannot rot; every launch line of tst_vs_baseline passes the launcher's checks."""

import os
import sys

import pytest

from tests.launcher import ROOT, run_benchmark
from tests.ports import free_port

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def test_core_cost_smoke(tmp_path):
    out = tmp_path / "results" / "core_cost.md"
    run_benchmark(
        "benchmarks/core_cost.py",
        "--smoke",
        "--output",
        str(out),
        timeout=600,
        MASTER_PORT=str(free_port()),
    )
    report = out.read_text()
    assert "| k | time vs 1 megatron CE | peak memory vs 1 megatron CE |" in report
    assert "| S | time vs standard [b,T] | peak memory vs standard |" in report
    ce_rows = [l for l in report.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert [int(r.split("|")[1]) for r in ce_rows] == [1, 2, 4, 8, 16, 2, 4, 8]
    for row in ce_rows:
        assert all(float(c) > 0 for c in row.strip("|").split("|")[1:])


@pytest.mark.slow
def test_step_cost_smoke(tmp_path):
    out = tmp_path / "results" / "step_cost.md"
    run_benchmark(
        "benchmarks/step_cost.py",
        "--smoke",
        "--output",
        str(out),
        timeout=900,
        PYTHONPATH=ROOT,
        MASTER_PORT=str(free_port()),  # its arms run in turn on this one port
    )
    report = out.read_text()
    assert "| S | iteration, phase 1 (ms) | phase 2 (ms) | baseline (ms) |" in report
    assert "examples/pretrain_gpt_tst.py" in report
    rows = [line for line in report.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 3  # the step-cost row and the two TP-traffic rows
    cells = [float(c) for c in rows[0].strip("|").split("|")]
    assert len(cells) == 19 and all(c > 0 for c in cells)
    # raw tokens per iteration: S x T x micro-batch in phase 1, T x micro-batch in the baseline
    p1_ms, p2_ms, base_ms, tps1, tps_base = cells[1], cells[2], cells[3], cells[15], cells[16]
    assert tps1 == pytest.approx(4 * 32 * 4 / (p1_ms / 1000), rel=0.01)
    assert tps_base == pytest.approx(32 * 4 / (base_ms / 1000), rel=0.01)
    # phase 1 / phase 2, from the unrounded times: the cells' ms have 1 decimal (+-0.05 each)
    rounding = p1_ms / p2_ms * (0.05 / p1_ms + 0.05 / p2_ms) + 0.0005
    assert cells[5] == pytest.approx(p1_ms / p2_ms, abs=rounding)
    # Megatron-LM's count: the same FLOPs per iteration in every arm, so TFLOP/s ~ 1 / time
    tflops1, tflops2, tflops_base = cells[12], cells[13], cells[14]
    assert tflops1 * p1_ms == pytest.approx(tflops_base * base_ms, rel=0.02)
    assert tflops2 * p2_ms == pytest.approx(tflops_base * base_ms, rel=0.02)
    assert "| 4 | TP=2 + SP |" in report
    assert "step_cost" in (tmp_path / "results.md").read_text()


def test_raw_tokens_count_what_each_phase_reads():
    from study.analysis import raw_tokens

    flags = ["--global-batch-size", "8", "--seq-length", "32", "--tst-bag-size", "4"]
    phases = [(1, 1.0), (2, 1.0), (3, 2.0), (4, 2.0), (5, 2.0)]
    assert raw_tokens(flags, phases) == 2 * 8 * 4 * 32 + 3 * 8 * 32
    # --tst-mode output reads ordinary windows; the baseline (no --tst-bag-size) T per sample
    assert raw_tokens(flags + ["--tst-mode", "output"], phases) == 5 * 8 * 32
    assert raw_tokens(flags[:4], [(i, 2.0) for i in range(1, 6)]) == 5 * 8 * 32


@pytest.mark.parametrize("mode", [["--smoke"], [], ["--horizons", "600"]])
def test_tst_vs_baseline_launch_lines_pass_the_launchers_checks(mode, monkeypatch):
    from study.definitions import Corpus, lr_flags, model_flags, run_of, tst_flags
    from tst_vs_baseline import parse

    from tst_megatron.training.validate import check

    args = parse(mode)
    monkeypatch.setenv("WORLD_SIZE", str(args.nproc_per_node))
    shared = model_flags(args, Corpus("/data/corpus_text_document", "corpus"), run_of(args))
    arms = {
        "baseline": ["--tst-bag-size", "1"],
        "full": tst_flags(4, 0.3, "full"),
        "output": tst_flags(2, 0.3, "output"),
    }
    for arm, extra in arms.items():
        result = check(shared + lr_flags(2e-3) + extra, dry_run=True)
        checked, problems = result.args, result.problems
        assert problems == [], (arm, problems)
        iters = args.train_iters
        assert checked.lr_decay_style == "WSD" and checked.lr_wsd_decay_iters == iters // 10
        # Megatron-LM 0.19's --full-validation stops at its first evaluation (one split)
        assert not checked.full_validation
        assert result.plan.n1 == (0 if arm == "baseline" else round(0.3 * iters))


@pytest.mark.slow
def test_tst_vs_baseline_smoke(tmp_path):
    out = tmp_path / "results"
    dirs = ["--output-dir", str(out), "--work-dir", str(tmp_path / "work")]
    dirs += ["--data-dir", str(tmp_path / "data")]
    # one baseline LR: two launcher runs
    flags = ["--smoke", "--lrs", "2e-3"] + dirs
    run_benchmark("benchmarks/tst_vs_baseline.py", *flags, timeout=1800, PYTHONPATH=ROOT)
    report = (out / "tst_vs_baseline_smoke.md").read_text()
    assert "examples/pretrain_gpt_tst.py" in report and "--lr-wsd-decay-iters" in report
    assert (
        "| arm | final validation loss | tokens consumed | passes | wall-clock (s) | tokens/s |"
        in report
    )
    assert "| LR | baseline final validation loss |" in report
    rows = [
        l for l in report.splitlines() if l.startswith("| baseline (LR") or l.startswith("| TST S=")
    ]
    assert len(rows) == 2
    base_tokens, tst_tokens = (int(r.split("|")[3]) for r in rows)
    # 12 steps of 8 x 32 tokens; TST: N1 = 0.3 x 12 -> 4 steps reading S = 4 x more
    assert base_tokens == 12 * 8 * 32
    assert tst_tokens == 4 * 8 * 4 * 32 + 8 * 8 * 32
    assert (out / "tst_vs_baseline_smoke.png").read_bytes()[:4] == b"\x89PNG"
    assert "tst_vs_baseline_smoke" in (tmp_path / "results.md").read_text()


def test_data_startup_stream_section_smoke(tmp_path):
    """The TST sample-order start-up benchmark at a small size: three starts, the second
    and the other node's read the same samples, every start maps the orders; run twice, its
    section of the report is replaced, the rest kept."""
    out = tmp_path / "data_startup.md"
    out.write_text("# Start-up cost of the token-id check\n\nkept\n")
    command = ["benchmarks/data_startup.py", "--stream-windows", "50000"]
    command += ["--bag-size", "4", "--dir", str(tmp_path / "w"), "--output", str(out)]
    for _ in range(2):
        run_benchmark(*command, timeout=600, PYTHONPATH=ROOT)
    report = out.read_text()
    assert report.startswith("# Start-up cost of the token-id check\n\nkept\n")
    assert report.count("# TST sample orders at scale (50,000 windows, S = 4)") == 1
    rows = [line for line in report.splitlines() if line.startswith("| ") and "start" in line]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows[1:])
    assert not os.path.exists(tmp_path / "w")


def test_data_startup_leaves_a_folder_it_did_not_create(tmp_path):
    """``--dir`` on a folder holding a file is refused in one line and the file stays; an
    empty folder given is emptied again but kept."""
    import subprocess
    import sys

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    command = [sys.executable, "benchmarks/data_startup.py", "--smoke", "--dir", str(mine)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert result.stderr.strip().endswith(f"--dir {mine} is not an empty folder; give a new one")
    assert (mine / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    command = [sys.executable, "benchmarks/data_startup.py", "--stream-windows", "20000"]
    command += ["--no-second-node", "--dir", str(empty)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert empty.is_dir() and not list(empty.iterdir())
