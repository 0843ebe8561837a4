"""The tools' progress: a bar on a terminal, one line per milestone in a log."""

import io

from tst_megatron.progress import progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_one_line_per_tenth_and_no_carriage_return():
    log = io.StringIO()
    assert list(progress(range(100), desc="tokenizing", unit=" docs", total=100, stream=log)) == (
        list(range(100))
    )
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert len(lines) == 10 and lines[0].startswith("tokenizing: 10 docs so far, 10 %")
    assert lines[-1].startswith("tokenizing: 100 docs done, 100 %")


def test_an_unknown_total_reports_every_n_items_and_the_end():
    log = io.StringIO()
    list(progress(iter(range(25_001)), desc="corpus", unit=" docs", stream=log))
    lines = log.getvalue().splitlines()
    assert [line.split(" docs")[0] for line in lines] == [
        "corpus: 10,000",
        "corpus: 20,000",
        "corpus: 25,001",
    ]


def test_a_terminal_gets_tqdms_bar():
    term = _Terminal()
    list(progress(range(5), desc="bar", total=5, stream=term))
    assert "\r" in term.getvalue() and "5/5" in term.getvalue()
