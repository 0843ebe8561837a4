"""The MoE horizon study of issue 33, end to end, in the order that keeps what matters
first: ``benchmarks/tst_vs_baseline.py --model moe`` three times.

1. The bag-size sweep at 1500 steps (``tst_moe_sweep.md``): the baseline at its LR bracket,
   then S = 16, 8, 4, 2 at r = 0.25 and 0.3 (the paper's MoE used S = 16, r ~ 0.25).
2. The two arms with the lowest final validation loss in the sweep are picked.
3. The horizons (``tst_moe.md``): 1500 (read back), 3000 and 6000 steps for the baseline
   (its best LR, bracketed) and the two arms, seeds 1235 and 1236 at 6000, then a one-seed
   12000-step baseline, so that the 6000-step arms' equal-loss speedup can be read.

Every arm writes its ``arm.json`` as soon as it finishes and ``--reuse`` reads the finished
ones back, so running this again continues where a stop left off::

    nice -n 10 .venv/bin/python benchmarks/moe_study.py            # days on 2 cores
    .venv/bin/python benchmarks/moe_study.py --report-only         # the reports, from the arm files

Other flags are passed to every ``tst_vs_baseline.py`` run (e.g. ``--work-dir``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from study.definitions import Run, arm_name  # noqa: E402
from tst_vs_baseline import parse  # noqa: E402

SWEEP_STEPS = 1500
SWEEP_ARMS = [f"{s}:full:{r}" for r in (0.25, 0.3) for s in (16, 8, 4, 2)]
SWEEP_ARMS = SWEEP_ARMS[:3] + SWEEP_ARMS[4:7] + [SWEEP_ARMS[3], SWEEP_ARMS[7]]
"""S = 16, 8, 4 at r = 0.25 and 0.3 first, S = 2 last (the dense study's best; the least
likely for an MoE, whose paper run used S = 16)."""
HORIZONS = "1500,3000,6000,12000"


def benchmark(*flags: str) -> None:
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "tst_vs_baseline.py")]
    command += ["--model", "moe", *flags]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, check=True)


def work_dir(extra: list) -> str:
    if "--work-dir" in extra:
        return extra[extra.index("--work-dir") + 1]
    return os.path.join(ROOT, "runs", "bench", "moe-horizons")


def best_arms(directory: str, seed: int, count: int = 2) -> list:
    """The ``count`` sweep arms (of ``seed``) with the lowest final validation loss, as
    ``S:full:r``."""
    found = []
    for spec in SWEEP_ARMS:
        size, mode, fraction = spec.split(":")
        name = arm_name(Run(SWEEP_STEPS, seed, 1), f"s{size}-{mode}-r{fraction}")
        path = os.path.join(directory, name, "arm.json")
        if os.path.exists(path):
            with open(path) as f:
                found.append((json.load(f)["valid"][-1][1], spec))
    return [spec for _, spec in sorted(found)[:count]]


def main(argv: list) -> int:
    extra = [a for a in argv if a != "--report-only"]
    mode = ["--report-only"] if "--report-only" in argv else ["--reuse"]
    sweep = ["--horizons", str(SWEEP_STEPS), "--arms", ",".join(SWEEP_ARMS)]
    sweep += ["--arms-at-every-length", str(len(SWEEP_ARMS)), "--report-name", "tst_moe_sweep"]
    benchmark(*sweep, *mode, *extra)
    seed = parse(["--model", "moe", *sweep, *extra]).seeds_list[0]  # the sweep's first seed
    arms = best_arms(work_dir(extra), seed)
    if len(arms) < 2:
        print("moe_study: the sweep has fewer than two arms; no horizons yet", flush=True)
        return 0
    benchmark(
        "--horizons",
        HORIZONS,
        "--arms",
        ",".join(arms),
        "--arms-at-every-length",
        "0",
        "--extra-arms-max-steps",
        "6000",
        "--lr-sweep-max-steps",
        str(SWEEP_STEPS),
        "--seeds",
        "1234,1235,1236",
        "--seeds-min-steps",
        "6000",
        "--seeds-max-steps",
        "6000",
        *mode,
        *extra,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
