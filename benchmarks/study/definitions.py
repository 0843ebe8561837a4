"""What a study is, declaratively: the command line fixed once parsed (:class:`Study`), one
training run's length and seed (:class:`Run`), the corpus (:class:`Corpus`), the names of the
arms, and the launcher flags of every arm (Megatron-LM's flags; the model of each study).

Nothing here runs anything or changes a value once built: a length or a seed is a new
:class:`Run`, never an edit of the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EVAL_ROUNDS = 6
"""--horizons: evaluations per run (every N/6 steps); the final one scores the whole split."""
DEFAULT_SEED = 1234
"""The seed of a study run without ``--seed`` or ``--seeds``."""
MOE_FFN_HIDDEN_SIZE = 128
"""Width of each expert of the ``--horizons --model moe`` arms (top-2: 256 active, against the
dense arms' 512; 8 experts: 1024 in all)."""
LAUNCHER = "examples/pretrain_gpt_tst.py"
"""The launcher every arm runs: Megatron-LM's ``pretrain()`` with TST."""
MOE_LAUNCHER = "benchmarks/moe_launcher.py"
"""The ``--horizons --model moe`` arms' launcher: :data:`LAUNCHER` plus the router's load
imbalance in TensorBoard (``benchmarks/moe_launcher.py``)."""


class Study(argparse.Namespace):
    """The study's parsed command line, fixed: assigning an attribute raises AttributeError
    (a run's length and seed live in a :class:`Run`, the corpus in a :class:`Corpus`)."""

    def __init__(self, **values):
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"the study's arguments are fixed once parsed (not {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"the study's arguments are fixed once parsed (not {name!r})")


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a study: ``steps`` (Megatron-LM's ``--train-iters``), ``seed``
    (``--seed``) and ``eval_interval`` (``--eval-interval`` and ``--log-interval``, in
    iterations)."""

    steps: int
    seed: int
    eval_interval: int


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The dataset every arm reads: ``prefix`` (the ``.bin``/``.idx`` prefix, ``--data-path``),
    ``label`` (in words, for the reports) and, for --horizons, ``digest`` (16 hex digits of
    the SHA-256 of ``.idx`` then ``.bin``), ``train_tokens`` and ``valid_tokens`` (tokens of
    the training and validation splits under ``--split``)."""

    prefix: str
    label: str
    digest: "str | None" = None
    train_tokens: "int | None" = None
    valid_tokens: "int | None" = None


def run_of(args, steps: "int | None" = None, seed: "int | None" = None) -> Run:
    """The :class:`Run` of ``steps`` (default ``--train-iters``) at ``seed`` (default the
    study's first): --horizons evaluates every N/6 steps (N/4 in --smoke), the other modes
    every N/12 (N/4)."""
    steps = args.train_iters if steps is None else steps
    rounds = 4 if args.smoke else (EVAL_ROUNDS if args.horizons else 12)
    return Run(steps, args.seeds_list[0] if seed is None else seed, max(1, steps // rounds))


def horizon_seeds(args, steps: int) -> list:
    """The seeds run at one --horizons length: the first (whose LR sweep picks the LR), then
    the others of ``--seeds`` at lengths from ``--seeds-min-steps`` to ``--seeds-max-steps``."""
    seeded = steps >= args.seeds_min_steps and (
        args.seeds_max_steps is None or steps <= args.seeds_max_steps
    )
    return args.seeds_list if seeded else args.seeds_list[:1]


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


def parse_arms(text: str) -> list[tuple]:
    """``"2:full,4:full,2:input"`` -> ``[(2, "full"), (4, "full"), (2, "input")]``; an item
    ``S:mode:r`` gives the arm its own phase-1 fraction: ``"8:full:0.25"`` -> ``(8, "full",
    0.25)`` (the others use ``--phase1-fraction``).

    Raises SystemExit with one error line on a malformed item."""
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


def arm_name(run: Run, what: str) -> str:
    """A --horizons arm's folder under ``--work-dir``: ``h<steps>-seed<seed>-<what>``, e.g.
    ``h6000-seed1235-baseline-lr0.0005`` or ``h6000-seed1235-s2-full-r0.25``."""
    return f"h{run.steps}-seed{run.seed}-{what}"


def report_name(args) -> str:
    """A --horizons report's file name: ``--report-name``, else ``tst_moe`` for the MoE
    arms and ``tst_horizons`` for the dense ones, with ``_smoke`` in --smoke and
    ``_seed<N>`` when the first seed is not the default one (a replicate: its report does not
    replace the default run's)."""
    name = args.report_name or ("tst_moe" if args.model == "moe" else "tst_horizons")
    first = args.seeds_list[0]
    return (
        name + ("_smoke" if args.smoke else "") + (f"_seed{first}" if first != DEFAULT_SEED else "")
    )


# --- the launcher flags of an arm ------------------------------------------------------


def tst_flags(bag_size: int, fraction: float, mode: str) -> list[str]:
    """The ``--tst-*`` flags of an arm; ``--tst-mode`` only for the non-default modes."""
    flags = ["--tst-bag-size", str(bag_size), "--tst-phase1-fraction", str(fraction)]
    return flags + (["--tst-mode", mode] if mode != "full" else [])


def lr_flags(lr: float) -> list[str]:
    """``--lr`` and ``--min-lr`` (a tenth of it) of an arm."""
    return ["--lr", str(lr), "--min-lr", str(lr / 10)]


BASELINE_FLAGS = ["--tst-bag-size", "1"]
"""A baseline arm: the same launcher with TST off (S = 1)."""


def model_flags(args, corpus: Corpus, run: Run) -> list[str]:
    """The launcher flags shared by every arm of ``run`` (model, data, batch, schedule,
    evaluation)."""
    if args.preset:
        from recipes import recipe

        return recipe(args.preset).flags(
            data_path=corpus.prefix,
            tokenizer_model=args.tokenizer_model,
            tokenizer_type=args.tokenizer_type,
            train_iters=run.steps,
            data_cache_path=os.path.join(args.work_dir, "data-cache"),
        )
    tok = args.tokenizer_model or os.path.join(args.data_dir, "tokenizer.model")
    common = _common_flags(args, corpus.prefix, tok, run)
    if args.model == "moe" and args.horizons:
        return moe_horizon_flags(args) + common
    if args.model == "dense" and not args.smoke:
        size = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "512"]
        return common + size + ["--seq-length", str(args.seq_length)]
    size = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128"]
    size += ["--moe-ffn-hidden-size", "64", "--seq-length", "32"]
    if not args.smoke:
        size = ["--num-layers", "4", "--hidden-size", "128", "--ffn-hidden-size", "256"]
        size += ["--moe-ffn-hidden-size", "128", "--seq-length", str(args.seq_length)]
    moe = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    moe += ["--expert-model-parallel-size", "2"]
    if args.model == "dense":  # smoke size without the MoE flags
        size = size[:6] + size[8:]
    return size + common + (moe if args.model == "moe" else [])


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
        *("--num-layers", layers, "--hidden-size", hidden),
        # Megatron-LM wants one; every layer is an MoE layer
        *("--ffn-hidden-size", str(4 * int(hidden)), "--seq-length", seq),
        *("--group-query-attention", "--num-query-groups", "2", "--qk-layernorm"),
        *("--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", expert),
        *("--expert-model-parallel-size", "2", "--moe-router-load-balancing-type", "aux_loss"),
        *("--moe-aux-loss-coeff", "1e-2", "--moe-per-layer-logging"),
    ]


def _common_flags(args, data_prefix: str, tok: str, run: Run) -> list[str]:
    steps = run.steps
    return [
        *("--device", args.device, "--data-path", data_prefix, "--split", args.split),
        *("--data-cache-path", os.path.join(args.data_dir, "cache")),
        *("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tok),
        *("--vocab-size", str(args.vocab_size), "--num-attention-heads", "4"),
        *("--max-position-embeddings", str(batch_shape(args)[1])),
        *("--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights"),
        *("--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", str(steps)),
        *("--lr-decay-style", "WSD", "--lr-wsd-decay-style", "linear", "--adam-beta2", "0.95"),
        *("--position-embedding-type", "rope", "--normalization", "RMSNorm"),
        *("--moe-token-dispatcher-type", "alltoall", "--num-workers", "0"),
        "--lr-warmup-iters",
        str(max(1, steps // 20)),
        # Megatron-LM's WSD has no default decay length: the last 10 % of the run
        "--lr-wsd-decay-iters",
        str(max(1, steps // 10)),
        *("--hidden-dropout", "0", "--attention-dropout", "0", "--seed", str(run.seed)),
        *("--eval-interval", str(run.eval_interval), "--eval-iters", str(args.eval_iters)),
        *("--log-interval", str(run.eval_interval)),
    ]


def launcher_script(args) -> str:
    """:data:`MOE_LAUNCHER` for the --horizons MoE arms, else :data:`LAUNCHER`."""
    return MOE_LAUNCHER if args.model == "moe" and args.horizons else LAUNCHER


def batch_shape(args) -> tuple[int, int]:
    """``(global batch, T)`` of the arms: the preset's, or the CPU model's 8 x T (T = 32 in
    --smoke)."""
    if args.preset:
        from recipes import recipe

        return recipe(args.preset).global_batch_size, recipe(args.preset).seq_length
    return 8, 32 if args.smoke else args.seq_length


def whole_split_iters(args, corpus: Corpus) -> int:
    """``--eval-iters`` that score the whole validation split once: its ``T``-token windows
    (megatron-core's ``GPTDataset``: ``(tokens - 1) // T`` per epoch) in global batches, at
    least 1 (all but the last ``< global batch`` windows)."""
    gbs, seq = batch_shape(args)
    return max(1, (corpus.valid_tokens - 1) // seq // gbs)


def describe(args, corpus: Corpus) -> str:
    """The model and data of the arms, in words."""
    if args.preset:
        from recipes import recipe

        r = recipe(args.preset)
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
        f"{model}, T = {seq}, micro-batch 4, global batch {gbs}, WSD; {corpus.label} corpus "
        f"(SentencePiece {args.vocab_size}), "
        f"{'/'.join(args.split.split(',')[:2])} train/validation split"
    )
