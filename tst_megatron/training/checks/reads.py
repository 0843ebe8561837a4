"""The text a run reads, as ``note:`` lines of the launch and the dry run: the tokens each phase
reads, the total, and its ratio to a baseline of the same line (``--tst-bag-size 1``: the same
samples of ``--seq-length`` tokens); with ``.bin``/``.idx`` files present, the epochs of each
dataset's training split each phase reads, and a note when the run repeats data a baseline
would not.

A phase-1 sample is ``S`` consecutive ``T``-token windows of megatron-core's training split
(``docs/design.md``), so phase 1 reads ``S`` times the text per step; at ``S = 4``, ``r = 0.3``
the whole run reads ``0.3 * 4 + 0.7 = 1.9`` times its baseline's tokens.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
from megatron.core.datasets.utils import get_blend_from_list, normalize

from tst_megatron.data.files import open_data_file
from tst_megatron.data.gpt_datasets import DataSettings
from tst_megatron.errors import ConfigError

_UNITS = (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3))


def tokens(n: float, like: Optional[float] = None) -> str:
    """``n`` tokens with a unit, in the unit of ``like`` (default ``n``) and as many decimals
    as give ``like`` three significant figures: ``1.32T``, ``0.77T`` (like 2.09T), ``805M``,
    ``512``."""
    like = n if like is None else like
    for unit, scale in _UNITS:
        if like >= scale:
            digits = max(0, 2 - int(math.floor(math.log10(like / scale))))
            return f"{n / scale:.{digits}f}{unit}"
    return f"{int(n)}"


def text_read(args, plan) -> dict:
    """``{"phase1", "phase2", "total", "baseline"}`` tokens (ints) of the run ``plan``
    (:class:`~tst_megatron.loop.plan.RunPlan`), and ``"windows1"``, ``"windows2"``,
    ``"baseline_windows"``: the ``--seq-length``-token windows of the training split each
    reads (a phase-1 sample is ``data_seq_length / T`` windows).

    Tokens are the samples' distinct tokens: ``samples x data_seq_length`` (a sample's extra
    label token is the next sample's first); the baseline reads ``total_samples x T``.
    """
    seq = args.seq_length
    phase1_samples = plan.switch_sample if plan.n1 else 0
    phase2_samples = plan.total_samples - phase1_samples
    per_sample = plan.schedule.phase1.data_seq_length // seq if plan.n1 else 1
    phase1 = phase1_samples * plan.schedule.phase1.data_seq_length if plan.n1 else 0
    phase2 = phase2_samples * seq
    return {
        "phase1": phase1,
        "phase2": phase2,
        "total": phase1 + phase2,
        "baseline": plan.total_samples * seq,
        "windows1": phase1_samples * per_sample,
        "windows2": phase2_samples,
        "baseline_windows": plan.total_samples,
    }


def text_line(args, plan) -> Optional[str]:
    """The tokens each phase reads, the total and the ratio to a baseline of the same line;
    None for a run that trains no step."""
    read = text_read(args, plan)
    if not read["baseline"]:
        return None
    total = read["total"]
    ratio = total / read["baseline"]
    if not plan.n1:
        return (
            f"text: {tokens(read['total'])} tokens ({plan.total_samples:,} samples of "
            f"{args.seq_length}), as a baseline of this line (no phase 1)"
        )
    return (
        f"text: phase 1 reads {tokens(read['phase1'], total)} tokens, phase 2 "
        f"{tokens(read['phase2'], total)}: {tokens(total)} in all, {ratio:.2f}x the "
        f"{tokens(read['baseline'])} a baseline of this line (--tst-bag-size 1) reads"
    )


def _training_windows_per_epoch(prefix: str, train_share: float, seq_length: int) -> int:
    """megatron-core's ``GPTDataset`` samples in one epoch of ``prefix``'s training split:
    ``(tokens of its first round(train_share * sequences) sequences - 1) // seq_length``
    (``numel_low_level_dataset`` splits by sequence; ``_get_num_epochs`` adds the extra
    token). Reads one pointer of the ``.idx`` (O(1)).

    Raises:
        ConfigError: the files are missing or damaged (:func:`open_data_file`).
    """
    file = open_data_file(prefix)
    end = int(round(train_share * file.sequences))
    if end >= file.sequences:
        split_tokens = file.tokens
    else:
        offset = 34 + 4 * file.sequences + 8 * end  # header, lengths, then int64 pointers
        pointer = np.memmap(prefix + ".idx", np.int64, "r", offset, (1,))
        split_tokens = int(pointer[0]) // np.dtype(file.dtype).itemsize
    return max(0, (split_tokens - 1) // seq_length)


def epoch_lines(args, plan, data: Optional[DataSettings]) -> list[str]:
    """With every ``.bin``/``.idx`` of ``--data-path`` present and intact: the epochs of its
    training split (megatron-core's ``--split``; each dataset its blend weight's share of the
    windows) each phase reads, for the most-read dataset, and a note when the run reads a
    dataset more than once where a baseline of the line reads it at most once. ``data``: the
    line's data settings. Nothing for mock data, per-split paths, missing or damaged files, an
    unreadable ``--data-args-path`` (``data`` None; the data rules report those)."""
    if (
        data is None
        or data.mock_data
        or getattr(args, "train_data_path", None)
        or not data.data_path
    ):
        return []
    prefixes, weights = get_blend_from_list(data.data_path.split())
    weights = normalize(weights) if weights else [1.0 / len(prefixes)] * len(prefixes)
    if not all(os.path.isfile(p + ".idx") and os.path.isfile(p + ".bin") for p in prefixes):
        return []
    train_share = parse_and_normalize_split(data.split)[0] if data.split else 1.0
    read = text_read(args, plan)
    worst = None  # (total epochs, phase 1, phase 2, baseline, prefix)
    try:
        for prefix, weight in zip(prefixes, weights):
            per_epoch = _training_windows_per_epoch(prefix, train_share, args.seq_length)
            if per_epoch == 0:
                return []  # megatron-core's own error names it at set-up
            e1, e2, base = (
                weight * read[key] / per_epoch
                for key in ("windows1", "windows2", "baseline_windows")
            )
            if worst is None or e1 + e2 > worst[0]:
                worst = (e1 + e2, e1, e2, base, prefix)
    except ConfigError:
        return []
    total, e1, e2, base, prefix = worst
    name = "" if len(prefixes) == 1 else f" of {prefix} (the most-read dataset)"
    lines = [
        f"data: this run reads {total:.2f} epochs of the training split{name} (phase 1 "
        f"{e1:.2f}, phase 2 {e2:.2f}); a baseline of this line reads {base:.2f}"
    ]
    if total > 1 >= base:
        lines.append(
            f"this run repeats data a baseline would not: {total:.2f} epochs of the training "
            f"split{name}, where a baseline reads {base:.2f}; megatron-core reshuffles each "
            "epoch. Give more data, or fewer --train-iters/--train-samples"
        )
    return lines


def notes(launch) -> list[str]:
    """The launch's ``note:`` lines about the text it reads (:func:`text_line`,
    :func:`epoch_lines`)."""
    if launch.plan is None:
        return []
    line = text_line(launch.args, launch.plan)
    try:
        epochs = epoch_lines(launch.args, launch.plan, launch.data)
    except Exception:  # a malformed blend, an unreadable file: the data rules say so, in one line
        epochs = []
    return ([line] if line else []) + epochs
