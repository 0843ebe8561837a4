"""Resume rules: a checkpoint in ``--load`` that this run would not continue (TST's phase
plan and sample orders, the learning-rate schedule; the model and the layout:
:mod:`.architecture`), read before any work. The checkpoint itself is read by
:mod:`tst_megatron.data.resume`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from megatron.core.datasets.utils import get_blend_from_list

from tst_megatron.data.gpt_datasets import (
    blend_identity,
    data_prefixes,
    epoch_layout,
    train_split_tokens,
    training_windows,
)
from tst_megatron.loop.plan import run_plan
from tst_megatron.training.checks.architecture import (
    architecture_problems,
    flag_name,
    layout_problems,
)

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
    """The words of ``--data-path``, or of the ``--data-args-path`` file ([] when unreadable or
    no text: the data rules' line, or with ``--mock-data``). ``args``: this run's or a
    checkpoint's saved ones."""
    if getattr(args, "mock_data", False):
        return []
    words = list(getattr(args, "data_path", None) or [])
    if getattr(args, "data_args_path", None):
        try:
            with open(args.data_args_path) as f:
                words = f.read().split()
        except (OSError, ValueError):  # ValueError: UnicodeDecodeError
            return []
    return words


def _blended(args) -> bool:
    """``--data-path`` (or the ``--data-args-path`` file) names more than one dataset, or gives
    weights: megatron-core then builds a ``BlendedDataset``, whose parts are sized by the run's
    length (``get_blend_from_list`` returns weights even for ``1.0 A``)."""
    words = _data_words(args)
    if not words:
        return False
    prefixes, weights = get_blend_from_list(words)
    return len(prefixes) > 1 or weights is not None


def _changed(args, saved, names) -> list[tuple[str, object, object]]:
    """``[(flag, checkpoint's value, this run's value)]`` of ``names`` that differ."""
    return [
        (flag_name(name), getattr(saved, name), getattr(args, name, None))
        for name in names
        if hasattr(saved, name) and getattr(saved, name) != getattr(args, name, None)
    ]


def current_data_identity(args) -> Optional[str]:
    """:func:`~tst_megatron.data.gpt_datasets.blend_identity` of the line's data files, or
    None (mock data, an unreadable ``--data-args-path``, or files missing: the data rules say
    so)."""
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
    ``args`` and their ``plan`` (a :class:`~tst_megatron.loop.plan.RunPlan`) would not
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


def resume_checks(args, plan, found: Optional[tuple[int, dict]]) -> list[str]:
    """The problems of resuming ``found``, ``(iteration, common state)`` of the checkpoint in
    ``--load`` (:func:`~tst_megatron.data.resume.read_resume`; None: nothing to resume), under
    ``args`` and their ``plan``: TST's (:func:`resume_problems`), the model's
    (:func:`architecture_problems`), the layout's (:func:`layout_problems`) and the LR
    schedule's (:func:`scheduler_problems`)."""
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


def problems(launch) -> list[str]:
    """The resume rules of a :class:`~tst_megatron.training.checks.Launch`: the line of a
    checkpoint that cannot be read, or :func:`resume_checks`."""
    if launch.resume_error:
        return [launch.resume_error]
    return resume_checks(launch.args, launch.plan, launch.resumed)


def notes(launch) -> list[str]:
    """The resume's notes (:func:`order_notes`), when a checkpoint would be resumed."""
    found = launch.resumed
    if found is None or found[1].get("args") is None:
        return []
    return order_notes(launch.args, launch.plan, found[1]["args"], found[0])
