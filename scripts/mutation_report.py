"""Summarise ``mutmut results --all true`` (stdin): per file, the mutants killed, surviving,
timed out and not covered, and the score ``killed / (killed + survived)``; then every survivor's
name (``mutmut show <name>`` prints its diff). Run by ``scripts/mutation.sh``."""

from __future__ import annotations

import collections
import re
import sys


def main() -> None:
    counts: dict = collections.defaultdict(collections.Counter)
    survivors = []
    for line in sys.stdin:
        m = re.match(r"\s*(\S+)__mutmut_\d+: (.+)$", line.rstrip())
        if not m:
            continue
        name, status = line.strip().split(": ", 1)
        module = ".".join(p for p in m.group(1).split(".") if not p.startswith(("x_", "xǁ")))
        counts[module][status] += 1
        if status == "survived":
            survivors.append(name)
    print(f"{'file':48} {'killed':>6} {'survived':>8} {'timeout':>7} {'no tests':>8} {'score':>6}")
    total = collections.Counter()
    for module in sorted(counts):
        c = counts[module]
        total.update(c)
        judged = c["killed"] + c["survived"]
        score = f"{c['killed'] / judged:.0%}" if judged else "-"
        print(
            f"{module:48} {c['killed']:>6} {c['survived']:>8} {c['timeout']:>7} "
            f"{c['no tests']:>8} {score:>6}"
        )
    judged = total["killed"] + total["survived"]
    print(
        f"{'all':48} {total['killed']:>6} {total['survived']:>8} {total['timeout']:>7} "
        f"{total['no tests']:>8} {total['killed'] / max(judged, 1):>6.0%}"
    )
    print("\nsurvivors:")
    for name in survivors:
        print(f"  {name}")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:  # piped into head
        sys.exit(0)
