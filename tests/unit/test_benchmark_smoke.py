"""The benchmark script runs (``--smoke``) and prints the expected tables, so it cannot rot."""

import os
import subprocess
import sys


def test_core_cost_smoke(tmp_path):
    out = tmp_path / "core_cost.md"
    env = dict(os.environ, MASTER_PORT="29571", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "benchmarks/core_cost.py", "--smoke", "--output", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    assert "| k | time vs 1 megatron CE | peak memory vs 1 megatron CE |" in report
    assert "| S | time vs standard [b,T] | peak memory vs standard |" in report
    ce_rows = [l for l in report.splitlines() if l.startswith("| ") and l[2].isdigit()]
    assert [int(r.split("|")[1]) for r in ce_rows] == [1, 2, 4, 8, 16, 2, 4, 8]
    for row in ce_rows:
        assert all(float(c) > 0 for c in row.strip("|").split("|")[1:])


def test_step_cost_smoke(tmp_path):
    out = tmp_path / "step_cost.md"
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_PORT="29591")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "benchmarks/step_cost.py", "--smoke", "--output", str(out)],
                            capture_output=True, text=True, timeout=600, env=env, cwd=root)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = out.read_text()
    for row in ("| step time (ms) |", "| peak tensor memory (MiB) |", "| tokens/s |"):
        assert row in report
