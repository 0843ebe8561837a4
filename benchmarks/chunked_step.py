"""Training-step time with ``--tst-loss-chunks N`` against ``--tst-loss-chunks 1``, through the
launcher on mock data, at two shapes: the quickstart's model and a head-heavy one (a large
vocabulary on a small model, where the head is most of the step). Megatron-LM's own
``elapsed time per iteration`` (log interval 1), median over the iterations after the first
two, half in phase 1 (S = 4) and half in phase 2; the arms alternate (1, N, N, 1) so that drift
cancels.

    .venv/bin/python benchmarks/chunked_step.py --out docs/results/chunked_step.md
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = (
    "--device cpu --mock-data --tokenizer-type NullTokenizer --micro-batch-size 4 "
    "--global-batch-size 4 --lr 1e-3 --log-interval 1 --eval-interval 1000 --eval-iters 0 "
    "--num-workers 0 --seed 1234 --tst-bag-size 4 --untie-embeddings-and-output-weights "
    "--hidden-dropout 0 --attention-dropout 0"
).split()
#: name -> model flags
SHAPES = {
    "quickstart (V 4,096, h 128, 4 layers, 8 experts, seq 128)": (
        "--vocab-size 4096 --seq-length 128 --max-position-embeddings 128 --num-layers 4 "
        "--hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 256 --num-experts 8 "
        "--moe-ffn-hidden-size 128 --moe-router-topk 2 --moe-aux-loss-coeff 0.01"
    ).split(),
    "head-heavy (V 32,768, h 256, 2 layers, seq 256)": (
        "--vocab-size 32768 --seq-length 256 --max-position-embeddings 256 --num-layers 2 "
        "--hidden-size 256 --num-attention-heads 4 --ffn-hidden-size 512"
    ).split(),
}
_TIME = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def step_times(model: list, chunks: int, iters: int) -> list[float]:
    """Megatron-LM's per-iteration times (ms) of one launcher run, after the first two."""
    argv = [sys.executable, os.path.join(ROOT, "examples", "pretrain_gpt_tst.py"), *COMMON]
    argv += [*model, "--train-iters", str(iters), "--tst-phase1-iters", str(iters // 2)]
    argv += ["--tst-loss-chunks", str(chunks)]
    env = dict(os.environ, PYTHONPATH=ROOT, TORCHDYNAMO_DISABLE="1")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return [float(t) for i, t in _TIME.findall(done.stdout) if int(i) > 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lines = [
        f"# Step time with --tst-loss-chunks {args.chunks} against 1 (CPU)",
        "",
        f"Command: `.venv/bin/python benchmarks/chunked_step.py --chunks {args.chunks} --iters "
        f"{args.iters}` on {platform.machine()}, {os.cpu_count()} CPU cores, torch "
        f"{torch.__version__}: Megatron-LM's elapsed time per iteration, median of the "
        "iterations after the first two of each run, runs in the order 1, N, N, 1; half the "
        "iterations in phase 1 (S = 4).",
        "",
        f"| shape | 1 chunk ms | {args.chunks} chunks ms | ratio |",
        "|---|---|---|---|",
    ]
    for name, model in SHAPES.items():
        times = {1: [], args.chunks: []}
        for chunks in (1, args.chunks, args.chunks, 1):
            times[chunks] += step_times(model, chunks, args.iters)
        one, many = statistics.median(times[1]), statistics.median(times[args.chunks])
        lines.append(f"| {name} | {one:,.1f} | {many:,.1f} | {many / one:.3f} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".tmp", "w") as f:
            f.write(text)
        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
