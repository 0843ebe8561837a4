"""TST against the baseline at matched FLOPs on the real python-stdlib corpus.

Both arms train the same MoE GPT with the same seed, data, micro/global batch, sequence
length T, WSD schedule and number of steps; they differ only in TST (S, r). The learning
rate of *both* arms is the one that is best for the baseline among ``--lrs`` (tried first).
Validation is next-token loss on a held-out split, at regular intervals and at the end.

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
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tst_megatron.plots import (  # noqa: E402
    read_scalars,
    save_figure,
    switch_iteration,
    validation_tag,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import write, write_index  # noqa: E402

PY = sys.executable
EVAL_ROUNDS = 6
"""--horizons: evaluations per run (every N/6 steps); the final one scores the whole split."""
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def ensure_data(  # noqa: C901
    data_dir: str,
    vocab: int,
    max_documents,
    *,
    sources: tuple = ("python-stdlib",),
    max_bytes=None,
    name: str = "stdlib",
) -> str:
    """Corpus -> tokenizer -> .bin/.idx with the project's tools, reusing what exists."""
    corpus, tok = os.path.join(data_dir, name + ".jsonl"), os.path.join(data_dir, "tokenizer")
    prefix = os.path.join(data_dir, name)
    steps = [
        (
            corpus,
            ["tools/build_corpus.py", "--output", corpus]
            + [a for source in sources for a in ("--source", source)]
            + (["--max-documents", str(max_documents)] if max_documents else [])
            + (["--max-bytes", str(max_bytes)] if max_bytes else []),
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
            ]
            # site-packages has more distinct characters than 4096 pieces: the rarest are
            # spelled with SentencePiece's byte fallback
            + (["--character-coverage", "0.9995"] if "python-site-packages" in sources else []),
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
    """The launcher flags shared by every arm (model, data, batch, schedule, evaluation)."""
    if args.preset:
        from recipes import RECIPES

        return RECIPES[args.preset].flags(
            data_path=data_prefix,
            tokenizer_model=args.tokenizer_model,
            tokenizer_type=args.tokenizer_type,
            train_iters=args.train_iters,
            data_cache_path=os.path.join(args.work_dir, "data-cache"),
        )
    tok = args.tokenizer_model or os.path.join(args.data_dir, "tokenizer.model")
    if args.model == "dense" and not args.smoke:
        return _common_flags(args, data_prefix, tok) + [
            "--num-layers",
            "4",
            "--hidden-size",
            "128",
            "--ffn-hidden-size",
            "512",
            "--seq-length",
            str(args.seq_length),
        ]
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
    moe = [
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-aux-loss-coeff",
        "0.01",
        "--expert-model-parallel-size",
        "2",
    ]
    if args.model == "dense":  # smoke size without the MoE flags
        size = size[:6] + size[8:]
    return size + _common_flags(args, data_prefix, tok) + (moe if args.model == "moe" else [])


def _common_flags(args, data_prefix: str, tok: str) -> list[str]:
    return [
        "--device",
        args.device,
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
        "--max-position-embeddings",
        str(batch_shape(args)[1]),
        "--swiglu",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--micro-batch-size",
        "4",
        "--global-batch-size",
        "8",
        "--train-iters",
        str(args.train_iters),
        "--lr-decay-style",
        "WSD",
        "--lr-wsd-decay-style",
        "linear",
        "--adam-beta2",
        "0.95",
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--num-workers",
        "0",
        "--lr-warmup-iters",
        str(max(1, args.train_iters // 20)),
        # Megatron-LM's WSD has no default decay length: the last 10 % of the run
        "--lr-wsd-decay-iters",
        str(max(1, args.train_iters // 10)),
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
        "--seed",
        str(args.seed),
        "--eval-interval",
        str(args.eval_interval),
        "--eval-iters",
        str(args.eval_iters),
        "--log-interval",
        str(args.eval_interval),
    ]


def launcher(args) -> list[str]:
    """``torchrun`` and its options: ``--nproc-per-node`` processes on this node; with
    ``--nnodes > 1`` this node's rank and the rendezvous address/port (the same on every
    node, e.g. from Slurm; see ``docs/gpu_recipe.md``)."""
    from tst_megatron.runtime.distributed import free_port

    options = ["--nproc_per_node", str(args.nproc_per_node)]
    if args.nnodes > 1:
        options += [
            "--nnodes",
            str(args.nnodes),
            "--node_rank",
            str(args.node_rank),
            "--master_addr",
            args.master_addr,
            "--master_port",
            str(args.master_port),
        ]
    else:
        options += ["--master_port", str(args.master_port or free_port())]
    return options


LAUNCHER = "examples/pretrain_gpt_tst.py"
"""The launcher every arm runs: Megatron-LM's ``pretrain()`` with TST."""


def flag_value(flags: list, name: str, default=None):
    """The value after the last ``name`` in ``flags`` (``default`` when absent)."""
    if name not in flags:
        return default
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def raw_tokens(flags: list, phases: list) -> int:
    """Tokens an arm read: for each iteration of the ``tst-phase`` series (``(step, phase)``),
    the global batch times ``S*T`` in phase 1 (``T`` with ``--tst-mode output``, which reads
    ordinary windows) or ``T`` in phase 2, as the launcher's raw-tokens-per-second counts."""
    gbs = int(flag_value(flags, "--global-batch-size"))
    seq = int(flag_value(flags, "--seq-length"))
    bag = int(flag_value(flags, "--tst-bag-size", 1))
    phase1 = seq if flag_value(flags, "--tst-mode", "full") == "output" else bag * seq
    return sum(gbs * (phase1 if phase == 1.0 else seq) for _, phase in phases)


def read_arm(tensorboard_dir: str, flags: list) -> dict:
    """An arm's curves from the launcher's TensorBoard events: ``valid`` (Megatron-LM's
    ``lm loss validation``: ``[(iteration, loss)]``, the final evaluation replacing a
    validation at the same iteration), ``switch`` (from ``tst-phase``), ``tokens``
    (:func:`raw_tokens`), ``steps``."""
    scalars = read_scalars(tensorboard_dir)
    phases = scalars.get("tst-phase", [])
    tag = validation_tag(scalars)
    if tag is None or not phases:
        raise RuntimeError(f"{tensorboard_dir}: no validation loss or tst-phase series")
    return {
        "valid": scalars[tag],
        "switch": switch_iteration(phases),
        "tokens": raw_tokens(flags, phases),
        "steps": phases[-1][0],
    }


#: Megatron-LM's validation line (``evaluate_and_print_results``, last rank).
_VALIDATION_LINE = re.compile(
    r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.E+-]+)"
)


def whole_split_iters(args) -> int:
    """``--eval-iters`` that score the whole validation split once: its ``T``-token windows
    (megatron-core's ``GPTDataset``: ``(tokens - 1) // T`` per epoch) in global batches, at
    least 1 (all but the last ``< global batch`` windows)."""
    gbs, seq = batch_shape(args)
    return max(1, (args.valid_tokens - 1) // seq // gbs)


def score_whole_split(options, flags, ckpt: str, eval_iters: int, env) -> "tuple | None":
    """Megatron-LM's own evaluation of the checkpoint ``ckpt`` on the whole validation split:
    the launcher with ``--load ckpt --skip-train --eval-iters eval_iters`` (with
    ``--skip-train`` Megatron-LM sizes the split to ``eval_iters`` global batches and reads it
    from its start, so every arm is scored on the same windows). Returns ``(iteration,
    loss)`` from its validation line (node 0; None elsewhere).

    Megatron-LM 0.19's ``--full-validation`` does this at every evaluation, but with one
    validation set its ``evaluate_and_print_results`` indexes an ``int``
    (``eval_iters[0]`` after ``torch.tensor(args.eval_iters).tolist()``) and stops the run;
    hence this route, for the final evaluation.
    """
    command = [TORCHRUN, *options, LAUNCHER, *flags, "--load", ckpt, "--skip-train"]
    command += ["--no-load-optim", "--no-load-rng", "--eval-iters", str(eval_iters)]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"scoring {ckpt} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    found = _VALIDATION_LINE.findall(result.stdout + result.stderr)
    if not found:
        return None
    iteration, loss = found[-1]
    return int(iteration), float(loss)


def run_arm(args, name: str, flags: list[str]) -> dict:
    """Train one arm with torchrun and the launcher (:data:`LAUNCHER`); return its curves and
    wall-clock time (node 0), or None on the other nodes. With ``--reuse``, an arm whose
    ``arm.json`` exists is read back."""
    import json
    import shutil

    arm_dir = os.path.join(args.work_dir, name)
    saved = os.path.join(arm_dir, "arm.json")
    if args.reuse and os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)
    tb = os.path.join(arm_dir, "tensorboard")
    if os.path.isdir(arm_dir) and args.node_rank == 0:
        shutil.rmtree(arm_dir)
    os.makedirs(arm_dir, exist_ok=True)
    options = launcher(args)
    ckpt = os.path.join(arm_dir, "checkpoint")
    score = whole_split_iters(args) if args.horizons else None
    save = ["--save", ckpt, "--save-interval", str(args.train_iters), "--no-tst-save-at-switch"]
    command = [TORCHRUN, *options, LAUNCHER, *flags, "--tensorboard-dir", tb]
    command += save if score else []
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # a fresh rendezvous port (the training run's may still be held)
    final = score_whole_split(launcher(args), flags, ckpt, score, env) if score else None
    if args.node_rank != 0:
        return None
    arm = {
        "name": name,
        "wall_s": wall,
        "command": shlex.join(["torchrun", *options[:2], *command[1 + len(options) :]]),
        **read_arm(tb, flags),
    }
    if final is not None:  # the final point: the whole split, the same windows for every arm
        steps, loss = final
        arm["valid"] = [p for p in arm["valid"] if p[0] != steps] + [(steps, loss)]
        arm["valid_whole_split"] = loss
        shutil.rmtree(ckpt, ignore_errors=True)
    with open(saved, "w") as f:
        json.dump(arm, f)
    return arm


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
        machine_line(args),
        "",
        f"Model/data: {describe(args)}, {args.train_iters} steps. TST: S = {args.bag_size}, "
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
        f"Commands (run by `{invocation()}`):",
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


def invocation() -> str:
    """This script's command line as run (for the reports)."""
    return shlex.join(["benchmarks/tst_vs_baseline.py", *sys.argv[1:]])


def machine_line(args) -> str:
    if args.device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "GPU"
        return (
            f"Machine: {args.nnodes} node(s) x {args.nproc_per_node} {gpu}, "
            f"Python {platform.python_version()}."
        )
    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, {args.nproc_per_node} gloo processes, no GPU."
    )


def batch_shape(args) -> tuple[int, int]:
    """``(global batch, T)`` of the arms: the preset's, or the CPU model's 8 x T (T = 32 in
    --smoke)."""
    if args.preset:
        from recipes import RECIPES

        return RECIPES[args.preset].global_batch_size, RECIPES[args.preset].seq_length
    return 8, 32 if args.smoke else args.seq_length


def describe(args) -> str:
    """The model and data of the arms, in words."""
    if args.preset:
        from recipes import RECIPES

        r = RECIPES[args.preset]
        return (
            f"preset {r.name}: dense GPT {r.num_layers} layers, h = {r.hidden_size}, "
            f"ffn {r.ffn_hidden_size}, {r.num_attention_heads} heads / {r.num_query_groups} KV "
            f"groups, untied embeddings, T = {r.seq_length}, global batch {r.global_batch_size}, "
            f"WSD with {r.lr_warmup_iters} warmup steps; data {args.data_path}"
        )
    model = (
        "MoE GPT (4 layers, h = 128, 8 experts top-2, EP = 2)"
        if args.model == "moe"
        else "dense GPT (4 layers, h = 128, ffn 512, DP = 2)"
    )
    if args.smoke:
        model = f"{args.model} GPT (smoke size: 2 layers, h = 64)"
    gbs, seq = batch_shape(args)
    return (
        f"{model}, T = {seq}, micro-batch 4, global batch {gbs}, WSD; {args.corpus_label} corpus "
        f"(SentencePiece {args.vocab_size}), 98/2 train/validation split"
    )


def tst_flags(bag_size: int, fraction: float, mode: str) -> list[str]:
    """The ``--tst-*`` flags of an arm; ``--tst-mode`` only for the non-default modes."""
    flags = ["--tst-bag-size", str(bag_size), "--tst-phase1-fraction", str(fraction)]
    return flags + (["--tst-mode", mode] if mode != "full" else [])


def lr_flags(lr: float) -> list[str]:
    return ["--lr", str(lr), "--min-lr", str(lr / 10)]


def run_baselines(args, base_flags: list[str], lrs, prefix: str = "") -> tuple[list, dict]:
    """The baseline at each LR of ``lrs``; returns ``(all, best)`` (lowest final validation)."""
    baselines = []
    for lr in lrs:
        arm = run_arm(
            args, f"{prefix}baseline-lr{lr:g}", base_flags + lr_flags(lr) + ["--tst-bag-size", "1"]
        )
        if arm is None:  # not node 0
            arm = {"valid": [(0, 0.0)], "wall_s": 0.0}
        arm["lr"] = lr
        baselines.append(arm)
        print(
            f"{prefix}baseline LR {lr:g}: final validation loss {arm['valid'][-1][1]:.4f} "
            f"({arm['wall_s']:.0f} s)",
            flush=True,
        )
    return baselines, min(baselines, key=lambda b: b["valid"][-1][1])


# --- horizons --------------------------------------------------------------------


def split_tokens(prefix: str, split: str = "98,2,0", index: int = 0) -> int:
    """Tokens in split ``index`` (0 training, 1 validation) of the ``.bin/.idx`` dataset
    ``prefix``, as megatron-core's dataset builder splits its documents (``round(bookend x
    documents)``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)  # keep it alive: its arrays view its memory map
    lengths = [int(n) for n in dataset.sequence_lengths]
    del dataset
    shares = [float(x) for x in split.split(",")]
    bookends = [round(sum(shares[:i]) / sum(shares) * len(lengths)) for i in range(len(shares) + 1)]
    return sum(lengths[bookends[index] : bookends[index + 1]])


def corpus_digest(prefix: str) -> str:
    """The first 16 hex digits of the SHA-256 of the dataset ``prefix``'s ``.idx`` then
    ``.bin`` bytes: the same tokens give the same digest wherever the files lie. A report
    quotes it so that two runs on different data cannot be compared unnoticed (one corpus
    file naming the checkout's path once moved the training split by 2 tokens and a
    600-step loss by 0.014 nats).

    Raises FileNotFoundError when either file is missing."""
    import hashlib

    digest = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        with open(prefix + suffix, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def crossing(points: list) -> "tuple | None":
    """Where ``(steps, TST - baseline)`` points first go from above 0 to at or below it:
    ``(steps_before, steps_after, estimate)`` with the estimate linear in log(steps); None
    when they never cross (the caller tells 'always below' from 'always above')."""
    import math

    for (n0, d0), (n1, d1) in zip(points, points[1:]):
        if d0 > 0 >= d1:
            x = math.log(n0) + (math.log(n1) - math.log(n0)) * d0 / (d0 - d1)
            return n0, n1, round(math.exp(x))
    return None


def crossing_text(label: str, points: list, last_seeds: "list | None" = None) -> str:
    """One line: where the mean gaps ``points`` (``[(steps, gap)]``) change sign, if they do;
    with ``last_seeds`` (the last length's gap at each seed) it adds when those seeds fall on
    both sides of zero: a tie within the seeds' spread, whatever the mean's sign."""
    if not points:
        return f"- {label}: not run."
    tie = ""
    if last_seeds and min(last_seeds) < 0 < max(last_seeds):
        tie = (
            f" At {points[-1][0]} steps its seeds fall on both sides of the baseline "
            f"({min(last_seeds):+.4f} to {max(last_seeds):+.4f}): a tie within the seeds' spread."
        )
    found = crossing(points)
    if found:
        n0, n1, estimate = found
        return (
            f"- {label}: crosses the baseline between {n0} and {n1} steps "
            f"(about {estimate} by linear interpolation in log steps).{tie}"
        )
    if all(d <= 0 for _, d in points):
        return f"- {label}: at or below the baseline at every length measured.{tie}"
    return (
        f"- {label}: above the baseline at every length measured "
        f"(last gap {points[-1][1]:+.4f} nats at {points[-1][0]} steps).{tie}"
    )


def parse_arms(text: str) -> list[tuple[int, str]]:
    """``"2:full,4:full,2:input"`` -> ``[(2, "full"), (4, "full"), (2, "input")]``."""
    arms = []
    for item in text.split(","):
        size, _, mode = item.partition(":")
        if mode not in ("full", "input", "output"):
            raise SystemExit(f"error: --arms item {item!r} must be S:full, S:input or S:output")
        arms.append((int(size), mode))
    return arms


def arm_label(size: int, mode: str) -> str:
    return f"S={size} {mode}"


def run_horizons(args, prefix: str) -> None:
    """Every length of ``--horizons``: the baseline at its best LR, then the arms; the report
    is rewritten after each length, so an interrupted run keeps what it measured."""
    arms = parse_arms(args.arms)
    split = "99,1,0" if args.preset else "98,2,0"
    train_tokens, args.valid_tokens = (split_tokens(prefix, split, i) for i in (0, 1))
    args.corpus_digest = corpus_digest(prefix)
    rows, previous_best = [], None
    for steps in sorted(int(x) for x in args.horizons.split(",")):
        args.train_iters = steps
        args.eval_interval = max(1, steps // (4 if args.smoke else EVAL_ROUNDS))
        base_flags = model_flags(args, prefix)
        baselines, best = run_baselines(
            args,
            base_flags,
            horizon_lrs(args, steps, previous_best),
            prefix=f"h{steps}-{seed_tag(args)}",
        )
        previous_best = best["lr"]
        row = {"steps": steps, "baselines": baselines, "best": best, "replicates": []}
        row["arms"] = run_horizon_arms(args, arms, steps, base_flags, best["lr"])
        first_seed = args.seed
        for seed in args.seeds_list if steps >= args.seeds_min_steps else []:
            if seed == first_seed:
                continue
            args.seed = seed  # a replicate: the same arms at another --seed, the same LR
            flags = model_flags(args, prefix)
            (base,), _ = run_baselines(
                args, flags, [best["lr"]], prefix=f"h{steps}-{seed_tag(args)}"
            )
            replicate = {"seed": seed, "best": base}
            replicate["arms"] = run_horizon_arms(args, arms, steps, flags, best["lr"])
            row["replicates"].append(replicate)
            args.seed = first_seed
        rows.append(row)
        if args.node_rank == 0:
            name = "tst_horizons" + ("_smoke" if args.smoke else "") + seed_tag(args, "_")
            labels = [arm_label(s, m) for s, m in arms]
            plot_horizons(rows, labels, os.path.join(args.output_dir, name + ".png"))
            text = horizons_report(args, rows, labels, train_tokens, name)
            write(os.path.join(args.output_dir, name + ".md"), text)
            write_index(args.output_dir)
            print(text, flush=True)


def run_horizon_arms(args, arms: list, steps: int, base_flags: list, lr: float) -> dict:
    """The TST arms of one length at ``args.seed``: ``{label: arm}`` (node 0)."""
    done = {}
    for index, (size, mode) in enumerate(arms):
        if index >= args.arms_at_every_length and steps > args.extra_arms_max_steps:
            continue
        arm = run_arm(
            args,
            f"h{steps}-{seed_tag(args)}s{size}-{mode}-r{args.phase1_fraction}",
            base_flags + lr_flags(lr) + tst_flags(size, args.phase1_fraction, mode),
        )
        if arm is None:
            continue
        done[arm_label(size, mode)] = arm
        print(
            f"h{steps} seed {args.seed} {arm_label(size, mode)}: final validation loss "
            f"{arm['valid'][-1][1]:.4f} ({arm['wall_s']:.0f} s)",
            flush=True,
        )
    return done


def seed_tag(args, sep: str = "-") -> str:
    """Names another seed's arms (``seed<N>-``) and report (``_seed<N>``, with sep ``"_"``)
    apart from the default seed 1234's, which get ``""``: a replicate of the measurement."""
    if args.seed == 1234:
        return ""
    return f"_seed{args.seed}" if sep == "_" else f"seed{args.seed}-"


def horizon_lrs(args, steps: int, previous_best) -> list:
    """The baseline LRs tried at one length: ``--baseline-lr`` if it names this length; else
    every ``--lrs`` up to ``--lr-sweep-max-steps``; beyond it, to fit the budget, the previous
    length's best LR and half of it (the best LR does not grow with the horizon at a fixed
    batch, so the sweep follows it downwards)."""
    if steps in args.baseline_lr:
        return [args.baseline_lr[steps]]
    if args.lr_sweep_max_steps is None or steps <= args.lr_sweep_max_steps or not previous_best:
        return args.lrs_list
    return [previous_best, previous_best / 2]


def arm_lr(arm: dict) -> float:
    """The ``--lr`` of an arm's launcher command."""
    words = shlex.split(arm["command"])
    return float(words[len(words) - 1 - words[::-1].index("--lr") + 1])


def seed_gaps(row: dict, label: str) -> list:
    """TST - baseline final validation loss of one arm at one length, one value per seed:
    each seed's arm against the same seed's baseline (paired)."""
    runs = [row] + row.get("replicates", [])
    return [
        r["arms"][label]["valid"][-1][1] - r["best"]["valid"][-1][1]
        for r in runs
        if label in r["arms"]
    ]


def gaps(rows: list, label: str) -> list:
    """``[(steps, mean TST - baseline final validation loss over the seeds)]`` of one arm
    across the lengths."""
    return [(r["steps"], sum(g) / len(g)) for r in rows if (g := seed_gaps(r, label))]


def below_text(rows: list, labels: list) -> str:
    """The report's line of the lengths where an arm is below the baseline: below at every
    seed run, or below on the mean only, not at every seed (a tie within the seeds' spread,
    not a win)."""
    every, mean_only = [], []
    for label in labels:
        for r in rows:
            values = seed_gaps(r, label)
            if values and max(values) < 0:
                one = ", one seed" if len(values) == 1 else ""
                every.append(f"{label} at {r['steps']} steps ({gap_cell(values)}{one})")
            elif values and sum(values) < 0:
                mean_only.append(f"{label} at {r['steps']} steps ({gap_cell(values)})")
    text = "TST below the baseline at equal steps, at every seed run: " + (
        "; ".join(every) if every else "none"
    )
    if mean_only:
        text += "; below on the mean only, not at every seed (a tie): " + "; ".join(mean_only)
    return text + "."


def gap_cell(values: list) -> str:
    """``+0.0123`` for one seed; ``+0.0123 [-0.0040, +0.0301] (3 seeds)``: mean, then the
    smallest and largest seed's gap."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:+.4f}"
    return f"{mean:+.4f} [{min(values):+.4f}, {max(values):+.4f}] ({len(values)} seeds)"


def horizons_report(args, rows: list, labels: list, train_tokens: int, name: str) -> str:
    _, seq = batch_shape(args)
    header = "| steps | baseline LR | baseline final validation loss (passes) | " + " | ".join(
        f"{label}: TST - baseline (passes)" for label in labels
    )
    lines = [
        "# TST vs baseline across training horizons",
        "",
        machine_line(args),
        "",
        f"Model/data: {describe(args)}. Every arm has its own complete WSD schedule (warmup "
        f"N/20, decay over the last 10 %); r = {args.phase1_fraction}; every TST arm uses the "
        "baseline's best LR at that length. Training split: "
        f"{train_tokens:,} tokens; a *pass* is the tokens an arm read divided by that "
        "(more than 1: the data was repeated). Corpus: the first 16 hex digits of the "
        f"SHA-256 of the `.idx` and `.bin`, `{args.corpus_digest}` (the same digest, the "
        "same tokens).",
        "",
        "Validation: the final validation loss (the table, the gaps) is Megatron-LM's own "
        "evaluation of each arm's last checkpoint on the whole validation split "
        f"({args.valid_tokens:,} held-out tokens, {whole_split_iters(args)} global batches of "
        f"{batch_shape(args)[0]} x {seq}: the launcher with `--skip-train --load`), so every "
        "arm is scored on the same windows and the gaps are paired; during training "
        f"{args.eval_iters} batches every N/{4 if args.smoke else EVAL_ROUNDS} steps and at the "
        f"switch. Seed {args.seed}"
        + (
            f"; at {args.seeds_min_steps} steps and more also seeds "
            f"{', '.join(str(x) for x in args.seeds_list if x != args.seed)}, each arm against "
            "the baseline of its own seed (at the first seed's best LR); a cell gives the mean "
            "gap and, in brackets, the smallest and largest seed's gap (the plot's error bars)."
            if len(args.seeds_list) > 1
            else "."
        ),
        "",
        "Modes: `full` = bag-averaged input and MCE over the next bag; `input` = bag-averaged "
        "input, next bag's first token as the target; `output` = ordinary token input, each "
        "position scored with the MCE on the S tokens that follow it (reads what the baseline reads).",
        "",
        header + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    for r in rows:
        base = r["best"]
        cells = [
            str(r["steps"]),
            f"{base['lr']:g}",
            f"{base['valid'][-1][1]:.4f} ({base['tokens'] / train_tokens:.3g})",
        ]
        for label in labels:
            arm = r["arms"].get(label)
            cells.append(
                f"{gap_cell(seed_gaps(r, label))} ({arm['tokens'] / train_tokens:.3g})"
                if arm
                else "not run"
            )
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:  # arms read back by --reuse may predate a better baseline LR
        lrs = {arm_lr(arm) for arm in r["arms"].values()} - {r["best"]["lr"]}
        if lrs:
            lines += [
                "",
                f"At {r['steps']} steps the TST arms ran at LR "
                f"{', '.join(f'{lr:g}' for lr in sorted(lrs))}, not at the baseline's best "
                f"({r['best']['lr']:g}): the gaps above are against the better baseline.",
            ]
    lines += ["", "## Where the curves cross", ""]
    for label in labels:
        seeds = [g for r in rows if (g := seed_gaps(r, label))]
        lines.append(crossing_text(label, gaps(rows, label), seeds[-1] if seeds else None))
    lines += [
        "",
        below_text(rows, labels),
        "",
        f"![TST - baseline against steps]({name}.png)",
        "",
        "## Learning rates tried for the baseline",
        "",
        "| steps | LR | final validation loss |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['steps']} | {b['lr']:g} | {b['valid'][-1][1]:.4f} |"
        for r in rows
        for b in r["baselines"]
    ]
    lines += ["", f"Command: `.venv/bin/python {invocation()}`; each arm's launcher command:", ""]
    for r in rows:
        lines.append(f"    {r['best']['command']}")
        lines += [f"    {arm['command']}" for arm in r["arms"].values()]
    return "\n".join(lines) + "\n"


def plot_horizons(rows: list, labels: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for label in labels:
        points = gaps(rows, label)
        if points:
            spread = [seed_gaps(r, label) for r in rows if seed_gaps(r, label)]
            low = [mean - min(g) for (_, mean), g in zip(points, spread)]
            high = [max(g) - mean for (_, mean), g in zip(points, spread)]
            ax.errorbar(*zip(*points), yerr=[low, high], fmt="o-", ms=4, capsize=3, label=label)
    ax.axhline(0.0, color="gray", ls="--", lw=1, label="baseline")
    ax.set_xscale("log")
    steps = [r["steps"] for r in rows]
    ax.set_xticks(steps, [str(n) for n in steps])
    ax.minorticks_off()
    ax.set_xlabel("training steps (each run its own WSD schedule; equal FLOPs per step)")
    ax.set_ylabel("TST - baseline final validation loss (nats)")
    save_figure(fig, ax, path)


# --- entry point ----------------------------------------------------------------------------


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
    p.add_argument("--train-iters", type=int, default=None)
    p.add_argument(
        "--seed", type=int, default=1234, help="every arm's --seed (another: a replicate)"
    )
    p.add_argument(
        "--seeds",
        default="",
        help="--horizons: more seeds, e.g. 1234,1235,1236: at lengths >= --seeds-min-steps the "
        "baseline (at the first seed's best LR) and the arms run at each; gaps are paired by seed",
    )
    p.add_argument("--seeds-min-steps", type=int, default=3000)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--bag-size", type=int, default=None)
    p.add_argument("--phase1-fraction", type=float, default=None)
    p.add_argument("--lrs", default=None, help="learning rates tried for the baseline")
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--corpus-max-bytes", type=int, default=40_000_000, help="--horizons corpus cap")
    p.add_argument("--data-path", default=None, help="an existing .bin/.idx prefix (GPU recipes)")
    p.add_argument("--tokenizer-model", default=None, help="its tokenizer (with --data-path)")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--output-dir", default=os.path.join(ROOT, "docs", "results"))
    p.add_argument("--reuse", action="store_true", help="read back arms already finished")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: 2 on CPU, 8 on GPU")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None)
    args = p.parse_args(argv)
    if args.preset:
        from recipes import RECIPES

        if args.preset not in RECIPES:
            p.error(f"--preset must be one of {', '.join(RECIPES)}")
        if args.device != "cuda" or not args.data_path or not args.tokenizer_model:
            p.error("--preset needs --device cuda, --data-path and --tokenizer-model")
        recipe = RECIPES[args.preset]
        args.bag_size = args.bag_size or recipe.bag_size
        args.phase1_fraction = args.phase1_fraction or recipe.phase1_fraction
        args.lrs = args.lrs or str(recipe.lr)
        args.train_iters = args.train_iters or recipe.train_iters
        args.nproc_per_node = args.nproc_per_node or recipe.gpus_per_node
    if args.nnodes > 1 and (args.master_port is None or args.master_addr == "127.0.0.1"):
        p.error("--nnodes > 1 needs --master-addr and --master-port (the same on every node)")
    args.model = args.model or ("dense" if args.horizons else "moe")
    args.bag_size = args.bag_size or 4
    args.phase1_fraction = args.phase1_fraction or 0.3
    args.lrs = args.lrs or "1e-3,2e-3,4e-3"
    args.lrs_list = [float(x) for x in args.lrs.split(",")]
    args.seeds_list = [int(x) for x in args.seeds.split(",") if x]
    args.baseline_lr = {
        int(k): float(v)
        for k, v in (item.split("=") for item in args.baseline_lr.split(",") if item)
    }
    args.nproc_per_node = args.nproc_per_node or (8 if args.device == "cuda" else 2)
    args.train_iters = args.train_iters or (12 if args.smoke else 600)
    args.vocab_size = args.vocab_size or (512 if args.smoke else 4096)
    args.eval_interval = max(1, args.train_iters // (4 if args.smoke else 12))
    args.eval_iters = 1 if args.smoke else 4
    kind = ("smoke" if args.smoke else "full") + ("-horizons" if args.horizons else "")
    args.data_dir = args.data_dir or os.path.join(ROOT, "runs", "bench", f"data-{kind}")
    args.work_dir = args.work_dir or os.path.join(ROOT, "runs", "bench", args.preset or kind)
    return args


def prepare_data(args) -> str:
    """The dataset prefix: ``--data-path`` as given, or the corpus built under ``--data-dir``."""
    if args.data_path:
        args.corpus_label = args.data_path
        return args.data_path
    if args.horizons and not args.smoke:
        sources = ("python-stdlib", "python-site-packages")
        args.corpus_label = (
            f"python-stdlib + python-site-packages ({args.corpus_max_bytes / 1e6:g} MB)"
        )
        return ensure_data(
            args.data_dir,
            args.vocab_size,
            None,
            sources=sources,
            max_bytes=args.corpus_max_bytes,
            name="code",
        )
    args.corpus_label = "python-stdlib"
    return ensure_data(args.data_dir, args.vocab_size, 60 if args.smoke else None)


def main() -> int:
    args = parse()
    prefix = prepare_data(args)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.horizons:
        run_horizons(args, prefix)
        return 0
    base_flags = model_flags(args, prefix)
    baselines, best = run_baselines(args, base_flags, args.lrs_list)
    grid = (
        [(s, r) for s in (2, 4, 6, 8) for r in (0.2, 0.3, 0.5)]
        if args.grid
        else [(args.bag_size, args.phase1_fraction)]
    )
    grid_rows = []
    for s, r in grid:
        args.bag_size, args.phase1_fraction = s, r
        tst = run_arm(
            args, f"tst-s{s}-r{r}", base_flags + lr_flags(best["lr"]) + tst_flags(s, r, "full")
        )
        if tst is None:  # not node 0: the report is node 0's
            continue
        print(
            f"TST S={s} r={r}: final validation loss {tst['valid'][-1][1]:.4f} ({tst['wall_s']:.0f} s)"
        )
        reach = first_step_reaching(tst["valid"], best["valid"][-1][1])
        grid_rows.append(
            f"| {s} | {r} | {tst['valid'][-1][1]:.4f} | {tst['valid'][-1][1] - best['valid'][-1][1]:+.4f} "
            f"| {reach if reach else 'not reached'} | {tst['tokens']} |"
        )
        if not args.grid:
            name = (args.preset or "tst_vs_baseline").replace("-", "_") + (
                "_smoke" if args.smoke else ""
            )
            if args.preset:
                name = "tst_vs_baseline_" + name
            plot(args, best, tst, os.path.join(args.output_dir, name + ".png"))
            text = report(args, baselines, best, tst).replace("tst_vs_baseline.png", name + ".png")
            write(os.path.join(args.output_dir, name + ".md"), text)
            print(text)
    if args.grid and grid_rows:
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
    if args.node_rank == 0:
        write_index(args.output_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
