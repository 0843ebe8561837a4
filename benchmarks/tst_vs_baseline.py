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
    unique: bool = False,
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
            + (["--max-bytes", str(max_bytes)] if max_bytes else [])
            + (["--unique"] if unique else []),
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
    if args.model == "moe" and args.horizons:
        return moe_horizon_flags(args) + _common_flags(args, data_prefix, tok)
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


MOE_FFN_HIDDEN_SIZE = 128
"""Width of each expert of the ``--horizons --model moe`` arms (top-2: 256 active, against the
dense arms' 512; 8 experts: 1024 in all)."""


def moe_horizon_flags(args) -> list[str]:
    """The ``--horizons --model moe`` model: a small Qwen3-MoE-like GPT (RMSNorm, SwiGLU
    experts, qk-layernorm, GQA, untied embeddings from :func:`_common_flags`): 4 layers (2 in
    --smoke), h = 128 (64), 4 heads over 2 KV groups, every layer an MoE of 8 experts top-2
    (``--moe-ffn-hidden-size`` :data:`MOE_FFN_HIDDEN_SIZE`), the alltoall dispatcher, EP = 2
    on the 2 processes, a dropless router with Megatron-LM's aux loss at 1e-2, and per-layer
    router metrics in TensorBoard (``--moe-per-layer-logging``)."""
    layers, hidden, seq = ("2", "64", "32") if args.smoke else ("4", "128", str(args.seq_length))
    expert = str(MOE_FFN_HIDDEN_SIZE // (2 if args.smoke else 1))
    return [
        "--num-layers",
        layers,
        "--hidden-size",
        hidden,
        "--ffn-hidden-size",
        str(4 * int(hidden)),  # Megatron-LM wants one; every layer is an MoE layer
        "--seq-length",
        seq,
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--qk-layernorm",
        "--num-experts",
        "8",
        "--moe-router-topk",
        "2",
        "--moe-ffn-hidden-size",
        expert,
        "--expert-model-parallel-size",
        "2",
        "--moe-router-load-balancing-type",
        "aux_loss",
        "--moe-aux-loss-coeff",
        "1e-2",
        "--moe-per-layer-logging",
    ]


def _common_flags(args, data_prefix: str, tok: str) -> list[str]:
    return [
        "--device",
        args.device,
        "--data-path",
        data_prefix,
        "--split",
        args.split,
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
MOE_LAUNCHER = "benchmarks/moe_launcher.py"
"""The ``--horizons --model moe`` arms' launcher: :data:`LAUNCHER` plus the router's load
imbalance in TensorBoard (``benchmarks/moe_launcher.py``)."""


def launcher_script(args) -> str:
    return MOE_LAUNCHER if args.model == "moe" and args.horizons else LAUNCHER


def flag_value(flags: list, name: str, default=None):
    """The value after the last ``name`` in ``flags`` (``default`` when absent)."""
    if name not in flags:
        return default
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def raw_tokens(flags: list, phases: list) -> int:
    """Tokens an arm read: for each iteration of the ``tst-phase`` series (``(step, phase)``),
    the global batch times ``S*T`` in phase 1 (``T`` with ``--tst-mode output``, which reads
    ordinary windows) or ``T`` in phase 2, as the launcher's raw-tokens counts."""
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
    arm = {
        "valid": scalars[tag],
        "switch": switch_iteration(phases),
        "tokens": raw_tokens(flags, phases),
        "steps": phases[-1][0],
    }
    router = {tag: points for tag, points in scalars.items() if is_router_tag(tag)}
    if router:
        arm["router"] = router
    return arm


ROUTER_TAGS = ("load_balancing_loss", "load_imbalance")
"""The router's TensorBoard series an MoE arm records: Megatron-LM's aux loss (over its
coefficient; mean over layers) and ``benchmarks/moe_launcher.py``'s max/mean tokens per
expert, each also per layer (``moe/<tag>_layer_<i>``, ``--moe-per-layer-logging``)."""


def is_router_tag(tag: str) -> bool:
    return tag in ROUTER_TAGS or any(tag.startswith(f"moe/{name}_layer_") for name in ROUTER_TAGS)


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


def score_whole_split(
    options, flags, ckpt: str, eval_iters: int, env, script: str = LAUNCHER
) -> "tuple | None":
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
    command = [TORCHRUN, *options, script, *flags, "--load", ckpt, "--skip-train"]
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
    ``arm.json`` exists is read back, unless it records another corpus digest than this run's
    data (then it is trained again; with ``--report-only`` left out)."""
    import json
    import shutil

    arm_dir = os.path.join(args.work_dir, name)
    saved = os.path.join(arm_dir, "arm.json")
    digest = getattr(args, "corpus_digest", None)
    if (args.reuse or args.report_only) and os.path.exists(saved):
        with open(saved) as f:
            arm = json.load(f)
        if arm.get("corpus_digest", digest) == digest:
            return arm
        # another corpus (the python-site-packages source depends on the venv): not comparable
        print(f"{name}: trained on corpus {arm['corpus_digest']}, not {digest}; not reused")
    if args.report_only:
        return None
    tb = os.path.join(arm_dir, "tensorboard")
    if os.path.isdir(arm_dir) and args.node_rank == 0:
        shutil.rmtree(arm_dir)
    os.makedirs(arm_dir, exist_ok=True)
    options = launcher(args)
    ckpt = os.path.join(arm_dir, "checkpoint")
    score = whole_split_iters(args) if args.horizons else None
    save = ["--save", ckpt, "--save-interval", str(args.train_iters), "--no-tst-save-at-switch"]
    command = [TORCHRUN, *options, launcher_script(args), *flags, "--tensorboard-dir", tb]
    command += save if score else []
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # a fresh rendezvous port (the training run's may still be held)
    final = (
        score_whole_split(launcher(args), flags, ckpt, score, env, launcher_script(args))
        if score
        else None
    )
    if args.node_rank != 0:
        return None
    arm = {
        "name": name,
        "wall_s": wall,
        "command": shlex.join(["torchrun", *options[:2], *command[1 + len(options) :]]),
        "corpus_digest": digest,
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
    if args.model == "moe" and args.horizons:
        layers, hidden = (2, 64) if args.smoke else (4, 128)
        model = (
            f"Qwen3-MoE-like GPT ({layers} layers, h = {hidden}, 4 heads / 2 KV groups, "
            f"qk-layernorm, RMSNorm, every layer 8 SwiGLU experts of "
            f"{MOE_FFN_HIDDEN_SIZE // (2 if args.smoke else 1)} top-2, dropless, alltoall "
            "dispatcher, aux loss 1e-2, EP = 2 and DP = 2 on the 2 processes, untied "
            "embeddings)"
        )
    elif args.smoke:
        model = f"{args.model} GPT (smoke size: 2 layers, h = 64)"
    gbs, seq = batch_shape(args)
    return (
        f"{model}, T = {seq}, micro-batch 4, global batch {gbs}, WSD; {args.corpus_label} corpus "
        f"(SentencePiece {args.vocab_size}), "
        f"{'/'.join(getattr(args, 'split', '98,2,0').split(',')[:2])} train/validation split"
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
        if arm is None and args.report_only:  # not run yet
            continue
        if arm is None:  # not node 0
            arm = {"valid": [(0, 0.0)], "wall_s": 0.0}
        arm["lr"] = lr
        baselines.append(arm)
        print(
            f"{prefix}baseline LR {lr:g}: final validation loss {arm['valid'][-1][1]:.4f} "
            f"({arm['wall_s']:.0f} s)",
            flush=True,
        )
    if not baselines:
        return [], None
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


def parse_arms(text: str) -> list[tuple]:
    """``"2:full,4:full,2:input"`` -> ``[(2, "full"), (4, "full"), (2, "input")]``; an item
    ``S:mode:r`` gives the arm its own phase-1 fraction: ``"8:full:0.25"`` -> ``(8, "full",
    0.25)`` (the others use ``--phase1-fraction``)."""
    arms = []
    for item in text.split(","):
        size, mode, *rest = item.split(":") + [""]
        rest = [x for x in rest if x]
        if mode not in ("full", "input", "output") or len(rest) > 1:
            raise SystemExit(
                f"error: --arms item {item!r} must be S:full, S:input or S:output, "
                "optionally :r (e.g. 8:full:0.25)"
            )
        arms.append((int(size), mode, float(rest[0])) if rest else (int(size), mode))
    return arms


def arm_label(size: int, mode: str, fraction: "float | None" = None) -> str:
    return f"S={size} {mode}" + (f" r={fraction:g}" if fraction is not None else "")


def run_horizons(args, prefix: str) -> None:
    """Every length of ``--horizons``: the baseline at its best LR, then the arms; the report
    is rewritten after each length, so an interrupted run keeps what it measured. With
    ``--report-only`` nothing runs: the report is written from the arm files there are."""
    arms = parse_arms(args.arms)
    train_tokens, args.valid_tokens = (split_tokens(prefix, args.split, i) for i in (0, 1))
    args.corpus_digest = corpus_digest(prefix)
    rows, previous_best = [], None
    lengths = sorted(int(x) for x in args.horizons.split(","))
    for steps in lengths:
        args.train_iters = steps
        args.eval_interval = max(1, steps // (4 if args.smoke else EVAL_ROUNDS))
        base_flags = model_flags(args, prefix)
        baselines, best = run_baselines(
            args,
            base_flags,
            horizon_lrs(args, steps, previous_best),
            prefix=f"h{steps}-{seed_tag(args)}",
        )
        if best is None:  # --report-only, this length's baseline not run yet
            continue
        previous_best = best["lr"]
        row = {"steps": steps, "baselines": baselines, "best": best, "replicates": []}
        row["arms"] = run_horizon_arms(args, arms, steps, base_flags, best["lr"])
        first_seed = args.seed
        seeded = steps >= args.seeds_min_steps and (
            args.seeds_max_steps is None or steps <= args.seeds_max_steps
        )
        for seed in args.seeds_list if seeded else []:
            if seed == first_seed:
                continue
            args.seed = seed  # a replicate: the same arms at another --seed, the same LR
            flags = model_flags(args, prefix)
            bases, _ = run_baselines(args, flags, [best["lr"]], prefix=f"h{steps}-{seed_tag(args)}")
            replicate = {"seed": seed, "best": bases[0] if bases else None}
            replicate["arms"] = run_horizon_arms(args, arms, steps, flags, best["lr"])
            if replicate["best"] is not None:
                row["replicates"].append(replicate)
            args.seed = first_seed
        rows.append(row)
        if args.node_rank == 0:
            write_horizons_report(args, rows, arms, train_tokens)


def horizons_name(args) -> str:
    """The report's file name: ``tst_moe`` for the MoE arms, ``tst_horizons`` for the dense
    ones; ``_smoke`` and another seed's ``_seed<N>`` appended."""
    name = args.report_name or ("tst_moe" if args.model == "moe" else "tst_horizons")
    return name + ("_smoke" if args.smoke else "") + seed_tag(args, "_")


def write_horizons_report(args, rows: list, arms: list, train_tokens: int) -> None:
    name = horizons_name(args)
    labels = [arm_label(*spec) for spec in arms]
    plot_horizons(rows, labels, os.path.join(args.output_dir, name + ".png"))
    text = horizons_report(args, rows, labels, train_tokens, name)
    if args.model == "moe":
        router_png = name + "_router.png"
        if plot_router(rows, labels, os.path.join(args.output_dir, router_png)):
            text += "\n" + router_report(rows, labels, router_png)
        text += "\n" + dense_speedup_report(args.dense_report)
        if os.path.exists(os.path.join(args.output_dir, "tst_moe_cost.md")):
            text += (
                "\nCost per step of this MoE against the dense model of the dense study, side "
                "by side: [tst_moe_cost](tst_moe_cost.md).\n"
            )
    write(os.path.join(args.output_dir, name + ".md"), text)
    write_index(args.output_dir)
    print(text, flush=True)


def run_horizon_arms(args, arms: list, steps: int, base_flags: list, lr: float) -> dict:
    """The TST arms of one length at ``args.seed``: ``{label: arm}`` (node 0)."""
    done = {}
    for index, spec in enumerate(arms):
        if index >= args.arms_at_every_length and steps > args.extra_arms_max_steps:
            continue
        size, mode = spec[:2]
        fraction = spec[2] if len(spec) > 2 else args.phase1_fraction
        arm = run_arm(
            args,
            f"h{steps}-{seed_tag(args)}s{size}-{mode}-r{fraction}",
            base_flags + lr_flags(lr) + tst_flags(size, fraction, mode),
        )
        if arm is None:
            continue
        done[arm_label(*spec)] = arm
        print(
            f"h{steps} seed {args.seed} {arm_label(*spec)}: final validation loss "
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


# --- the paper's metric: equal-loss speedup -------------------------------------------


def equal_loss_steps(curve: list, loss: float) -> tuple:
    """The baseline length ``L'`` that reaches ``loss``: ``curve`` is the baseline's final
    validation loss at each measured length, ``[(steps, loss)]``; ``L'`` is interpolated
    linearly in log(steps) between the two measured lengths whose losses bracket ``loss``
    (the shortest such pair). Returns ``(L', "")``, or ``(None, "beyond")`` when ``loss`` is
    below every measured baseline loss (the baseline needs more than its longest length),
    ``(None, "above")`` when it is above every one (less than its shortest length).

    Baseline lengths 1000 -> 3.0 and 4000 -> 2.0, loss 2.5: ``L' = exp(log 1000 + log 4 / 2)
    = 2000``."""
    import math

    points = sorted(curve)
    if not points:
        raise ValueError("no baseline lengths")
    for (n0, l0), (n1, l1) in zip(points, points[1:]):
        if min(l0, l1) <= loss <= max(l0, l1):
            if l0 == l1:
                return float(n0), ""
            x = math.log(n0) + (math.log(n1) - math.log(n0)) * (l0 - loss) / (l0 - l1)
            return math.exp(x), ""
    if len(points) == 1 and loss == points[0][1]:
        return float(points[0][0]), ""
    if loss < min(v for _, v in points):
        return None, "beyond"
    if loss > max(v for _, v in points):
        return None, "above"
    return None, "unbracketed"  # a non-monotone curve that still misses loss: not expected


def equal_loss_speedup(curve: list, steps: int, loss: float) -> tuple:
    """``L' / L`` for an arm of ``steps`` = L with final validation loss ``loss``
    (:func:`equal_loss_steps`), as ``(value, where)``: ``where`` "" (exact), ``">"`` (beyond
    the longest baseline: the speedup is more than ``longest / L``, the value given), ``"<"``
    (above the shortest: less than ``shortest / L``)."""
    found, where = equal_loss_steps(curve, loss)
    lengths = [n for n, _ in curve]
    if where == "beyond":
        return max(lengths) / steps, ">"
    if where == "above":
        return min(lengths) / steps, "<"
    if where:
        return float("nan"), "?"
    return found / steps, ""


def baseline_curve(rows: list) -> list:
    """``[(steps, baseline final validation loss)]``, the mean over the seeds run at each
    length (the first seed's best-LR baseline and its replicates)."""
    curve = []
    for r in rows:
        losses = [r["best"]["valid"][-1][1]] + [
            x["best"]["valid"][-1][1] for x in r.get("replicates", [])
        ]
        curve.append((r["steps"], sum(losses) / len(losses)))
    return curve


def seed_speedups(rows: list, row: dict, label: str) -> list:
    """One arm's equal-loss speedup at one length, one ``(value, where)`` per seed: the
    seed's paired gap (arm - the same seed's baseline, :func:`seed_gaps`) added to the
    baseline curve's loss at that length (:func:`baseline_curve`, the mean over seeds), then
    read off that curve. Pairing removes the seed's offset, as the gaps do."""
    curve = baseline_curve(rows)
    at = dict(curve)[row["steps"]]
    return [equal_loss_speedup(curve, row["steps"], at + g) for g in seed_gaps(row, label)]


def speedup_cell(values: list) -> str:
    """``1.85`` (one seed); ``1.85 [1.60, 2.10] (3 seeds)``: mean, smallest, largest; with
    any seed outside the measured baselines, each seed's value (``>2.00``: beyond the longest
    baseline, more than that; ``<0.50``: above the shortest, less than that)."""
    if not values:
        return "not run"
    if any(where for _, where in values):
        cells = [f"{where}{value:.2f}" for value, where in values]
        note = (
            " (beyond the longest baseline)"
            if all(w == ">" for _, w in values)
            else " (above the shortest baseline)"
            if all(w == "<" for _, w in values)
            else ""
        )
        return ", ".join(cells) + note
    mean = sum(v for v, _ in values) / len(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    low, high = min(v for v, _ in values), max(v for v, _ in values)
    return f"{mean:.2f} [{low:.2f}, {high:.2f}] ({len(values)} seeds)"


def ranking_lines(rows: list, labels: list) -> list:
    """At each length with more than one arm: the arms from the lowest mean final validation
    loss (TST - baseline, over the seeds run) up."""
    lines = []
    for r in rows:
        ranked = sorted((sum(g) / len(g), label) for label in labels if (g := seed_gaps(r, label)))
        if len(ranked) > 1:
            lines.append(
                f"Arms at {r['steps']} steps from the lowest final validation loss: "
                + ", ".join(f"{label} ({gap:+.4f})" for gap, label in ranked)
                + "."
            )
    return lines + [""] if lines else []


def speedup_section(rows: list, labels: list) -> list:
    """The report's lines of the equal-loss speedup of every arm at every length."""
    curve = baseline_curve(rows)
    lines = [
        "## Equal-loss speedup (the paper's metric)",
        "",
        "For a TST arm of L steps with final validation loss x: the baseline length L' that "
        "reaches x, linear in log(steps) between the measured baseline lengths (each its own "
        "complete WSD run at its best LR; the mean over the seeds run at that length: "
        + ", ".join(f"{n}: {v:.4f}" for n, v in curve)
        + "); speedup = L'/L. Each seed's x is its paired gap added to the baseline's mean "
        "at L; a cell gives the mean and, in brackets, the smallest and largest seed. `>a`: "
        "below the longest baseline's loss, a speedup of more than a; `<a`: above the "
        "shortest baseline's loss, less than a.",
        "",
        "| steps | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for r in rows:
        cells = [speedup_cell(seed_speedups(rows, r, label)) for label in labels]
        lines.append(f"| {r['steps']} | " + " | ".join(cells) + " |")
    return lines


#: The confidence level of the paired intervals.
LEVEL = 0.95


def paired_interval(values: list, level: float = LEVEL) -> tuple:
    """``(mean, low, high)`` of paired gaps over the seeds: Student's t interval
    ``mean +- t_{(1+level)/2, n-1} * s / sqrt(n)``, ``s`` the sample standard deviation
    (``scipy.stats.t``); ``low`` and ``high`` are nan for one seed.

    Gaps -0.1, 0.0, +0.1: mean 0, s = 0.1, t_{0.975, 2} = 4.303: ``(0, -0.248, +0.248)``."""
    import math
    import statistics

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    from scipy.stats import t

    half = t.ppf((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """``ahead`` (the whole interval below zero), ``behind`` (above), else ``tie``."""
    if high < 0:
        return "ahead"
    if low > 0:
        return "behind"
    return "tie (the interval holds 0)"


def statistics_section(rows: list, labels: list) -> list:
    """The report's paired statistics at each length run at two seeds or more: the mean gap,
    its t interval (:func:`paired_interval`), the seeds below the baseline, the equal-loss
    speedup at the mean gap and at the interval's ends (:func:`equal_loss_speedup` on the
    baseline curve of :func:`baseline_curve`: a lower gap is a higher speedup) and the
    verdict (:func:`verdict`)."""
    curve = baseline_curve(rows)
    body = []
    for r in rows:
        for label in labels:
            values = seed_gaps(r, label)
            if len(values) < 2:
                continue
            mean, low, high = paired_interval(values)
            at = dict(curve)[r["steps"]]
            speed = [equal_loss_speedup(curve, r["steps"], at + g) for g in (mean, high, low)]
            (m, mw), (lo, lw), (hi, hw) = speed
            below = sum(v < 0 for v in values)
            body.append(
                f"| {r['steps']} | {label} | {len(values)} | {mean:+.4f} | "
                f"[{low:+.4f}, {high:+.4f}] | {below} of {len(values)} | "
                f"{mw}{m:.2f} [{lw}{lo:.2f}, {hw}{hi:.2f}] | {verdict(low, high)} |"
            )
    if not body:
        return []
    return [
        "",
        "## Paired statistics over the seeds",
        "",
        f"Each row: the mean paired gap (TST - the same seed's baseline), its {LEVEL:.0%} "
        "interval by Student's t over the seeds (n - 1 degrees of freedom, `scipy.stats.t`), "
        "how many seeds are below their baseline, and the equal-loss speedup (as above) at "
        "the mean gap, in brackets at the interval's ends (`>a`, `<a`: beyond the measured "
        "baselines). Ahead or behind only where the whole interval is on one side of 0.",
        "",
        f"| steps | arm | seeds | mean gap | {LEVEL:.0%} t-interval | seeds below | "
        "equal-loss speedup | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *body,
    ]


def dense_speedup_report(path: str) -> str:
    """The equal-loss speedups of the dense horizons table ``path`` (its markdown table:
    steps, LR, baseline loss, then per arm ``mean [min, max]`` gaps): the baseline curve is
    the table's baseline column, an arm's loss that plus its gap; the spread comes from the
    smallest and largest seed's gap (the speedup falls as the loss rises)."""
    if not path or not os.path.exists(path):
        return ""
    rows, labels = dense_table(open(path).read())
    if not rows:
        return ""
    curve = [(n, base) for n, base, _ in rows]
    lines = [
        "## Equal-loss speedup of the dense table",
        "",
        f"From `{os.path.relpath(path, ROOT)}` (its baseline column: "
        + ", ".join(f"{n}: {v:.4f}" for n, v in curve)
        + "; each arm's loss is that plus its gap). A cell: the speedup of the mean gap, then "
        "in brackets those of the largest and smallest seed gap where the table gives them.",
        "",
        "| steps | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for n, base, cells in rows:
        out = []
        for gaps_ in cells:
            if gaps_ is None:
                out.append("not run")
                continue
            mean = equal_loss_speedup(curve, n, base + gaps_[0])
            text = f"{mean[1]}{mean[0]:.2f}"
            if len(gaps_) == 3:
                worst, best_ = (equal_loss_speedup(curve, n, base + g) for g in gaps_[2:0:-1])
                text += f" [{worst[1]}{worst[0]:.2f}, {best_[1]}{best_[0]:.2f}]"
            out.append(text)
        lines.append(f"| {n} | " + " | ".join(out) + " |")
    longest = max(n for n, _ in curve)
    lines += [
        "",
        f"`>a`: the arm is below the {longest}-step baseline, the longest measured; its "
        f"speedup is more than a (a {2 * longest}-step baseline would say how much more). "
        "`<a`: above the shortest baseline.",
        "",
    ]
    return "\n".join(lines)


def dense_table(text: str) -> tuple:
    """``([(steps, baseline loss, [gaps or None per arm])], labels)`` from a horizons report's
    table; gaps are ``[mean]`` or ``[mean, min, max]``."""
    number = r"[+-]?\d+\.\d+"
    rows, labels = [], []
    for line in text.splitlines():
        if line.startswith("| steps | baseline LR |"):
            labels = [c.split(":")[0].strip() for c in line.strip("|").split("|")[3:]]
        elif labels and re.match(r"\| \d+ \|", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            base = float(re.match(number, cells[2]).group())
            arms = []
            for cell in cells[3:]:
                values = [float(x) for x in re.findall(number, cell)]
                if cell.startswith("not run") or not values:
                    arms.append(None)
                    continue
                arms.append(values[:3] if "[" in cell else values[:1])
            rows.append((int(cells[0]), base, arms))
        elif rows:
            break
    return rows, labels


def fraction_text(args, labels: list) -> str:
    """The report's words for the phase-1 fraction r of the arms."""
    if any(" r=" in label for label in labels):
        return f"r as each arm's label gives it (else {args.phase1_fraction:g})"
    return f"r = {args.phase1_fraction}"


def horizons_report(args, rows: list, labels: list, train_tokens: int, name: str) -> str:
    _, seq = batch_shape(args)
    header = "| steps | baseline LR | baseline final validation loss (passes) | " + " | ".join(
        f"{label}: TST - baseline (passes)" for label in labels
    )
    title = "MoE: TST vs baseline" if args.model == "moe" else "TST vs baseline"
    lines = [
        f"# {title} across training horizons",
        "",
        machine_line(args),
        "",
        f"Model/data: {describe(args)}. Every arm has its own complete WSD schedule (warmup "
        f"N/20, decay over the last 10 %); {fraction_text(args, labels)}; every TST arm uses the "
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
    lines += ["", below_text(rows, labels), ""]
    lines += ranking_lines(rows, labels) + speedup_section(rows, labels)
    lines += statistics_section(rows, labels)
    lines += [
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
    written = (
        "Written from the recorded arm files (`arm.json`, nothing run) by"
        if getattr(args, "report_only", False)
        else "Command:"
    )
    lines += ["", f"{written} `.venv/bin/python {invocation()}`; each arm's launcher command:", ""]
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


# --- router health (MoE) -------------------------------------------------------------


def router_length(rows: list, labels: list) -> "dict | None":
    """The row whose router curves the report plots: the one with the most TST arms that
    recorded them (the longest of those)."""
    candidates = [r for r in rows if "router" in r["best"]]
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda r: (sum("router" in r["arms"].get(label, {}) for label in labels), r["steps"]),
    )


def smooth(points: list, window: int) -> list:
    """A trailing moving average of ``[(step, value)]`` (``window`` points)."""
    out, total = [], 0.0
    for i, (step, value) in enumerate(points):
        total += value
        if i >= window:
            total -= points[i - window][1]
        out.append((step, total / min(i + 1, window)))
    return out


def window_mean(points: list, start: int, stop: int) -> "float | None":
    """The mean of ``[(step, value)]`` over ``start < step <= stop``."""
    values = [v for step, v in points if start < step <= stop]
    return sum(values) / len(values) if values else None


def layer_tags(router: dict, name: str) -> list:
    prefix = f"moe/{name}_layer_"
    return sorted((t for t in router if t.startswith(prefix)), key=lambda t: int(t[len(prefix) :]))


def plot_router(rows: list, labels: list, path: str) -> bool:
    """The router's health against steps for the baseline and every TST arm of one length
    (:func:`router_length`): the aux loss (over its coefficient, mean over layers) and the
    load imbalance (max/mean tokens per expert, the worst layer and the mean over layers),
    moving averages over N/60 steps, each arm's switch marked. False when no arm has them."""
    row = router_length(rows, labels)
    if row is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, row["steps"] // 60)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    arms = [("baseline", row["best"])] + [
        (label, row["arms"][label]) for label in labels if "router" in row["arms"].get(label, {})
    ]
    for index, (label, arm) in enumerate(arms):
        router, color = arm["router"], f"C{index}"
        style = dict(color=color, lw=1.2 if label == "baseline" else 1.0)
        if "load_balancing_loss" in router:
            axes[0].plot(*zip(*smooth(router["load_balancing_loss"], window)), label=label, **style)
        if "load_imbalance" in router:
            axes[1].plot(*zip(*smooth(router["load_imbalance"], window)), label=label, **style)
        tags = layer_tags(router, "load_imbalance")
        if tags:
            worst = [
                (step, max(router[t][i][1] for t in tags))
                for i, (step, _) in enumerate(router[tags[0]])
            ]
            axes[2].plot(*zip(*smooth(worst, window)), label=label, **style)
        if arm.get("switch"):
            for ax in axes:
                ax.axvline(arm["switch"], color=color, ls="--", lw=0.8)
    titles = (
        "aux loss / coefficient (mean over layers)",
        "load imbalance, max/mean tokens per expert (mean over layers)",
        "load imbalance, worst layer",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"iteration ({row['steps']}-step runs; dashed: each arm's switch)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def router_report(rows: list, labels: list, png: str) -> str:
    """The router-health section: per arm, the load imbalance and the aux loss in phase 1
    (after the warmup), in the first N/20 steps after the switch and in the last 10 % of the
    run, each against the baseline's over the same steps."""
    row = router_length(rows, labels)
    base = row["best"]["router"]
    n = row["steps"]
    lines = [
        "## Router health across the switch",
        "",
        f"The {n}-step runs of seed {seed_of(row['best'])}. Load imbalance: max over mean tokens "
        "per expert in a layer, over every token of an iteration's global batch (1 is "
        "perfect, 4 the worst for top-2 of 8), recorded by `benchmarks/moe_launcher.py` in "
        "Megatron-LM's MoE metrics tracker, mean over the layers (`load_imbalance`) and per "
        "layer (`moe/load_imbalance_layer_<i>`); aux loss: Megatron-LM's "
        "`load_balancing_loss` (over its coefficient, 1 at uniform routing). Dropless routing: "
        "no capacity, no dropped tokens. Each cell: the arm, then (the baseline over the same "
        "iterations).",
        "",
        "| arm | switch | imbalance: phase 1 | imbalance: first N/20 after the switch | "
        "imbalance: last 10 % | aux loss: phase 1 | aux loss: first N/20 after | aux loss: "
        "last 10 % | worst layer, phase 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for label in labels:
        arm = row["arms"].get(label)
        if not arm or "router" not in arm or not arm.get("switch"):
            continue
        router, switch = arm["router"], arm["switch"]
        windows = [(n // 20, switch), (switch, switch + n // 20), (n - n // 10, n)]
        cells = [label, str(switch)]
        for name in ROUTER_TAGS[::-1]:
            for start, stop in windows:
                mine, theirs = (window_mean(r.get(name, []), start, stop) for r in (router, base))
                cells.append(
                    f"{mine:.3f} ({theirs:.3f})" if mine is not None and theirs is not None else "-"
                )
        tags = layer_tags(router, "load_imbalance")
        worst = [(t, window_mean(router[t], n // 20, switch)) for t in tags]
        worst = [(t, v) for t, v in worst if v is not None]
        if worst:
            t, v = max(worst, key=lambda x: x[1])
            cells.append(f"layer {t.rsplit('_', 1)[1]}: {v:.3f}")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
        phase1 = [window_mean(r.get("load_imbalance", []), n // 20, switch) for r in (router, base)]
        last = [window_mean(r.get("load_imbalance", []), n - n // 10, n) for r in (router, base)]
        if None not in phase1 + last:
            notes.append(router_verdict(label, phase1, last))
    lines += ["", *notes, "", f"![router health against steps]({png})", ""]
    return "\n".join(lines)


ROUTER_TOLERANCE = 0.05
"""A relative difference in mean load imbalance within which an arm counts as level with the
baseline."""


def router_verdict(label: str, phase1: list, last: list) -> str:
    """One line: the arm's mean load imbalance against the baseline's (``[arm, baseline]``)
    in phase 1 and in the last 10 % of the run, and what that says: phase 1 more (or less)
    imbalanced than the baseline by more than :data:`ROUTER_TOLERANCE`, and whether the
    last 10 % is back within it."""
    during, after = phase1[0] / phase1[1] - 1, last[0] / last[1] - 1
    if during > ROUTER_TOLERANCE:
        what = "phase 1 routes less evenly than the baseline"
    elif during < -ROUTER_TOLERANCE:
        what = "phase 1 routes more evenly than the baseline"
    else:
        what = "phase 1 routes as evenly as the baseline"
    if abs(after) <= ROUTER_TOLERANCE:
        end = f"by the last 10 % it is level with the baseline (within {ROUTER_TOLERANCE:.0%})"
    else:
        side = "more" if after > 0 else "less"
        end = f"in the last 10 % it is still {side} imbalanced than the baseline"
    return (
        f"- {label}: {what} ({phase1[0]:.3f} vs {phase1[1]:.3f}, {100 * during:+.1f} %); "
        f"{end} ({last[0]:.3f} vs {last[1]:.3f}, {100 * after:+.1f} %)."
    )


def seed_of(arm: dict) -> str:
    words = shlex.split(arm.get("command", ""))
    return words[words.index("--seed") + 1] if "--seed" in words else "?"


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
    if args.corpus != "code" and (not args.horizons or args.smoke or args.data_path):
        p.error("--corpus prose builds the --horizons corpus: not with --smoke or --data-path")
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
    moe_horizons = args.model == "moe" and args.horizons
    args.corpus_max_bytes = args.corpus_max_bytes or (120_000_000 if moe_horizons else 40_000_000)
    # the MoE study's 120 MB corpus: 1 % is ~0.4 M validation tokens, as the dense study's 2 %
    args.split = "99,1,0" if args.preset or (moe_horizons and not args.smoke) else "98,2,0"
    kind = ("smoke" if args.smoke else "full") + ("-horizons" if args.horizons else "")
    kind = kind.replace("full-", "") if moe_horizons else kind
    kind = ("moe-" if moe_horizons else "") + kind
    kind += "-prose" if args.corpus == "prose" else ""
    args.data_dir = args.data_dir or os.path.join(ROOT, "runs", "bench", f"data-{kind}")
    args.work_dir = args.work_dir or os.path.join(ROOT, "runs", "bench", args.preset or kind)
    return args


def prepare_data(args) -> str:
    """The dataset prefix: ``--data-path`` as given, or the corpus built under ``--data-dir``."""
    if args.data_path:
        args.corpus_label = args.data_path
        return args.data_path
    if args.horizons and not args.smoke and args.corpus == "prose":
        args.corpus_label = "system-docs prose (repeats dropped)"
        return ensure_data(
            args.data_dir,
            args.vocab_size,
            None,
            sources=("system-docs",),
            max_bytes=args.corpus_max_bytes,
            name="prose",
            unique=True,
        )
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
