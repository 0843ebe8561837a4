"""The benchmark script runs (``--smoke``) and prints the expected tables, so it cannot rot."""

import os
import subprocess
import sys

import pytest


def test_core_cost_smoke(tmp_path):
    out = tmp_path / "results" / "core_cost.md"
    env = dict(os.environ, MASTER_PORT="29571", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "benchmarks/core_cost.py", "--smoke", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert "| k | time vs 1 megatron CE | peak memory vs 1 megatron CE |" in report
    assert "| S | time vs standard [b,T] | peak memory vs standard |" in report
    ce_rows = [l for l in report.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert [int(r.split("|")[1]) for r in ce_rows] == [1, 2, 4, 8, 16, 2, 4, 8]
    for row in ce_rows:
        assert all(float(c) > 0 for c in row.strip("|").split("|")[1:])


def test_step_cost_smoke(tmp_path):
    out = tmp_path / "results" / "step_cost.md"
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT="29591")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "benchmarks/step_cost.py", "--smoke", "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert "| S | step time, phase 1 (ms) | baseline (ms) | time ratio (<= 1.03) |" in report
    rows = [line for line in report.splitlines() if line.startswith("| 4 |")]
    assert len(rows) == 3  # the step-cost row and the two TP-traffic rows
    cells = rows[0].strip("|").split("|")
    assert all(float(c) > 0 for c in cells[:12])
    assert "| 4 | TP=2 + SP |" in report
    assert "step_cost" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_tst_vs_baseline_smoke(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "results"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/tst_vs_baseline.py",
            "--smoke",
            "--output-dir",
            str(out),
            "--work-dir",
            str(tmp_path / "work"),
            "--data-dir",
            str(tmp_path / "data"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=root,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = (out / "tst_vs_baseline_smoke.md").read_text()
    assert "| arm | final validation loss | tokens consumed | wall-clock (s) |" in report
    assert "| LR | baseline final validation loss |" in report
    rows = [
        l for l in report.splitlines() if l.startswith("| baseline (LR") or l.startswith("| TST S=")
    ]
    assert len(rows) == 2
    base_tokens, tst_tokens = (int(r.split("|")[3]) for r in rows)
    assert tst_tokens > base_tokens  # phase 1 reads S x more text per step
    assert (out / "tst_vs_baseline_smoke.png").read_bytes()[:4] == b"\x89PNG"
    assert "tst_vs_baseline_smoke" in (tmp_path / "results.md").read_text()
