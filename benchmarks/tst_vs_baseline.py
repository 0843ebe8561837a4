"""TST against the baseline at matched FLOPs on the real python-stdlib corpus.

Both arms train the same MoE GPT with the same seed, data, micro/global batch, sequence
length T, WSD schedule and number of steps; they differ only in TST (S, r). The learning
rate of *both* arms is the one that is best for the baseline among ``--lrs`` (tried first).
Validation is next-token loss on a held-out split, at regular intervals and at the end.

The study is in parts under ``benchmarks/study/``: its definitions (the fixed command line,
each run's length and seed, the launcher flags), the runner, the analysis (pure functions) and
the report writer; this file is the command line.

Every arm is one ``torchrun`` of the launcher, ``examples/pretrain_gpt_tst.py``
(Megatron-LM's own ``pretrain()`` with TST; ``--device cpu``: gloo), with Megatron-LM's
flags (WSD decay over the last 10 %: ``--lr-wsd-decay-iters``). The curves are read from its
TensorBoard events: Megatron-LM's ``lm loss validation`` and the launcher's ``tst-phase`` (the
phase of every iteration: the switch, and the raw tokens read, ``S*T`` per phase-1 sample).

Outputs (written by this script, under ``--output-dir``, default ``docs/results``):
``tst_vs_baseline.md`` (table + commands + machine) and ``tst_vs_baseline.png`` (both
validation curves against steps, equal FLOPs per step, switch marked); ``docs/results.md``
is regenerated to link every report in that folder.

    .venv/bin/python benchmarks/tst_vs_baseline.py            # ~25 min on 2 cores
    .venv/bin/python benchmarks/tst_vs_baseline.py --smoke    # ~1 min, for CI
    .venv/bin/python benchmarks/tst_vs_baseline.py --grid     # S in {2,4,6,8} x r in {0.2,0.3,0.5}; hours

**Horizons** (``--horizons 600,1500,3000,6000``): the same comparison at several
run lengths, each arm with its own complete WSD schedule (warmup N/20, decay over the last
10%). At every length: the baseline at its best LR among ``--lrs`` (or the one given by
``--baseline-lr STEPS=LR``; above ``--lr-sweep-max-steps``, the previous length's best LR and
half of it), then the ``--arms`` (``S:mode``; the first ``--arms-at-every-length`` (1) at
every length, the others up to ``--extra-arms-max-steps``), all with r =
``--phase1-fraction`` and the baseline's LR. It writes ``tst_horizons.md`` (final validation
loss, TST - baseline, passes over the training split per arm, where each arm crosses the
baseline) and ``tst_horizons.png`` ((TST - baseline) against steps); ``--seed N`` writes a
replicate, ``tst_horizons_seedN``. The default model is a 4-layer dense GPT (h = 128, ffn
512) on 2 processes (DP = 2), cheaper per step than the MoE, and the corpus is python-stdlib
+ python-site-packages capped at ``--corpus-max-bytes`` (40 MB, ~13 M tokens), so a
6000-step S = 2 arm reads the training split less than once. The committed report
(``docs/results/tst_horizons.md``, ~2 h on 2 free cores):

    .venv/bin/python benchmarks/tst_vs_baseline.py --horizons 600,1500,3000,6000 \
        --lr-sweep-max-steps 1500 --arms 2:full,2:output,2:input,4:full \
        --arms-at-every-length 2 --extra-arms-max-steps 1500

``--preset smollm2-135m`` / ``smollm2-135m-small`` with ``--device cuda`` run the paper's
smallest row on GPUs (``docs/gpu_recipe.md``; settings in ``benchmarks/recipes.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from measure import write, write_index  # noqa: E402
from study.definitions import (  # noqa: E402
    DEFAULT_SEED,
    ROOT,
    Study,
    lr_flags,
    model_flags,
    parse_arms,
    run_of,
    tst_flags,
)
from study.plots import plot  # noqa: E402
from study.report import grid_report, report, write_horizons_report  # noqa: E402
from study.runner import prepare_data, run_arm, run_baselines, run_horizons  # noqa: E402

DEFAULT_LRS = "1e-3,2e-3,4e-3"
"""``--lrs`` when neither it nor a ``--preset`` gives them."""


def parse(argv=None):
    p = argparse.ArgumentParser(description="TST vs baseline at matched FLOPs")
    p.add_argument("--smoke", action="store_true", help="tiny model and data, a few steps")
    p.add_argument("--grid", action="store_true", help="sweep S in {2,4,6,8} x r in {0.2,0.3,0.5}")
    p.add_argument(
        "--horizons",
        default=None,
        help="comma-separated run lengths, e.g. 600,1500,3000,6000: writes tst_horizons.md",
    )
    p.add_argument(
        "--arms",
        default="2:full,4:full,2:input,2:output",
        help="horizon arms S:mode (mode full, input or output), in report order",
    )
    p.add_argument(
        "--arms-at-every-length",
        type=int,
        default=1,
        help="how many of the first --arms run at every length",
    )
    p.add_argument(
        "--extra-arms-max-steps",
        type=int,
        default=3000,
        help="the arms after the first run only at lengths up to this",
    )
    p.add_argument(
        "--baseline-lr",
        default="",
        help="STEPS=LR,... : use this baseline LR at that length instead of trying --lrs",
    )
    p.add_argument(
        "--lr-sweep-max-steps",
        type=int,
        default=None,
        help="--horizons: above this length try only the previous best LR and half of it",
    )
    p.add_argument(
        "--model", choices=("moe", "dense"), default=None, help="default: moe; dense for --horizons"
    )
    p.add_argument("--preset", default=None, help="a GPU recipe of benchmarks/recipes.py")
    p.add_argument(
        "--rehearse",
        action="store_true",
        help="with --preset and --device cpu: the preset's command path at a tiny size on this "
        "CPU (recipes.Recipe.rehearsal: 2 processes, minutes), to try a GPU study without a GPU",
    )
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help=f"every arm's --seed (default {DEFAULT_SEED}; another: a replicate, whose arms and "
        "report name carry it)",
    )
    p.add_argument(
        "--seeds",
        default="",
        help="--horizons: seeds, e.g. 1234,1235,1236: the first's LR sweep picks the LR; at "
        "lengths >= --seeds-min-steps the baseline (at that LR) and the arms run at each; gaps "
        "are paired by seed",
    )
    p.add_argument("--seeds-min-steps", type=int, default=3000)
    p.add_argument(
        "--seeds-max-steps",
        type=int,
        default=None,
        help="--seeds only at lengths up to this (e.g. 6000 with a one-seed 12000-step baseline)",
    )
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--bag-size", type=int, default=None)
    p.add_argument("--phase1-fraction", type=float, default=None)
    p.add_argument("--lrs", default=None, help="learning rates tried for the baseline")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument(
        "--corpus-max-bytes",
        type=int,
        default=None,
        help="--horizons corpus cap (default 40 MB; 120 MB with --model moe)",
    )
    p.add_argument(
        "--corpus",
        choices=("code", "prose"),
        default="code",
        help="--horizons corpus: code (python-stdlib + python-site-packages) or prose "
        "(system-docs, repeated documents dropped: /usr/share/doc's READMEs, changelogs, "
        "licences)",
    )
    p.add_argument("--data-path", default=None, help="an existing .bin/.idx prefix (GPU recipes)")
    p.add_argument("--tokenizer-model", default=None, help="its tokenizer (with --data-path)")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--output-dir", default=os.path.join(ROOT, "docs", "results"))
    p.add_argument("--reuse", action="store_true", help="read back arms already finished")
    p.add_argument(
        "--keep-arms",
        default=None,
        help="--horizons: a folder (e.g. docs/results/moe_arms) that gets a gzipped copy of every "
        "finished arm's arm.json and the corpus record, so that --report-only can rebuild the "
        "report from them elsewhere",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="--horizons: run nothing; write the report from the arm files there are",
    )
    p.add_argument(
        "--report-name",
        default=None,
        help="--horizons: the report's file name (default tst_moe with --model moe, else "
        "tst_horizons)",
    )
    p.add_argument(
        "--dense-report",
        default=os.path.join(ROOT, "docs", "results", "tst_horizons_fixed.md"),
        help="--model moe: the dense horizons report whose table gets equal-loss speedups too",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: 2 on CPU, 8 on GPU")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    args = p.parse_args(argv)
    if args.preset:
        from recipes import RECIPES
        from recipes import recipe as recipe_of

        if args.preset not in RECIPES:
            p.error(f"--preset must be one of {', '.join(RECIPES)}")
        if args.rehearse:  # the study's code path, tiny, on this CPU
            args.preset = f"{args.preset}-rehearsal"
        recipe = recipe_of(args.preset)
        if args.device != recipe.device or not args.data_path or not args.tokenizer_model:
            p.error(
                f"--preset {args.preset} needs --device {recipe.device}, --data-path and "
                "--tokenizer-model (--rehearse: --device cpu)"
            )
        args = argparse.Namespace(
            **dict(
                vars(args),
                bag_size=args.bag_size or recipe.bag_size,
                phase1_fraction=args.phase1_fraction or recipe.phase1_fraction,
                lrs=args.lrs or str(recipe.lr),
                train_iters=args.train_iters or recipe.train_iters,
                nproc_per_node=args.nproc_per_node or recipe.gpus_per_node,
            )
        )
    if args.rehearse and not args.preset:
        p.error("--rehearse rehearses a --preset")
    if args.corpus != "code" and (not args.horizons or args.smoke or args.data_path):
        p.error("--corpus prose builds the --horizons corpus: not with --smoke or --data-path")
    if args.keep_arms and not args.horizons:
        p.error("--keep-arms keeps --horizons arms (their corpus digest pairs them)")
    if args.seeds and not args.horizons:
        p.error("--seeds runs replicates of --horizons lengths; one comparison takes --seed")
    if args.nnodes > 1 and (
        len((args.lrs or DEFAULT_LRS).split(",")) > 1 or args.lr_sweep_max_steps
    ):
        # only node 0 reads the finished arms: the others cannot know which LR was best
        p.error(
            "--nnodes > 1 needs one LR: one --lrs value (or a --preset's), no --lr-sweep-max-steps"
        )
    if args.nnodes > 1 and (args.master_port is None or args.master_addr == "127.0.0.1"):
        p.error("--nnodes > 1 needs --master-addr and --master-port (the same on every node)")
    values = vars(args)
    values["model"] = args.model or ("dense" if args.horizons else "moe")
    values["bag_size"] = args.bag_size or 4
    values["phase1_fraction"] = args.phase1_fraction or 0.3
    values["lrs"] = args.lrs or DEFAULT_LRS
    values["lrs_list"] = [float(x) for x in values["lrs"].split(",")]
    seeds = [int(x) for x in args.seeds.split(",") if x]
    first = args.seed if args.seed is not None else (seeds or [DEFAULT_SEED])[0]
    values["seeds_list"] = [first] + [s for s in dict.fromkeys(seeds) if s != first]
    values["baseline_lr"] = {
        int(k): float(v)
        for k, v in (item.split("=") for item in args.baseline_lr.split(",") if item)
    }
    values["nproc_per_node"] = args.nproc_per_node or (8 if args.device == "cuda" else 2)
    values["train_iters"] = args.train_iters or (12 if args.smoke else 600)
    values["vocab_size"] = args.vocab_size or (512 if args.smoke else 4096)
    values["eval_iters"] = 1 if args.smoke else 4
    moe_horizons = values["model"] == "moe" and args.horizons
    values["corpus_max_bytes"] = args.corpus_max_bytes or (
        120_000_000 if moe_horizons else 40_000_000
    )
    # the MoE study's 120 MB corpus: 1 % is ~0.4 M validation tokens, as the dense study's 2 %
    values["split"] = "99,1,0" if args.preset or (moe_horizons and not args.smoke) else "98,2,0"
    kind = ("smoke" if args.smoke else "full") + ("-horizons" if args.horizons else "")
    kind = kind.replace("full-", "") if moe_horizons else kind
    kind = ("moe-" if moe_horizons else "") + kind
    kind += "-prose" if args.corpus == "prose" else ""
    values["data_dir"] = args.data_dir or os.path.join(ROOT, "runs", "bench", f"data-{kind}")
    values["work_dir"] = args.work_dir or os.path.join(ROOT, "runs", "bench", args.preset or kind)
    return Study(**values)


def compare(args, corpus) -> None:
    """The comparison at one length (``tst_vs_baseline.md``), or with ``--grid`` every (S, r)
    (``tst_grid.md``): the baseline at its best LR among ``--lrs``, then TST at that LR."""
    run = run_of(args)
    flags = model_flags(args, corpus, run)
    baselines, best = run_baselines(args, corpus, run, args.lrs_list, flags)
    grid = [(s, r) for s in (2, 4, 6, 8) for r in (0.2, 0.3, 0.5)]
    grid = grid if args.grid else [(args.bag_size, args.phase1_fraction)]
    done = []
    for s, r in grid:
        arm_flags = flags + lr_flags(best["lr"]) + tst_flags(s, r, "full")
        tst = run_arm(args, f"tst-s{s}-r{r}", arm_flags, run, corpus)
        if tst is None:  # not node 0: the report is node 0's
            continue
        print(
            f"TST S={s} r={r}: final validation loss {tst['valid'][-1][1]:.4f} ({tst['wall_s']:.0f} s)"
        )
        done.append((s, r, tst))
        if args.grid:
            continue
        name = (args.preset or "tst_vs_baseline").replace("-", "_") + (
            "_smoke" if args.smoke else ""
        )
        name = "tst_vs_baseline_" + name if args.preset else name
        plot(best, tst, f"TST S={s}, r={r}", os.path.join(args.output_dir, name + ".png"))
        text = report(args, corpus, baselines, best, tst, s, r)
        text = text.replace("tst_vs_baseline.png", name + ".png")
        write(os.path.join(args.output_dir, name + ".md"), text)
        print(text)
    if args.grid and done:
        text = grid_report(args, best, done)
        write(os.path.join(args.output_dir, "tst_grid.md"), text)
        print(text)


def main(argv=None) -> int:
    args = parse(argv)
    corpus = prepare_data(args)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.horizons:
        arms = parse_arms(args.arms)

        def after_length(rows):
            if args.node_rank == 0:
                print(write_horizons_report(args, corpus, rows, arms), flush=True)

        run_horizons(args, corpus, arms, after_length)
        return 0
    compare(args, corpus)
    if args.node_rank == 0:
        write_index(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
