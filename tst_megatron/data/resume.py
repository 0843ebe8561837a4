"""The checkpoint a launch resumes, read as input before any work: which folder Megatron-LM's
``load_checkpoint`` would read (``--load`` with ``--ckpt-step`` or the tracker file, a global
non-persistent checkpoint, ``--pretrained-checkpoint``), checked by
:func:`tst_megatron.data.checkpoint.inspect`, and its common state. Not a rule: the launch's
check reads it once (:func:`read_resume`, into ``Launch.resumed``), which the run plan, the
launch rules and the launcher use."""

from __future__ import annotations

import functools
import os
from typing import Optional

from tst_megatron.data.checkpoint import (
    UnsafeCheckpoint,
    inspect,
    instead,
    read_common_state,
)
from tst_megatron.errors import ConfigError


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


def read_resume(args) -> tuple[Optional[tuple[int, dict]], Optional[str]]:
    """:func:`checkpoint_to_resume` read once for the launch rules: ``(found, None)``, or
    ``(None, line)`` with the one line saying why the checkpoint cannot be read (a
    :class:`ConfigError`'s message; any other exception named with its type, never a
    traceback)."""
    try:
        return checkpoint_to_resume(args), None
    except ConfigError as exc:
        return None, str(exc)
    except Exception as exc:  # never a traceback from the launcher's own read
        why = " ".join(str(exc).split())[:200]
        line = f"--load {args.load}: the checkpoint to resume could not be read"
        return None, f"{line} ({type(exc).__name__}: {why})"
