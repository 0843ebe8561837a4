"""The README's measured ratios are backed by files: every ``N.NNx`` in a row of its "What is
proven" table is, rounded to the README's decimals, a number in a ``docs/results/`` file that
the row links; and every row's status is one of the words the README defines."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STATUSES = ("passed on CPU", "passed on 1 GPU", "measured by hand on 1 GPU", "never run", "Paper")


def _rows() -> list[list[str]]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## What is proven", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        if line.startswith("| ") and not line.startswith("| Claim") and "---" not in line:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append(cells)
    return rows


def _numbers(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return re.findall(r"\d+\.\d+", f.read().replace(",", ""))


def test_every_row_has_a_defined_status():
    rows = _rows()
    assert len(rows) >= 20
    for claim, status, _ in rows:
        assert status.startswith(STATUSES), (status, claim[:60])


def test_every_measured_ratio_is_in_a_results_file_the_row_links():
    checked = 0
    for claim, status, shown in _rows():
        ratios = re.findall(r"(\d+\.(\d+))x\b", claim)
        if not ratios or status == "Paper":
            continue
        files = re.findall(r"\((docs/results/[^)]+\.md)\)", shown)
        assert files, f"a row with measured ratios links no docs/results file: {claim[:80]}"
        numbers = [n for path in files for n in _numbers(os.path.join(ROOT, path))]
        for value, decimals in ratios:
            found = any(f"{float(n):.{len(decimals)}f}" == value for n in numbers)
            assert found, f"{value}x is in no number of {files}: {claim[:80]}"
            checked += 1
    assert checked >= 6, checked


def test_every_number_of_the_results_section_is_in_a_results_file():
    """The README's "Results" prose and table (losses, gaps, intervals, speedups) round from
    numbers in ``docs/results/*.md``."""
    import glob

    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split("\n## Results", 1)[1].split("\n## ", 1)[0]
    numbers = {
        n
        for path in glob.glob(os.path.join(ROOT, "docs", "results", "*.md"))
        for n in _numbers(path)
    }
    values = re.findall(r"(?<![\w.])[+-]?(\d+\.(\d+))(?!\.\d)", section)
    assert len(values) >= 15, values
    for value, decimals in values:
        found = any(f"{float(n):.{len(decimals)}f}" == value for n in numbers)
        assert found, f"{value} of the README's Results is in no docs/results file"
