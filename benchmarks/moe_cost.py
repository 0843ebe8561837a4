"""Cost per step of the MoE horizon arms against the dense ones, side by side.

Runs the two models of ``benchmarks/tst_vs_baseline.py --horizons`` (``--model dense``: 4
layers, h = 128, ffn 512, DP = 2; ``--model moe``: the Qwen3-MoE-like model, 8 experts top-2,
EP = 2, through ``benchmarks/moe_launcher.py``) for a few steps each, alternating
``--rounds`` times so both see the same machine load, and reads Megatron-LM's "elapsed time per
iteration" log lines (the first ``--skip`` lines dropped: start-up). Also the MoE in TST phase
1 (S = 16: the same transformer work on averaged inputs). Writes ``tst_moe_cost.md``::

    nice -n 10 .venv/bin/python benchmarks/moe_cost.py   # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import write  # noqa: E402
from study.definitions import Run, launcher_script, lr_flags, model_flags, tst_flags  # noqa: E402
from study.report import machine_line  # noqa: E402
from study.runner import TORCHRUN, launcher, prepare_data  # noqa: E402
from tst_vs_baseline import parse  # noqa: E402

_ITERATION_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def _moe_data_dir() -> str:
    """The MoE study's data directory (the default of ``--model moe --horizons``)."""
    return parse(["--horizons", "1", "--model", "moe"]).data_dir


def iteration_ms(model: str, extra: list, options) -> list:
    """Megatron-LM's per-iteration times (ms) of one short run of ``model``."""
    # both models on the MoE study's corpus (its data directory unless --data-dir is given)
    data = [] if "--data-dir" in options.benchmark else ["--data-dir", _moe_data_dir()]
    flags = ["--horizons", "1", "--model", model, "--corpus-max-bytes", "120000000"]
    args = parse([*flags, *data, *options.benchmark])
    corpus = prepare_data(args, record=False)  # borrowed: no record in the study's folders
    run = Run(options.steps, args.seeds_list[0], 10 * options.steps)
    flags = model_flags(args, corpus, run) + lr_flags(2e-3) + extra
    flags += ["--log-interval", str(options.log_interval), "--eval-iters", "1"]
    command = [TORCHRUN, *launcher(args), launcher_script(args), *flags]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    if result.returncode != 0:
        raise RuntimeError(f"{model} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    found = [float(x) for x in _ITERATION_MS.findall(result.stdout + result.stderr)]
    return found[options.skip :]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--skip", type=int, default=2, help="log lines dropped (start-up)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "results", "tst_moe_cost.md"))
    p.add_argument(
        "--benchmark",
        nargs=argparse.REMAINDER,
        default=[],
        help="flags for tst_vs_baseline.py's parser (e.g. --data-dir), last",
    )
    options = p.parse_args(argv)
    runs = {
        "dense baseline": ("dense", ["--tst-bag-size", "1"]),
        "MoE baseline": ("moe", ["--tst-bag-size", "1"]),
        # r = 1: every step in phase 1
        "MoE TST phase 1, S = 16": ("moe", tst_flags(16, 1.0, "full")),
    }
    times = {name: [] for name in runs}
    start = time.perf_counter()
    for _ in range(options.rounds):
        for name, (model, extra) in runs.items():
            times[name] += iteration_ms(model, extra, options)
            print(name, times[name], flush=True)
    dense = statistics.median(times["dense baseline"])
    lines = [
        "# Cost per step: the MoE horizon arms against the dense ones",
        "",
        machine_line(parse([])),
        "",
        f"Megatron-LM's elapsed time per iteration, {options.steps}-step runs logged every "
        f"{options.log_interval} steps (the first {options.skip} lines dropped), "
        f"{options.rounds} rounds alternating the models so that they share the machine's "
        "load; the median over the lines. Both models: T = 128, micro-batch 4, global batch 8 "
        "on 2 gloo processes (`benchmarks/tst_vs_baseline.py --horizons`, `--model dense` / "
        "`--model moe`).",
        "",
        "| run | median ms / iteration | vs dense | lines |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median:.0f} | {median / dense:.2f}x | "
            + ", ".join(f"{v:.0f}" for v in values)
            + " |"
        )
    lines += [
        "",
        f"Command: `.venv/bin/python benchmarks/moe_cost.py "
        f"{' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({time.perf_counter() - start:.0f} s).",
        "",
    ]
    write(options.output, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
