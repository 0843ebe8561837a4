"""The study's side effects: the corpus built with the project's tools, and each arm trained
by ``torchrun`` of the launcher (or read back from its ``arm.json``), then scored by
Megatron-LM on the whole validation split.

Every function takes the fixed :class:`~study.definitions.Study` and the values of
:mod:`study.definitions`; none changes them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

from measure import write

from study.analysis import final, is_router_tag, raw_tokens
from study.definitions import (
    BASELINE_FLAGS,
    ROOT,
    Corpus,
    Run,
    arm_label,
    arm_name,
    horizon_lrs,
    horizon_seeds,
    launcher_script,
    lr_flags,
    model_flags,
    run_of,
    tst_flags,
    whole_split_iters,
)
from tst_megatron.plots import read_scalars, switch_iteration, validation_tag

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
CORPUS_FILE = "corpus.json"
"""In ``--work-dir``: the digest and split sizes of the corpus its arms were trained on, so
that ``--report-only`` rebuilds a report from the arm files where the corpus is gone."""

#: Megatron-LM's validation line (``evaluate_and_print_results``, last rank).
_VALIDATION_LINE = re.compile(
    r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.E+-]+)"
)


# --- the corpus ---------------------------------------------------------------------------


def ensure_data(
    data_dir: str,
    vocab: int,
    max_documents,
    *,
    sources: tuple = ("python-stdlib",),
    max_bytes=None,
    name: str = "stdlib",
    unique: bool = False,
) -> str:
    """Corpus -> tokenizer -> .bin/.idx with the project's tools (``tools/build_corpus.py``,
    ``tools/train_tokenizer.py``, ``tools/preprocess_data.py``), reusing what exists; returns
    the dataset prefix. Raises CalledProcessError when a tool fails."""
    corpus, tok = os.path.join(data_dir, name + ".jsonl"), os.path.join(data_dir, "tokenizer")
    prefix = os.path.join(data_dir, name)
    build = ["tools/build_corpus.py", "--output", corpus]
    build += [a for source in sources for a in ("--source", source)]
    build += ["--max-documents", str(max_documents)] if max_documents else []
    build += (["--max-bytes", str(max_bytes)] if max_bytes else []) + (
        ["--unique"] if unique else []
    )
    train = ["tools/train_tokenizer.py", "--input", corpus, "--model-prefix", tok]
    train += ["--vocab-size", str(vocab)]
    # site-packages has more distinct characters than 4096 pieces: the rarest are spelled
    # with SentencePiece's byte fallback
    train += ["--character-coverage", "0.9995"] if "python-site-packages" in sources else []
    tokenize = ["tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix]
    tokenize += ["--tokenizer-model", tok + ".model", "--append-eod", "--workers", "2"]
    steps = [(corpus, build), (tok + ".model", train), (prefix + "_text_document.idx", tokenize)]
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
    ``.bin`` bytes: the same tokens give the same digest wherever the files lie (a report
    quotes it so that runs on different data cannot be compared unnoticed).

    Raises FileNotFoundError when either file is missing."""
    import hashlib

    digest = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        with open(prefix + suffix, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def prepare_data(args, record: bool = True) -> Corpus:
    """The study's :class:`Corpus`: ``--data-path`` as given, or the corpus built under
    ``--data-dir`` (not built with --report-only); for --horizons with its digest and split
    sizes (:func:`horizons_corpus`; ``record=False``: without writing its record, for a
    script that only borrows the study's data)."""
    if args.data_path:
        label = prefix = args.data_path
    else:
        if args.horizons and not args.smoke and args.corpus == "prose":
            label, name = "system-docs prose (repeats dropped)", "prose"
            build = dict(sources=("system-docs",), name=name, unique=True)
        elif args.horizons and not args.smoke:
            label = f"python-stdlib + python-site-packages ({args.corpus_max_bytes / 1e6:g} MB)"
            name, build = (
                "code",
                dict(sources=("python-stdlib", "python-site-packages"), name="code"),
            )
        else:
            label, name, build = "python-stdlib", "stdlib", {}
        prefix = os.path.join(args.data_dir, name + "_text_document")
        if not args.report_only:
            max_documents = 60 if args.smoke else None
            size = {"max_bytes": args.corpus_max_bytes} if build else {}
            prefix = ensure_data(args.data_dir, args.vocab_size, max_documents, **build, **size)
    if not (args.horizons or args.preset):
        return Corpus(prefix, label)
    # a GPU study's (--preset) arms are kept and reused too: they pair by this digest
    return horizons_corpus(args, prefix, label, record=record and not args.report_only)


def horizons_corpus(args, prefix: str, label: str, record: bool = True) -> Corpus:
    """The corpus with its digest and the tokens of its training and validation splits:
    computed from the dataset where it exists (and, with ``record``, written to ``--work-dir``'s
    :data:`CORPUS_FILE` and ``--keep-arms``'s, node 0), else read from ``--work-dir``'s.

    Raises SystemExit with one error line when neither exists, the file's split differs, or
    ``--keep-arms`` holds the record of another corpus (its arms would not pair)."""
    path = os.path.join(args.work_dir, CORPUS_FILE)
    if os.path.exists(prefix + ".idx"):
        sizes = [split_tokens(prefix, args.split, i) for i in (0, 1)]
        corpus = Corpus(prefix, label, corpus_digest(prefix), *sizes)
        keep = getattr(args, "keep_arms", None) if record else None
        kept = os.path.join(keep, CORPUS_FILE) if keep else None
        if kept and os.path.exists(kept):
            with open(kept) as f:
                recorded = json.load(f)
            if (recorded["digest"], recorded["split"]) != (corpus.digest, args.split):
                raise SystemExit(
                    f"error: --keep-arms: {kept} records corpus {recorded['digest']} (--split "
                    f"{recorded['split']}); this run's is {corpus.digest} (--split {args.split})"
                )
        if record and args.node_rank == 0:
            fields = {"digest": corpus.digest, "split": args.split}
            fields.update(train_tokens=sizes[0], valid_tokens=sizes[1])
            for folder in {args.work_dir, keep or args.work_dir}:
                os.makedirs(folder, exist_ok=True)
                write(os.path.join(folder, CORPUS_FILE), json.dumps(fields, indent=1) + "\n")
        return corpus
    if not os.path.exists(path):
        raise SystemExit(
            f"error: --report-only: no dataset {prefix} and no {path} (the corpus digest "
            "and split sizes the arms were trained on)"
        )
    with open(path) as f:
        fields = json.load(f)
    if fields["split"] != args.split:
        raise SystemExit(f"error: {path} is of --split {fields['split']}, not {args.split}")
    return Corpus(prefix, label, fields["digest"], fields["train_tokens"], fields["valid_tokens"])


# --- the arms -------------------------------------------------------------------------


def launcher(args) -> list[str]:
    """``torchrun`` and its options: ``--nproc-per-node`` processes on this node; with
    ``--nnodes > 1`` this node's rank and the rendezvous address/port (the same on every
    node, e.g. from Slurm; see ``docs/gpu_recipe.md``)."""
    from tst_megatron.runtime.distributed import free_port

    options = ["--nproc_per_node", str(args.nproc_per_node)]
    if args.nnodes > 1:
        options += ["--nnodes", str(args.nnodes), "--node_rank", str(args.node_rank)]
        options += ["--master_addr", args.master_addr, "--master_port", str(args.master_port)]
    else:
        options += ["--master_port", str(args.master_port or free_port())]
    return options


def read_arm(tensorboard_dir: str, flags: list) -> dict:
    """An arm's curves from the launcher's TensorBoard events: ``valid`` (Megatron-LM's
    ``lm loss validation``: ``[(iteration, loss)]``), ``switch`` (from ``tst-phase``),
    ``tokens`` (:func:`~study.analysis.raw_tokens`), ``steps``, and ``router`` (the router
    series, MoE arms). Raises RuntimeError when the events lack a validation or phase series."""
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


def score_whole_split(
    options, flags, ckpt: str, eval_iters: int, env, script: str
) -> "tuple | None":
    """Megatron-LM's own evaluation of the checkpoint ``ckpt`` on the whole validation split:
    the launcher with ``--load ckpt --skip-train --eval-iters eval_iters`` (with
    ``--skip-train`` Megatron-LM sizes the split to ``eval_iters`` global batches and reads it
    from its start, so every arm is scored on the same windows). Returns ``(iteration,
    loss)`` from its validation line (node 0; None elsewhere). Raises RuntimeError when it fails.

    Megatron-LM 0.19's ``--full-validation`` would do this at every evaluation, but with one
    validation set its ``evaluate_and_print_results`` indexes an ``int`` and stops the run."""
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


def run_arm(args, name: str, flags: list[str], run: Run, corpus: Corpus) -> "dict | None":
    """Train one arm (``run``) with torchrun and the launcher; return its curves and
    wall-clock time (node 0), or None on the other nodes. With ``--reuse`` (and
    ``--report-only``, which trains nothing and returns None for an arm not there), an arm
    whose ``arm.json`` exists is read back unless it records another corpus digest than
    ``corpus``'s. Raises RuntimeError when the launcher fails."""
    arm_dir = os.path.join(args.work_dir, name)
    saved = os.path.join(arm_dir, "arm.json")
    digest = corpus.digest
    if (args.reuse or args.report_only) and os.path.exists(saved):
        with open(saved) as f:
            arm = json.load(f)
        if arm.get("corpus_digest", digest) == digest:
            keep(args, name, arm)
            return arm
        # another corpus (the python-site-packages source depends on the venv): not comparable
        print(f"{name}: trained on corpus {arm['corpus_digest']}, not {digest}; not reused")
    if args.report_only:
        return None
    tb = os.path.join(arm_dir, "tensorboard")
    if os.path.isdir(arm_dir) and args.node_rank == 0:
        shutil.rmtree(arm_dir)
    os.makedirs(arm_dir, exist_ok=True)
    options, script = launcher(args), launcher_script(args)
    ckpt = os.path.join(arm_dir, "checkpoint")
    score = whole_split_iters(args, corpus) if args.horizons else None
    save = ["--save", ckpt, "--save-interval", str(run.steps), "--no-tst-save-at-switch"]
    command = [TORCHRUN, *options, script, *flags, "--tensorboard-dir", tb]
    command += save if score else []
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"arm {name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    # a fresh rendezvous port (the training run's may still be held)
    final_point = (
        score_whole_split(launcher(args), flags, ckpt, score, env, script) if score else None
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
    if final_point is not None:  # the whole split, the same windows for every arm
        steps, loss = final_point
        arm["valid"] = [p for p in arm["valid"] if p[0] != steps] + [(steps, loss)]
        arm["valid_whole_split"] = loss
        shutil.rmtree(ckpt, ignore_errors=True)
    with open(saved, "w") as f:
        json.dump(arm, f)
    keep(args, name, arm)
    return arm


def keep(args, name: str, arm: dict) -> None:
    """With ``--keep-arms DIR`` (node 0): ``DIR/<name>.json.gz``, the arm's ``arm.json``
    gzipped with no timestamp (the same arm, the same bytes), written to a temporary name and
    renamed; an existing copy is left as it is."""
    folder = getattr(args, "keep_arms", None)
    if not folder or args.node_rank != 0:
        return
    import gzip

    from tst_megatron.data.files import atomic_path

    path = os.path.join(folder, name + ".json.gz")
    if os.path.exists(path):
        return
    os.makedirs(folder, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write(json.dumps(arm).encode())


def run_baselines(args, corpus: Corpus, run: Run, lrs, flags: list, prefix: str = "") -> tuple:
    """The baseline of ``run`` at each LR of ``lrs`` (arm ``<prefix>baseline-lr<lr>``; a
    --horizons prefix is ``h<N>-seed<S>-``); returns ``(all, best)``, each arm with its ``lr`` (best: the lowest
    final validation loss; ``([], None)`` when --report-only finds none)."""
    baselines = []
    for lr in lrs:
        label = f"{prefix}baseline-lr{lr:g}"
        arm = run_arm(args, label, flags + lr_flags(lr) + BASELINE_FLAGS, run, corpus)
        if arm is None and args.report_only:  # not run yet
            continue
        arm = dict(arm or {"valid": [(0, 0.0)], "wall_s": 0.0}, lr=lr)  # None: not node 0
        baselines.append(arm)
        print(
            f"{label}: final validation loss {final(arm):.4f} ({arm['wall_s']:.0f} s)", flush=True
        )
    if not baselines:
        return [], None
    return baselines, min(baselines, key=final)


def run_horizon_arms(args, corpus: Corpus, arms: list, run: Run, flags: list, lr: float) -> dict:
    """The TST arms of one length and seed (``run``) at ``lr``: ``{label: arm}`` (node 0);
    the arms after the first ``--arms-at-every-length`` only up to ``--extra-arms-max-steps``."""
    done = {}
    for index, spec in enumerate(arms):
        if index >= args.arms_at_every_length and run.steps > args.extra_arms_max_steps:
            continue
        size, mode = spec[:2]
        fraction = spec[2] if len(spec) > 2 else args.phase1_fraction
        name = arm_name(run, f"s{size}-{mode}-r{fraction}")
        arm = run_arm(
            args, name, flags + lr_flags(lr) + tst_flags(size, fraction, mode), run, corpus
        )
        if arm is None:
            continue
        done[arm_label(*spec)] = arm
        print(f"{name}: final validation loss {final(arm):.4f} ({arm['wall_s']:.0f} s)", flush=True)
    return done


def run_horizons(args, corpus: Corpus, arms: list, after_length=None) -> list:
    """Every length of ``--horizons``, shortest first: the first seed's baseline at its best
    LR (:func:`~study.definitions.horizon_lrs`) and the arms, then every other seed of the
    length (:func:`~study.definitions.horizon_seeds`) at that LR. Returns the rows (as
    :mod:`study` describes them); ``after_length(rows)`` is called after each length, so that
    an interrupted study keeps its report. With --report-only a length whose baseline is not
    there is left out, and a seed whose baseline is not there too."""
    rows, previous_best = [], None
    for steps in sorted(int(x) for x in args.horizons.split(",")):
        seeds, lrs, baselines = [], horizon_lrs(args, steps, previous_best), None
        for seed in horizon_seeds(args, steps):
            run = run_of(args, steps, seed)
            flags = model_flags(args, corpus, run)
            tried, best = run_baselines(args, corpus, run, lrs, flags, arm_name(run, ""))
            if baselines is None:  # the first seed: its LR sweep picks every seed's LR
                if best is None:
                    break
                baselines, lrs = tried, [best["lr"]]
            trained = run_horizon_arms(args, corpus, arms, run, flags, lrs[0])
            if best is not None:
                seeds.append({"seed": seed, "best": best, "arms": trained})
        if not seeds:
            continue
        previous_best = lrs[0]
        rows.append({"steps": steps, "baselines": baselines, "seeds": seeds})
        if after_length is not None:
            after_length(rows)
    return rows
