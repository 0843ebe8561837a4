"""Progress for the tools: ``tqdm``'s bar on a terminal; in a log (no TTY) one plain line per
milestone instead of a flood of carriage returns."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")

#: Milestones in a log: every tenth of a known total; every this many items otherwise.
EVERY_UNKNOWN = 10_000


def progress(
    items: Iterable[T],
    *,
    desc: str,
    unit: str = " items",
    total: Optional[int] = None,
    stream: Optional[TextIO] = None,
) -> Iterator[T]:
    """``items``, reporting progress on ``stream`` (default stderr).

    On a terminal: a ``tqdm`` bar. Otherwise one line ``<desc>: <n><unit> (<percent>, <s> s)``
    at each tenth of ``total`` (or every :data:`EVERY_UNKNOWN` items when ``total`` is None)
    and a last line with the count when ``items`` ends.
    """
    stream = sys.stderr if stream is None else stream
    if stream.isatty():
        yield from tqdm(items, desc=desc, unit=unit, total=total, file=stream)
        return
    start, count = time.monotonic(), 0
    step = max(1, total // 10) if total else EVERY_UNKNOWN
    for count, item in enumerate(items, 1):
        yield item
        if count % step == 0 and count != total:
            _line(stream, desc, count, unit, total, start)
    _line(stream, desc, count, unit, total, start, done=True)


def _line(stream, desc, count, unit, total, start, *, done=False) -> None:
    share = f", {100 * count // total} %" if total else ""  # floor: 100 % only at the end
    state = "done" if done else "so far"
    elapsed = time.monotonic() - start
    print(f"{desc}: {count:,}{unit} {state}{share}, {elapsed:.0f} s", file=stream, flush=True)
