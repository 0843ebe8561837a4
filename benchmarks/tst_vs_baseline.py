"""TST against the baseline at matched FLOPs on the real python-stdlib corpus.

Both arms train the same MoE GPT with the same seed, data, micro/global batch, sequence
length T, WSD schedule and number of steps; they differ only in TST (S, r). The learning
rate of *both* arms is the one that is best for the baseline among ``--lrs`` (tried first).
Validation is next-token loss on a held-out split, at regular intervals and at the end.

Outputs (written by this script, under ``--output-dir``, default ``docs/results``):
``tst_vs_baseline.md`` (table + commands + machine) and ``tst_vs_baseline.png`` (both
validation curves against steps, equal FLOPs per step, switch marked); ``docs/results.md``
is regenerated to link every report in that folder.

    .venv/bin/python benchmarks/tst_vs_baseline.py            # ~25 min on 2 cores
    .venv/bin/python benchmarks/tst_vs_baseline.py --smoke    # ~1 min, for CI
    .venv/bin/python benchmarks/tst_vs_baseline.py --grid     # S in {2,4,6,8} x r in {0.2,0.3,0.5}; hours
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tst_megatron.plots import read_scalars, save_figure, switch_iteration  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import write, write_index  # noqa: E402

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def ensure_data(data_dir: str, vocab: int, max_documents) -> str:  # noqa: C901
    """Corpus -> tokenizer -> .bin/.idx with the project's tools, reusing what exists."""
    corpus, tok = os.path.join(data_dir, "stdlib.jsonl"), os.path.join(data_dir, "tokenizer")
    prefix = os.path.join(data_dir, "stdlib")
    steps = [
        (
            corpus,
            ["tools/build_corpus.py", "--source", "python-stdlib", "--output", corpus]
            + (["--max-documents", str(max_documents)] if max_documents else []),
        ),
        (
            tok + ".model",
            [
                "tools/train_tokenizer.py",
                "--input",
                corpus,
                "--model-prefix",
                tok,
                "--vocab-size",
                str(vocab),
            ],
        ),
        (
            prefix + "_text_document.idx",
            [
                "tools/preprocess_data.py",
                "--input",
                corpus,
                "--output-prefix",
                prefix,
                "--tokenizer-model",
                tok + ".model",
                "--append-eod",
                "--workers",
                "2",
            ],
        ),
    ]
    for output, command in steps:
        if not os.path.exists(output):
            subprocess.run(
                [PY, *command],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONWARNINGS="ignore"),
            )
    return prefix + "_text_document"


def model_flags(args, data_prefix: str) -> list[str]:
    tok = os.path.join(args.data_dir, "tokenizer.model")
    size = (
        [
            "--num-layers",
            "2",
            "--hidden-size",
            "64",
            "--ffn-hidden-size",
            "128",
            "--moe-ffn-hidden-size",
            "64",
            "--seq-length",
            "32",
        ]
        if args.smoke
        else [
            "--num-layers",
            "4",
            "--hidden-size",
            "128",
            "--ffn-hidden-size",
            "256",
            "--moe-ffn-hidden-size",
            "128",
            "--seq-length",
            str(args.seq_length),
        ]
    )
    return size + [
        "--device",
        "cpu",
        "--data-path",
        data_prefix,
        "--split",
        "98,2,0",
        "--data-cache-path",
        os.path.join(args.data_dir, "cache"),
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        tok,
        "--vocab-size",
        str(args.vocab_size),
        "--num-attention-heads",
        "4",
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-aux-loss-coeff",
        "0.01",
        "--expert-model-parallel-size",
        "2",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(args.train_iters),
        "--lr-decay-style",
        "WSD",
        "--lr-warmup-iters",
        str(max(1, args.train_iters // 20)),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--seed",
        "1234",
        "--eval-interval",
        str(args.eval_interval),
        "--eval-iters",
        str(args.eval_iters),
        "--log-interval",
        str(args.eval_interval),
    ]


def run_arm(args, name: str, flags: list[str]) -> dict:
    """Train one arm with torchrun (2 processes); return its curves and wall-clock time."""
    from tst_megatron.runtime.distributed import free_port

    port = free_port()
    tb = os.path.join(args.work_dir, name, "tensorboard")
    if os.path.isdir(tb):
        import shutil

        shutil.rmtree(os.path.join(args.work_dir, name))
    command = [
        TORCHRUN,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(port),
        "examples/pretrain_gpt_tst.py",
        *flags,
        "--tensorboard-dir",
        tb,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    scalars = read_scalars(tb)
    phases = scalars.get("tst-phase", [])
    tokens = scalars.get("tst-phase vs tokens", [])
    return {
        "name": name,
        "wall_s": wall,
        "command": shlex.join(["torchrun", "--nproc_per_node", "2", *command[5:]]),
        "valid": scalars["validation lm loss"],
        "switch": switch_iteration(phases),
        "tokens": tokens[-1][0] if tokens else None,
        "steps": phases[-1][0] if phases else None,
    }


def first_step_reaching(curve, target: float):
    return next((step for step, value in curve if value <= target), None)


def report(args, baselines: list[dict], best: dict, tst: dict) -> str:
    base_final, tst_final = best["valid"][-1][1], tst["valid"][-1][1]
    reach = first_step_reaching(tst["valid"], base_final)
    steps = best["valid"][-1][0]
    verdict = (
        f"TST reaches the baseline's final validation loss at step {reach} of {steps}: "
        f"{steps / reach:.2f}x fewer steps (equal FLOPs per step)"
        if reach
        else "TST does not reach the baseline's final validation loss within the run at this scale"
    )
    lines = [
        "# TST vs baseline at matched FLOPs",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}, "
        "2 gloo processes (EP=2), no GPU.",
        "",
        f"Model/data: MoE GPT (8 experts top-2), T = {'32' if args.smoke else args.seq_length}, "
        f"micro-batch 4, global batch 8, {args.train_iters} steps, WSD; python-stdlib corpus "
        f"(SentencePiece {args.vocab_size}), 98/2 train/validation split. TST: S = {args.bag_size}, "
        f"r = {args.phase1_fraction}.",
        "",
        "## Learning rate (chosen for the baseline, used by both arms)",
        "",
        "| LR | baseline final validation loss |",
        "|---|---|",
    ]
    lines += [f"| {b['lr']:g} | {b['valid'][-1][1]:.4f} |" for b in baselines]
    lines += [
        "",
        "## Result",
        "",
        "| arm | final validation loss | tokens consumed | wall-clock (s) |",
        "|---|---|---|---|",
        f"| baseline (LR {best['lr']:g}) | {base_final:.4f} | {best['tokens']} | {best['wall_s']:.0f} |",
        f"| TST S={args.bag_size}, r={args.phase1_fraction} | {tst_final:.4f} | {tst['tokens']} | {tst['wall_s']:.0f} |",
        "",
        f"Difference (TST - baseline): {tst_final - base_final:+.4f} nats. {verdict}.",
        "",
        "![validation curves](tst_vs_baseline.png)",
        "",
        "Commands (run by `benchmarks/tst_vs_baseline.py`"
        + (" --smoke" if args.smoke else "")
        + "):",
        "",
        f"    baseline: {best['command']}",
        f"    TST:      {tst['command']}",
        "",
    ]
    return "\n".join(lines)


def plot(args, best: dict, tst: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(*zip(*best["valid"]), "o-", ms=3, label=f"baseline (LR {best['lr']:g})")
    ax.plot(
        *zip(*tst["valid"]), "o-", ms=3, label=f"TST S={args.bag_size}, r={args.phase1_fraction}"
    )
    if tst["switch"] is not None:
        ax.axvline(
            tst["switch"], color="gray", ls="--", label=f"TST switch (iteration {tst['switch']})"
        )
    ax.axhline(best["valid"][-1][1], color="tab:blue", ls=":", lw=1, label="baseline final")
    ax.set_xlabel("iteration (equal FLOPs per step)")
    ax.set_ylabel("validation next-token loss (nats)")
    save_figure(fig, ax, path)


def main() -> int:
    p = argparse.ArgumentParser(description="TST vs baseline at matched FLOPs")
    p.add_argument("--smoke", action="store_true", help="tiny model and data, a few steps")
    p.add_argument("--grid", action="store_true", help="sweep S in {2,4,6,8} x r in {0.2,0.3,0.5}")
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--bag-size", type=int, default=4)
    p.add_argument("--phase1-fraction", type=float, default=0.3)
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3", help="learning rates tried for the baseline")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--output-dir", default=os.path.join(ROOT, "docs", "results"))
    args = p.parse_args()
    args.train_iters = args.train_iters or (12 if args.smoke else 600)
    args.vocab_size = args.vocab_size or (512 if args.smoke else 4096)
    args.eval_interval = max(1, args.train_iters // (4 if args.smoke else 12))
    args.eval_iters = 1 if args.smoke else 4
    kind = "smoke" if args.smoke else "full"
    args.data_dir = args.data_dir or os.path.join(ROOT, "runs", "bench", f"data-{kind}")
    args.work_dir = args.work_dir or os.path.join(ROOT, "runs", "bench", kind)
    prefix = ensure_data(args.data_dir, args.vocab_size, 60 if args.smoke else None)
    base_flags = model_flags(args, prefix)
    baselines = []
    for lr in (float(x) for x in args.lrs.split(",")):
        arm = run_arm(
            args,
            f"baseline-lr{lr:g}",
            base_flags + ["--lr", str(lr), "--min-lr", str(lr / 10), "--tst-bag-size", "1"],
        )
        arm["lr"] = lr
        baselines.append(arm)
        print(
            f"baseline LR {lr:g}: final validation loss {arm['valid'][-1][1]:.4f} ({arm['wall_s']:.0f} s)"
        )
    best = min(baselines, key=lambda b: b["valid"][-1][1])
    grid = (
        [(s, r) for s in (2, 4, 6, 8) for r in (0.2, 0.3, 0.5)]
        if args.grid
        else [(args.bag_size, args.phase1_fraction)]
    )
    os.makedirs(args.output_dir, exist_ok=True)
    grid_rows = []
    for s, r in grid:
        args.bag_size, args.phase1_fraction = s, r
        tst = run_arm(
            args,
            f"tst-s{s}-r{r}",
            base_flags
            + [
                "--lr",
                str(best["lr"]),
                "--min-lr",
                str(best["lr"] / 10),
                "--tst-bag-size",
                str(s),
                "--tst-phase1-fraction",
                str(r),
            ],
        )
        print(
            f"TST S={s} r={r}: final validation loss {tst['valid'][-1][1]:.4f} ({tst['wall_s']:.0f} s)"
        )
        reach = first_step_reaching(tst["valid"], best["valid"][-1][1])
        grid_rows.append(
            f"| {s} | {r} | {tst['valid'][-1][1]:.4f} | {tst['valid'][-1][1] - best['valid'][-1][1]:+.4f} "
            f"| {reach if reach else 'not reached'} | {tst['tokens']} |"
        )
        if not args.grid:
            name = "tst_vs_baseline" + ("_smoke" if args.smoke else "")
            plot(args, best, tst, os.path.join(args.output_dir, name + ".png"))
            text = report(args, baselines, best, tst).replace("tst_vs_baseline.png", name + ".png")
            write(os.path.join(args.output_dir, name + ".md"), text)
            print(text)
    if args.grid:
        text = "\n".join(
            [
                "# TST grid: bag size S x phase-1 fraction r",
                "",
                f"Same model, data, schedule and {args.train_iters} steps as `tst_vs_baseline.md`; "
                f"LR {best['lr']:g} for every arm (the baseline's best among `--lrs {args.lrs}`); "
                f"baseline final validation loss {best['valid'][-1][1]:.4f} ({best['tokens']} tokens). "
                f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, 2 gloo processes.",
                "",
                "| S | r | final validation loss | vs baseline | step reaching the baseline's final loss "
                "| tokens consumed |",
                "|---|---|---|---|---|---|",
                *grid_rows,
                "",
                "Command: `.venv/bin/python benchmarks/tst_vs_baseline.py --grid --lrs "
                + args.lrs
                + "`",
                "",
            ]
        )
        write(os.path.join(args.output_dir, "tst_grid.md"), text)
        print(text)
    write_index(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
