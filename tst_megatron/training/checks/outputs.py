"""Output rules: every folder the run writes (``--save``, ``--tensorboard-dir``,
``--wandb-save-dir``, ``--data-cache-path``) can be written before any work. Megatron-LM 0.19.2
finds a read-only ``--save`` only at the first save (``checkpointing.py``: ``OSError: [Errno
30]``), after the training up to it."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

#: ``(args name, flag)`` of each folder a run writes.
OUTPUT_FOLDERS = (
    ("save", "--save"),
    ("tensorboard_dir", "--tensorboard-dir"),
    ("wandb_save_dir", "--wandb-save-dir"),
    ("data_cache_path", "--data-cache-path"),
)


def probe(folder: str, *, create: bool) -> Optional[str]:
    """Why ``folder`` cannot be written (None: it can): created first when ``create`` (as the
    run would), then a probe file is written in it and removed.

    Returns:
        ``"cannot be created (...)"``, ``"is not a folder"`` or ``"cannot be written (...)"``
        with the ``OSError``'s text, or None.
    """
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            return f"cannot be created ({exc.strerror or type(exc).__name__})"
    if not os.path.isdir(folder):
        return "is not a folder"
    try:
        fd, name = tempfile.mkstemp(prefix=".tst_write_probe-", dir=folder)
        try:
            os.write(fd, b"probe")
        finally:
            os.close(fd)
            os.remove(name)
    except OSError as exc:
        return f"cannot be written ({exc.strerror or type(exc).__name__})"
    return None


def _nearest_here(path: str) -> Optional[str]:
    """``path``, or its parent, when it is a folder on this machine (what a dry run probes
    without creating anything); None otherwise."""
    for folder in (path, os.path.dirname(os.path.abspath(path))):
        if os.path.isdir(folder):
            return folder
    return None


def problems(launch) -> list[str]:
    """One line per output folder that cannot be written. A launch creates each (as
    Megatron-LM would) and probes it on every rank; a dry run creates nothing and probes the
    folder, or its parent, when it is on this machine (:func:`not_here` lists the others)."""
    lines = []
    for name, flag in OUTPUT_FOLDERS:
        path = getattr(launch.args, name, None)
        if not path:
            continue
        folder = path if launch.launch else _nearest_here(path)
        if folder is None:
            continue
        problem = probe(folder, create=launch.launch)
        if problem:
            where = "" if folder == path else f" (its parent {folder})"
            lines.append(
                f"{flag} {path}{where} {problem}: the run would stop at its first write; "
                "give a writable folder"
            )
    return lines


def not_here(args) -> list[str]:
    """The output folders of the line whose folder and parent are not on this machine (what a
    dry run cannot probe)."""
    return [
        path
        for name, _ in OUTPUT_FOLDERS
        if (path := getattr(args, name, None)) and _nearest_here(path) is None
    ]


def space_notes(args, checkpoint_bytes: Optional[float]) -> list[str]:
    """A note when the free space where ``--save`` lies is below ``checkpoint_bytes`` (one
    checkpoint: the dry run's estimate); none when either is unknown."""
    if not checkpoint_bytes or not getattr(args, "save", None):
        return []
    folder = args.save
    while folder and not os.path.isdir(folder):
        parent = os.path.dirname(os.path.abspath(folder))
        folder = None if parent == folder else parent
    if folder is None:
        return []
    free = shutil.disk_usage(folder).free
    if free >= checkpoint_bytes:
        return []
    return [
        f"--save {args.save}: {_size(free)} free there, below one checkpoint's estimated "
        f"{_size(checkpoint_bytes)} (weights and optimizer state): the first save would fail"
    ]


def _size(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
