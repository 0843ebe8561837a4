"""Where a conversion may write: the rules that keep every checkpoint and model on disk.

A conversion writes one folder (``--save``). It never deletes or overwrites:

- the folder it reads (``--load``), a folder holding it, or a folder inside it;
- a folder that holds a Megatron checkpoint (the tracker file, ``iter_*``, ``release`` or
  ``*.distcp``), with or without ``--force``;
- anything but its own previous output. ``--force`` replaces a previous export (a folder of
  only the files :func:`~tst_megatron.conversion.hf_files.write_hf_dir` writes) or a previous import
  (a folder with this module's :data:`IMPORT_MARKER`); anything else is refused in one line.

Output is built in a fresh hidden folder next to ``--save`` and renamed into place
(:func:`building`), so a failed conversion leaves what was there and no temporary folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from typing import Mapping

#: The file Megatron-LM's ``load_checkpoint`` reads first in a checkpoint root.
TRACKER = "latest_checkpointed_iteration.txt"
#: The folder of a weights-only checkpoint (the tracker file reads ``release``).
RELEASE = "release"
#: The file an import writes into its ``--save``, so that ``--force`` knows its own output.
IMPORT_MARKER = "tst_megatron_import.txt"
#: Files :func:`~tst_megatron.conversion.hf_files.write_hf_dir` writes (shards: ``model-*``).
EXPORT_FILES = re.compile(
    r"(config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d+-of-\d+\.safetensors|tokenizer\.model|tokenizer_config\.json)"
)
#: Files and folders an import writes (:func:`~tst_megatron.conversion.megatron.write_release`).
IMPORT_FILES = {TRACKER, RELEASE, "tokenizer.model", IMPORT_MARKER}


class RefusedOutput(ValueError):
    """``--save`` would delete or overwrite something the conversion did not write."""


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies inside it (both real, absolute paths)."""
    return os.path.commonpath([path, folder]) == folder


def checkpoint_evidence(folder: str) -> str | None:
    """The first entry of ``folder`` that marks a Megatron checkpoint (the tracker file, an
    ``iter_<N>`` or ``release`` folder, a ``*.distcp`` shard), or None. Top level only."""
    for name in sorted(os.listdir(folder)):
        if name == TRACKER or name.endswith(".distcp") or name == "common.pt":
            return name
        if (re.fullmatch(r"iter_\d+", name) or name == RELEASE) and os.path.isdir(
            os.path.join(folder, name)
        ):
            return name
    return None


def check_output(save: str, *, reads: Mapping[str, str], force: bool, kind: str) -> None:
    """Refuse a ``--save`` that would lose data; run before any work.

    Args:
        save: the folder the conversion will create or replace.
        reads: ``{flag: path}`` it reads (``{"--load": ...}``; a tokenizer model, ...).
        force: the user's ``--force``.
        kind: ``"export"`` or ``"import"``: which previous output ``force`` may replace.

    Raises:
        RefusedOutput: ``save`` is, holds or lies inside a path in ``reads``; or it exists and
            holds a Megatron checkpoint (not an import's own ``release``) or anything the
            conversion does not write.
        FileExistsError: ``save`` is a previous output of ``kind`` and ``force`` is False.
    """
    if not save:
        raise RefusedOutput("--save is empty: name the folder to create")
    target = os.path.realpath(save)
    here = os.path.realpath(os.getcwd())
    if os.path.lexists(save) and _within(here, target):
        raise RefusedOutput(
            f"--save {save} holds the current folder, which a conversion cannot replace (it "
            "renames the finished output into place): run it from outside, or choose a new folder"
        )
    for flag, path in reads.items():
        source = os.path.realpath(path)
        if _within(source, target):
            raise RefusedOutput(
                f"--save {save} holds {flag} {path}: writing it would delete what is read; "
                "choose a new folder (--force never replaces the input)"
            )
        if _within(target, source) and os.path.isdir(source):
            raise RefusedOutput(
                f"--save {save} lies inside {flag} {path}: a conversion never writes into "
                "its input; choose a folder outside it"
            )
    if not os.path.lexists(save):
        return
    if not os.path.isdir(save) or os.path.islink(save):
        raise RefusedOutput(f"--save {save} exists and is not a folder; choose a new folder")
    names = os.listdir(save)
    if kind == "import" and IMPORT_MARKER in names and set(names) <= IMPORT_FILES:
        previous = "a previous import"
    elif (
        kind == "export"
        and "config.json" in names
        and all(EXPORT_FILES.fullmatch(n) for n in names)
    ):
        previous = "a previous export"
    else:
        evidence = checkpoint_evidence(save)
        if evidence is not None:
            raise RefusedOutput(
                f"--save {save} holds a Megatron checkpoint ({evidence}); no conversion "
                "replaces one, with or without --force: choose a new folder"
            )
        if not names:
            return  # an empty folder: nothing to lose
        listed = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise RefusedOutput(
            f"--save {save} holds files an {kind} does not write ({listed}); --force "
            f"replaces only a previous {kind}: choose a new folder"
        )
    if not force:
        raise FileExistsError(f"{save} exists ({previous}); pass --force to replace it")


def umask() -> int:
    """This process's umask (the usual modes: folders ``0o777 & ~umask``, files ``0o666``)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temporary_dir(save: str) -> str:
    """A new, empty hidden folder next to ``save`` to build the output in (never an existing
    path: nothing is removed to make room), with the mode ``mkdir`` would give it."""
    parent = os.path.dirname(os.path.abspath(save))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(save))}.tmp-", dir=parent)
    os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700
    return tmp


def replace_dir(tmp: str, save: str) -> None:
    """Move the finished ``tmp`` to ``save``; a previous output there (already allowed by
    :func:`check_output`) is moved aside first and removed only once ``tmp`` is in place. On
    any failure the previous output is put back and the aside folder removed (``tmp`` is the
    caller's: :func:`building`)."""
    old = None
    try:
        if os.path.lexists(save):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(save))}.old-",
                                   dir=os.path.dirname(os.path.abspath(save)))  # fmt: skip
            os.replace(save, os.path.join(old, "previous"))
        os.replace(tmp, save)
    except BaseException:
        previous = os.path.join(old, "previous") if old else None
        if previous and os.path.lexists(previous) and not os.path.lexists(save):
            os.replace(previous, save)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: str) -> None:
    """Remove a temporary folder of :func:`temporary_dir` after a failure."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def building(save: str):
    """Yield a new :func:`temporary_dir` next to ``save`` to write the output in; on success
    move it to ``save`` (:func:`replace_dir`). On any failure (an exception, ``SystemExit``
    from a signal handler, a failed rename) the temporary folder is removed and what was at
    ``save`` stays."""
    tmp = temporary_dir(save)
    try:
        yield tmp
        replace_dir(tmp, save)
    finally:
        discard(tmp)  # gone after the rename; removed after a failure
