"""Resume rules: a checkpoint in ``--load`` that this run would not continue (TST's phase
plan, the model, the learning-rate schedule), read before any work."""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Optional

from tst_megatron.data.checkpoint import (
    UnsafeCheckpoint,
    inspect,
    instead,
    read_common_state,
)
from tst_megatron.data.gpt_datasets import data_prefixes, training_windows
from tst_megatron.errors import ConfigError
from tst_megatron.training.plan import run_plan


def _tracker_iteration(root: str, flag: str, trust: bool):
    """``root``'s tracker file read as Megatron-LM's ``read_metadata`` does: ``(iteration,
    None)``, ``(0, "release")``, or None when there is none (a fresh start).

    Raises:
        ConfigError: a tracker that holds no iteration (naming the newest intact one).
    """
    # Megatron-LM's training package: heavy, imported where it runs
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(root)
    if not os.path.isfile(tracker):
        return None
    # not Megatron-LM's read_metadata: on a malformed file it exits with status 0 (0.19.2)
    with open(tracker) as f:
        text = f.read().strip()
    if text == "release":
        return 0, "release"
    if not text.isdigit():
        raise ConfigError(
            f"{flag} {root}: {os.path.basename(tracker)} holds {text!r}, not an iteration; "
            + _fallback(root, flag, (), trust)
        )
    return int(text), None


def _fallback(root: str, flag: str, skip, trust: bool, crc: bool = False) -> str:
    """:func:`~tst_megatron.data.checkpoint.instead`, or to start without ``flag``."""
    line = instead(root, skip=skip, trust=trust, crc=crc)
    return line if "--ckpt-step" in line else f"{line}, or start without {flag}"


def checkpoint_folder(
    args, flag: str = "--load", *, crc: bool = False
) -> Optional[tuple[int, str]]:
    """``(iteration, folder)`` of the checkpoint Megatron-LM's ``load_checkpoint`` would read
    from ``flag`` (``--load``, with ``--ckpt-step`` or the tracker file; or
    ``--pretrained-checkpoint``), checked by :func:`tst_megatron.data.checkpoint.inspect`:
    intact, and no pickle in it would run code (``crc``: its data matches its CRC-32s too,
    which reads it all). None when nothing would be read (no such flag, or no tracker file:
    Megatron-LM starts afresh).

    Raises:
        ConfigError: one line: the tracker and the folders disagree, the folder is damaged
            (naming the newest intact checkpoint and ``--ckpt-step``), or a pickle would run
            code (:class:`~tst_megatron.data.checkpoint.UnsafeCheckpoint`); any exception while
            reading becomes that line.
    """
    root = getattr(args, flag[2:].replace("-", "_"), None)
    if not root:
        return None
    trust = bool(getattr(args, "trust_checkpoint", False))
    try:
        return _checked_folder(args, root, flag, trust, crc)
    except UnsafeCheckpoint as exc:
        raise ConfigError(f"{flag} {root}: {exc}") from None
    except ConfigError:
        raise
    except Exception as exc:  # the launcher's own reading never ends in a traceback
        raise ConfigError(
            f"{flag} {root}: the checkpoint could not be read ({type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:200]})"
        ) from None


def _checked_folder(args, root, flag, trust, crc) -> Optional[tuple[int, str]]:
    # Megatron-LM's training package: heavy, imported where it runs
    from megatron.training.checkpointing import get_checkpoint_name

    # as Megatron-LM 0.19.2's _load_base_checkpoint, for --load and --pretrained-checkpoint
    # alike: a (truthy) --ckpt-step overrides the tracker; a newer global non-persistent
    # checkpoint is preferred
    step = getattr(args, "ckpt_step", None)
    found = _tracker_iteration(root, flag, trust) if not step else None
    if step:
        iteration, release, source = step, None, f"--ckpt-step {step}"
    elif found is not None:
        (iteration, release), source = found, "the tracker file's"
    else:
        iteration, release, source = -1, None, None
    newer = _non_persistent(args, root, flag, trust)
    if newer is not None and newer[0] >= iteration:
        iteration, root, source = newer[0], newer[1], "the non-persistent tracker's"
        release = None
    if source is None:
        return None
    path = get_checkpoint_name(root, iteration, release=bool(release), return_base_dir=True)
    name = os.path.basename(path)
    problem = _inspected(path, trust, crc, _stamp(path))
    if problem is not None:
        what = "does not exist" if not os.path.isdir(path) else f"is damaged: {problem}"
        raise ConfigError(
            f"{flag} {root}: {name} ({source} checkpoint) {what}; "
            + _fallback(root, flag, (iteration,), trust, crc)
        )
    return iteration, path


def _non_persistent(args, root: str, flag: str, trust: bool) -> Optional[tuple[int, str]]:
    """``(iteration, folder root)`` of the global non-persistent checkpoint Megatron-LM 0.19.2
    would consider (``--non-persistent-ckpt-type global``: ``--non-persistent-global-ckpt-dir``
    or ``<load>/non_persistent``), or None."""
    if getattr(args, "non_persistent_ckpt_type", None) != "global":
        return None
    folder = getattr(args, "non_persistent_global_ckpt_dir", None) or os.path.join(
        root, "non_persistent"
    )
    found = _tracker_iteration(folder, flag, trust)
    return None if found is None or found[1] else (found[0], folder)


def _stamp(path: str) -> tuple:
    """What changes when a checkpoint folder is rewritten (the :func:`_inspected` cache key)."""
    try:
        st = os.stat(path)
        return st.st_mtime_ns, st.st_ino, tuple(sorted(os.listdir(path)))
    except OSError:
        return ()


@functools.lru_cache(maxsize=8)
def _inspected(path: str, trust: bool, crc: bool, stamp: tuple) -> Optional[str]:
    """:func:`~tst_megatron.data.checkpoint.inspect`, once per folder state: a launch asks
    for the checkpoint to resume several times."""
    return inspect(path, trust=trust, crc=crc)


def checkpoint_to_resume(args) -> Optional[tuple[int, dict]]:
    """``(iteration, common state)`` of the checkpoint Megatron-LM's ``load_checkpoint`` would
    resume (:func:`checkpoint_folder`: ``--load``, ``--ckpt-step`` or the tracker file,
    checked), in any format it loads (:func:`read_common_state`), read without process groups.
    None when nothing would be resumed (no tracker file, a release checkpoint, ``--finetune``).

    Raises:
        ConfigError: see :func:`checkpoint_folder`; a folder in no format Megatron-LM reads.
    """
    found = checkpoint_folder(args)
    if found is None or getattr(args, "finetune", False) or found[1].endswith("release"):
        return None
    iteration, path = found
    try:
        return iteration, read_common_state(path, trust=bool(getattr(args, "trust_checkpoint", 0)))
    except ConfigError:
        raise
    except Exception as exc:  # never a traceback from the launcher's own read
        raise ConfigError(
            f"--load {args.load}: {os.path.basename(path)} could not be read "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None


#: Every key of the sample orders' cache description (:func:`tst_megatron.data.stream.describe`:
#: its own keys, and each part's megatron-core dataset description, ``GPTDataset``'s
#: ``unique_identifiers``: ``MegatronDataset._key_config_attributes()`` and the keys
#: ``GPTDataset.__init__`` adds) -> what a resume may do with the flags that set it:
#:
#: - ``refused``: another value draws phase 1's blocks again, so phase 2 would read text phase
#:   1 already trained on (:func:`resume_problems`);
#: - ``noted``: new data, which a curriculum may mean (:func:`order_notes`);
#: - ``plan``: compared through the run plan (N1, the switch sample, the bag size; the run's
#:   length with a blend) by :func:`resume_problems`;
#: - ``fixed``: no flag sets it.
#:
#: ``tests/unit/test_megatron_lm_args.py`` checks that every key megatron-core 0.19.2 and the
#: stream put in the description is here.
ORDER_INPUTS = {
    # TrainStream.describe
    "class": ("fixed", ()),
    "format": ("fixed", ()),
    "parts": ("fixed", ()),  # each part's dataset description: the keys below
    "windows_per_sample": ("plan", ()),
    "phase1_samples": ("plan", ()),
    "seed": ("refused", ("seed",)),
    # megatron-core's dataset description (GPTDataset.unique_identifiers)
    "random_seed": ("refused", ("seed",)),
    "sequence_length": ("refused", ("seq_length",)),
    "tokenizer": ("refused", ("tokenizer_type", "vocab_size")),
    "split": ("noted", ("split",)),
    "split_matrix": ("noted", ("split",)),
    "dataset_path": ("noted", ("data_path", "data_args_path", "mock_data")),
    "num_samples": ("plan", ()),
    "index_split": ("fixed", ()),
}  # fmt: skip


def _order_flags(kind: str) -> tuple:
    return tuple(dict.fromkeys(f for k, flags in ORDER_INPUTS.values() if k == kind for f in flags))


#: The ``args`` names of :data:`ORDER_INPUTS` a resume must keep, and those it may change with
#: a note.
ORDER_FLAGS_REFUSED = _order_flags("refused")
ORDER_FLAGS_NOTED = _order_flags("noted")


def _data_words(args) -> list:
    """The words of ``--data-path``, or of the ``--data-args-path`` file ([] when unreadable:
    the data rules' line, or with ``--mock-data``)."""
    if getattr(args, "mock_data", False):
        return []
    words = list(getattr(args, "data_path", None) or [])
    if getattr(args, "data_args_path", None):
        try:
            with open(args.data_args_path) as f:
                words = f.read().split()
        except OSError:
            return []
    return words


def _blended(args) -> bool:
    """``--data-path`` (or the ``--data-args-path`` file) names more than one dataset, or gives
    weights: megatron-core then builds a ``BlendedDataset``, whose parts are sized by the run's
    length (``get_blend_from_list`` returns weights even for ``1.0 A``)."""
    # megatron-core: heavy, imported when used
    from megatron.core.datasets.utils import get_blend_from_list

    words = _data_words(args)
    if not words:
        return False
    prefixes, weights = get_blend_from_list(words)
    return len(prefixes) > 1 or weights is not None


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _changed(args, saved, names) -> list[tuple[str, object, object]]:
    """``[(flag, checkpoint's value, this run's value)]`` of ``names`` that differ."""
    return [
        (_flag(name), getattr(saved, name), getattr(args, name, None))
        for name in names
        if hasattr(saved, name) and getattr(saved, name) != getattr(args, name, None)
    ]


def current_data_identity(args) -> Optional[str]:
    """:func:`~tst_megatron.data.gpt_datasets.blend_identity` of the line's data files, or
    None (mock data, an unreadable ``--data-args-path``, or files missing: the data rules say
    so)."""
    # the data modules read megatron-core: imported when used
    from megatron.core.datasets.utils import get_blend_from_list

    from tst_megatron.data.gpt_datasets import blend_identity

    words = _data_words(args)
    if not words:
        return None
    try:
        return blend_identity(get_blend_from_list(words)[0])
    except (OSError, ValueError, AssertionError):
        return None


def data_change_problem(args, saved, where: str) -> Optional[str]:
    """One line when the checkpoint's run recorded the identity of its data
    (``tst_data_identity``, :func:`~tst_megatron.data.files.data_identity`) and the files of
    this line's ``--data-path`` are other data (re-preprocessed or replaced under the same
    prefixes): phase 1's blocks and phase 2's order would be drawn from it again."""
    was = getattr(saved, "tst_data_identity", None)
    now = current_data_identity(args) if was else None
    if not was or not now or now == was:
        return None
    return (
        f"{where} was trained on other data than the files of --data-path now hold (they were "
        "re-preprocessed or replaced since: another size or content): phase 1's blocks and "
        "phase 2's order would be drawn again from the new data, so phase 2 would not read the "
        "text phase 1 left; resume with the data it was trained on, or start a new run"
    )


def _tst_resumed(saved, iteration: int, plan) -> bool:
    """The checkpoint is of a TST run with a phase 1 (old or new), past iteration 0."""
    return iteration > 0 and hasattr(saved, "tst_bag_size") and (run_plan(saved).n1 or plan.n1)


def resume_problems(args, plan, saved, iteration: int) -> list[str]:
    """Why resuming the checkpoint of ``iteration`` (written with arguments ``saved``) under
    ``args`` and their ``plan`` (a :class:`~tst_megatron.training.plan.RunPlan`) would not
    continue its TST run, one line per flag (empty: none, or ``saved`` has no ``--tst-*``).
    ``N1``, the switch sample, the windows per phase-1 sample and
    :data:`ORDER_FLAGS_REFUSED` must match (phase 2 reads the windows phase 1 left, once);
    before the switch the phase-1 loss flags too.
    """
    if not _tst_resumed(saved, iteration, plan):
        return []
    old, new = run_plan(saved), plan
    problems = []
    where = f"the checkpoint of iteration {iteration}"
    for flag, was, now in _changed(args, saved, ORDER_FLAGS_REFUSED):
        problems.append(
            f"{where} is part of a TST run with {flag} {was}; this run has {flag} {now}: "
            f"resume with {flag} {was} (with another, phase 1's blocks are drawn again and "
            "phase 2 would read text phase 1 already trained on)"
        )
    if old.total_samples != new.total_samples and _blended(args) and _blended(saved):
        problems.append(
            f"{where} is part of a TST run of {old.total_samples:,} samples on a blend of "
            f"datasets; this run has {new.total_samples:,} (--train-iters / --train-samples / "
            "--global-batch-size): "
            "a blend draws from each dataset in proportion to the run's length, so phase 1's "
            "blocks would be drawn again and phase 2 would read text phase 1 already trained "
            "on; resume with the checkpoint's length"
        )
    if (line := data_change_problem(args, saved, where)) is not None:
        problems.append(line)
    if old.n1 != new.n1:
        problems.append(
            f"{where} was written by a run switching at N1 = {old.n1}; this run switches at "
            f"N1 = {new.n1}: give the checkpoint's --tst-phase1-iters / --tst-phase1-fraction "
            "and --train-iters (phase 2 reads the windows phase 1 left)"
        )
    elif old.switch_sample != new.switch_sample:
        problems.append(
            f"{where} switched at sample {old.switch_sample:,}; this run would switch at "
            f"sample {new.switch_sample:,}: give the checkpoint's --global-batch-size (it may "
            "change from the switch on)"
        )
    old_tst, new_tst = old.tst, new.tst
    fields = ["bag_size", "mode", "bag_weighting"]
    if iteration >= new.n1 and old_tst.windows_per_sample() == new_tst.windows_per_sample():
        fields = []  # phase 1 is over and phase 2 reads the same windows
    for field in fields:
        was, now = getattr(old_tst, field), getattr(new_tst, field)
        if was != now:
            flag = "--tst-" + field.replace("_", "-")
            problems.append(
                f"{where} is part of a TST run with {flag} {was}; this run has {flag} {now}: "
                f"resume with {flag} {was}"
            )
    return problems


def epoch_layout(tokens_per_epoch: int, num_samples: int, seq_length: int, extra: int = 1):
    """``(epochs, separate final epoch)`` of the index megatron-core 0.19.2's ``GPTDataset``
    builds for ``num_samples`` windows of ``seq_length`` tokens (+ ``extra``, its
    ``add_extra_token_to_sequence``) over a split of ``tokens_per_epoch`` tokens: its
    ``_get_num_epochs``, and the 0.80 threshold of ``_build_document_sample_shuffle_indices``.
    Its documents are shuffled by these two: the same windows, in the same order, iff equal."""
    # megatron-core: heavy, imported when used
    from megatron.core.datasets.gpt_dataset import GPTDataset

    config = SimpleNamespace(sequence_length=seq_length, add_extra_token_to_sequence=extra)
    stand_in = SimpleNamespace(num_samples=num_samples, config=config)
    epochs = GPTDataset._get_num_epochs(stand_in, tokens_per_epoch)
    if epochs == 1:
        return 1, False
    sans_final = ((epochs - 1) * tokens_per_epoch - extra) // seq_length
    per_epoch = (tokens_per_epoch - extra) // seq_length
    return epochs, num_samples - sans_final < int(0.80 * per_epoch)


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens of the training split of the dataset ``prefix`` under ``--split``: its sequences
    ``[round(a * n), round(b * n))`` of the first row of megatron-core's split matrix
    (``BlendedMegatronDatasetBuilder``), summed from the ``.idx`` (not the ``.bin``)."""
    # megatron-core: heavy, imported when used
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    from megatron.core.datasets.indexed_dataset import _IndexReader

    reader = _IndexReader(prefix + ".idx", False)  # its arrays view its mmap: keep it open
    lengths = reader.sequence_lengths
    n = float(lengths.shape[0])
    (a, b), *_ = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    total = int(lengths[int(round(a * n)) : int(round(b * n))].sum())
    del lengths, reader
    return total


def epoch_problems(args, plan, saved, iteration: int) -> list[str]:
    """A resume of a TST run on one dataset with another run length whose windows span another
    epoch layout (:func:`epoch_layout`): megatron-core shuffles the documents by it, so phase
    1's blocks would be drawn again and phase 2 would read text phase 1 trained on. Reads the
    dataset's ``.idx`` (a rule that reads files). A blend: :func:`resume_problems`."""
    words = _data_words(args)
    if (
        not _tst_resumed(saved, iteration, plan)
        or not words
        or _blended(args)  # resume_problems' rule
        or _data_words(saved) != words
    ):
        return []
    old = run_plan(saved)
    if old.total_samples == plan.total_samples:
        return []
    (prefix,) = data_prefixes(" ".join(words))
    try:
        tokens = train_split_tokens(prefix, args.split)
        saved_split = getattr(saved, "split", args.split) or args.split
        old_tokens = train_split_tokens(prefix, saved_split)
    except (OSError, ValueError, AssertionError):  # the data rules' line
        return []
    data = SimpleNamespace(mock_data=False, data_path=" ".join(words))

    def layout(p, split_tokens):
        windows = training_windows(
            data,
            phase1_samples=p.switch_sample,
            phase2_samples=p.total_samples - p.switch_sample,
            per_sample=p.tst.windows_per_sample(),
        )
        return epoch_layout(split_tokens, windows, args.seq_length)

    was, now = layout(old, old_tokens), layout(plan, tokens)
    if was == now:
        return []

    def text(x):
        return f"{x[0]} epoch(s)" + (" with a separate final epoch" if x[1] else "")

    return [
        f"the checkpoint of iteration {iteration} is part of a TST run of {old.total_samples:,} "
        f"samples that reads {prefix} over {text(was)}; this run has {plan.total_samples:,} "
        f"(--train-iters / --train-samples / --global-batch-size), which reads it over "
        f"{text(now)}: megatron-core "
        "shuffles the documents by that, so phase 1's blocks would be drawn again and phase 2 "
        "would read text phase 1 already trained on; resume with a length that keeps "
        f"{text(was)}"
    ]


def order_notes(args, plan, saved, iteration: int) -> list[str]:
    """What phase 2 reads when a resume changes the data (:data:`ORDER_FLAGS_NOTED`), one
    line: a curriculum may mean it."""
    if not _tst_resumed(saved, iteration, plan):
        return []
    changed = _changed(args, saved, ORDER_FLAGS_NOTED)
    if not changed:
        return []
    what = ", ".join(f"{flag} {was} -> {now}" for flag, was, now in changed)
    return [
        f"the checkpoint of iteration {iteration} was trained on other data ({what}): the "
        "sample orders are drawn again for this data, so phase 1 (if not over) and phase 2 "
        "read this data's windows, leaving out the blocks phase 1 would have read of it in "
        "the first N1 steps, not the text phase 1 read of the checkpoint's data"
    ]


def _scheduler_plan(args) -> dict:
    """The values Megatron-LM 0.19.2's ``get_optimizer_param_scheduler`` gives
    ``OptimizerParamScheduler`` that its ``load_state_dict`` compares, by state-dict key."""
    if args.train_iters:
        decay = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
        wd_steps = args.train_iters * args.global_batch_size
        warmup = args.lr_warmup_iters * args.global_batch_size
    else:
        decay = args.lr_decay_samples or args.train_samples
        wd_steps, warmup = args.train_samples, args.lr_warmup_samples
    if args.lr_warmup_fraction is not None:
        warmup = args.lr_warmup_fraction * decay
    return {
        "max_lr": args.lr,
        "min_lr": args.min_lr,
        "lr_warmup_steps": warmup,
        "lr_decay_steps": decay,
        "lr_decay_style": args.lr_decay_style,
        "start_wd": args.start_weight_decay,
        "end_wd": args.end_weight_decay,
        "wd_incr_steps": wd_steps,
    }


def scheduler_problems(args, saved_scheduler: Optional[dict], iteration: int) -> list[str]:
    """The schedule values Megatron-LM's ``OptimizerParamScheduler.load_state_dict`` would
    refuse on resuming the checkpoint of ``iteration``, as one line (empty: none, or
    ``--override-opt-param-scheduler``, ``--use-checkpoint-opt_param-scheduler``,
    ``--no-load-optim``)."""
    if (
        not saved_scheduler
        or getattr(args, "override_opt_param_scheduler", False)
        or getattr(args, "use_checkpoint_opt_param_scheduler", False)
        or getattr(args, "no_load_optim", False)
    ):
        return []
    differ = [
        f"{key} {saved_scheduler[key]} -> {value}"
        for key, value in _scheduler_plan(args).items()
        if key in saved_scheduler and saved_scheduler[key] != value
    ]
    if not differ:
        return []
    return [
        f"the checkpoint of iteration {iteration} has another learning-rate schedule "
        f"({', '.join(differ)}; from --train-iters, --lr* or --*weight-decay): Megatron-LM "
        "refuses the change; give the checkpoint's values, or --override-opt-param-scheduler "
        "to take this run's (a new schedule from this iteration on)"
    ]


def resume_checks(args, plan) -> list[str]:
    """The problems of resuming the checkpoint in ``--load`` under ``args`` and their ``plan``
    (empty: none, or nothing to resume): TST's (:func:`resume_problems`), the model's
    (:func:`architecture_problems`), the layout's (:func:`layout_problems`) and the LR
    schedule's (:func:`scheduler_problems`)."""
    try:
        found = checkpoint_to_resume(args)
    except ConfigError as exc:
        return [str(exc)]
    if found is None:
        return []
    iteration, common = found
    saved, problems = common.get("args"), []
    if saved is not None:
        problems = resume_problems(args, plan, saved, iteration)
        problems += epoch_problems(args, plan, saved, iteration)
        problems += architecture_problems(args, saved)
        problems += layout_problems(args, saved, common["format"])
    return problems + scheduler_problems(args, common.get("opt_param_scheduler"), iteration)


ARCHITECTURE = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "kv_channels",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "swiglu",
    "normalization",
    "qk_layernorm",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "multi_latent_attention",
    "mtp_num_layers",
    "hybrid_layer_pattern",
)
"""The flags whose change makes a checkpoint another model's. Megatron-LM's
``check_checkpoint_args`` compares three of them, and only after the model is built."""


def _pattern(ns) -> Optional[str]:
    return getattr(ns, "hybrid_layer_pattern", None) or getattr(ns, "hybrid_override_pattern", None)


def model_class_problems(args, saved) -> list[str]:
    """A checkpoint of the other model class: a ``HybridModel``'s under the GPT launcher is
    refused; a ``GPTModel``'s under the hybrid launcher loads through megatron-core's
    load-time translation (``dist_checkpointing.gpt_checkpoint_interop``: each GPT layer feeds
    one attention and one MLP/MoE position of the pattern), so its ``--num-layers`` is compared
    with the pattern's GPT layer count."""
    now, was = _pattern(args), _pattern(saved)
    if was and not now:
        return [
            f"the checkpoint in --load {args.load} was saved by a HybridModel run "
            f"(--hybrid-layer-pattern {was}): resume it with examples/pretrain_hybrid_tst.py"
        ]
    if not now or was:
        return []
    # megatron-core: heavy, imported when used
    from megatron.core.dist_checkpointing.gpt_checkpoint_interop import gpt_compatible_layer_maps

    try:
        layers = gpt_compatible_layer_maps(now).num_gpt_layers
    except ValueError as exc:
        message = " ".join(str(exc).split())
        return [
            f"the checkpoint in --load {args.load} is a GPTModel's, which megatron-core loads "
            f"into a HybridModel only layer for layer: {message}"
        ]
    if getattr(saved, "num_layers", layers) != layers:
        return [
            f"the checkpoint in --load {args.load} is a GPTModel's of {saved.num_layers} layers; "
            f"--hybrid-layer-pattern {now} pairs with one of {layers} (one attention and one "
            "MLP or MoE position per GPT layer)"
        ]
    return []


def architecture_problems(args, saved) -> list[str]:
    """One line naming each :data:`ARCHITECTURE` flag of ``args`` that differs from the
    checkpoint's ``saved`` arguments (empty: none, or ``--use-checkpoint-args``), after
    :func:`model_class_problems` (which runs with ``--use-checkpoint-args`` too)."""
    problems = model_class_problems(args, saved)
    if problems or getattr(args, "use_checkpoint_args", False):
        return problems
    # a GPT checkpoint in a hybrid run: its layers pair by model_class_problems' rule
    skip = {"num_layers", "hybrid_layer_pattern"} if _pattern(args) and not _pattern(saved) else ()
    changed = []
    for name in ARCHITECTURE:
        if not hasattr(saved, name) or name in skip:
            continue
        if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
            continue
        was, now = getattr(saved, name), getattr(args, name, None)
        if name == "hybrid_layer_pattern" and was and now:  # '|' is the layout, not the model
            was, now = was.replace("|", ""), now.replace("|", "")
        if was != now:
            changed.append(f"--{name.replace('_', '-')} {was} (this run: {now})")
    if not changed:
        return []
    return [
        f"the checkpoint in --load {args.load} is of another model: {', '.join(changed)}; give "
        "the checkpoint's model flags (or --use-checkpoint-args)"
    ]


#: The layout flags a legacy ``torch`` checkpoint is tied to: one ``mp_rank_<TP>[_<PP>][_<EP>]``
#: file per model-parallel rank (``megatron.training.checkpointing.get_checkpoint_name``),
#: each holding that rank's shards (and, with virtual stages, one ``model<i>`` per chunk).
TORCH_FORMAT_LAYOUT = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def _expert_groups(ns) -> bool:
    """The optimizer keeps the experts' parameters in groups of their own: megatron-core marks
    them ``allreduce=False`` when EP > 1 or the expert TP differs from TP
    (``tensor_parallel/layers.py``, ``use_expert_pgs``), and ``get_megatron_optimizer`` then
    chains a dense and an expert optimizer (0.19.2)."""
    if not getattr(ns, "num_experts", None):
        return False
    tp = getattr(ns, "tensor_model_parallel_size", 1) or 1
    etp = getattr(ns, "expert_tensor_parallel_size", None) or tp
    return (getattr(ns, "expert_model_parallel_size", 1) or 1) > 1 or etp != tp


def layout_problems(args, saved, ckpt_format: str) -> list[str]:
    """The layout changes Megatron-LM 0.19.2 cannot resume, one line each (empty: none).

    - A legacy ``torch`` checkpoint loads only into the layout it was saved in
      (:data:`TORCH_FORMAT_LAYOUT`; DP may change): another one fails on a missing
      ``mp_rank_*`` file or a ``size mismatch`` after the model is built.
    - Optimizer state saved with expert groups (:func:`_expert_groups`: EP > 1, or expert TP
      other than TP) into a run without them (EP = 1), or the other way: megatron-core's
      ``_filter_and_reorder_param_groups`` raises ``ValueError: Could not find parameter
      group`` (EP 2 -> 1), the plain optimizer's load "Expected 2 entries in state dict, but
      got 4" (EP 1 -> 2, ``tests/distributed/test_megatron_lm_layouts.py``), after the model
      is built. EP 2 -> 4 is not refused (both keep the groups; not run: it needs 4
      processes). Not with ``--no-load-optim`` or ``--finetune``
      (the weights are resharded alone).
    """
    problems = []
    if ckpt_format == "torch":
        changed = [
            f"{_flag(name)} {getattr(saved, name)} (this run: {getattr(args, name, None)})"
            for name in TORCH_FORMAT_LAYOUT
            if hasattr(saved, name) and getattr(saved, name) != getattr(args, name, None)
        ]
        if changed:
            problems.append(
                f"the checkpoint in --load {args.load} is in the legacy --ckpt-format torch, "
                f"which loads only into the layout it was saved in: {', '.join(changed)}; "
                "resume in that layout (a torch_dist checkpoint reshards onto another)"
            )
    no_optim = getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)
    if _expert_groups(saved) != _expert_groups(args) and not no_optim:
        was = getattr(saved, "expert_model_parallel_size", 1)
        now = getattr(args, "expert_model_parallel_size", 1)
        kept, other = ("keeps", "without") if _expert_groups(saved) else ("does not keep", "with")
        problems.append(
            f"the checkpoint in --load {args.load} (--expert-model-parallel-size {was}; this "
            f"run: {now}) {kept} its experts' optimizer state in groups of their own, and "
            f"megatron-core 0.19 cannot load it into a run {other} them: add --no-load-optim "
            "to resume the weights with a fresh optimizer, or resume with the checkpoint's "
            "expert layout"
        )
    return problems


def problems(launch) -> list[str]:
    """The resume rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return resume_checks(launch.args, launch.plan)


def notes(launch) -> list[str]:
    """The resume's notes (:func:`order_notes`), when a checkpoint would be resumed."""
    try:
        found = checkpoint_to_resume(launch.args)
    except ConfigError:  # reported by problems()
        return []
    if found is None or found[1].get("args") is None:
        return []
    return order_notes(launch.args, launch.plan, found[1]["args"], found[0])
