"""docs/results.md keeps its hand-written part when a benchmark regenerates the report list."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from measure import write_index  # noqa: E402


def test_index_keeps_text_above_reports_and_lists_every_report(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "b.md").write_text("b")
    (results / "a.md").write_text("a")
    (results / "a.png").write_bytes(b"")
    write_index(str(results))  # no index yet: the default header
    assert (
        (tmp_path / "results.md")
        .read_text()
        .endswith("## Reports\n\n- [a](results/a.md)\n- [b](results/b.md)\n")
    )
    hand = "# Results\n\nTST wins at 20k steps per the paper.\n\n## Reports\n\n- [old](results/old.md)\n"
    (tmp_path / "results.md").write_text(hand)
    (results / "c.md").write_text("c")
    write_index(str(results))
    assert (tmp_path / "results.md").read_text() == (
        "# Results\n\nTST wins at 20k steps per the paper.\n\n## Reports\n\n"
        "- [a](results/a.md)\n- [b](results/b.md)\n- [c](results/c.md)\n"
    )
