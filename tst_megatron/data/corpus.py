"""Build a JSONL text corpus (``{"text": ...}`` per document) from a real source.

Sources:
- ``python-stdlib``: the running Python's standard-library source files (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the regression-test
  directories) and its documentation
  topics (``pydoc_data.topics``): real text every Python installation ships, one document
  per file or topic, in sorted (deterministic) order.
- ``python-site-packages``: the ``*.py`` files of the third-party packages installed for the
  running Python (``sysconfig.get_paths()["purelib"]`` and ``["platlib"]``; in this project's
  ``.venv`` that is torch, megatron-core, transformers, numpy...: about 180 MB of code),
  without tests and caches and without pip's generated editable-install finders
  (``__editable__*.py``, which name the checkout's absolute path), sorted. Its content depends
  on what is installed, so a corpus built from it is reproducible only on the same
  environment: record its size.
- ``system-docs``: the plain-text documentation a Debian/Ubuntu system ships under
  ``/usr/share/doc`` (``*.txt``, ``*.md``, ``*.rst``, ``README``/``NEWS``/``copyright`` files
  and gzip-compressed changelogs ``*.gz``), sorted (about 65 MB on the build machine).
- a directory: every ``*.txt``, ``*.md``, ``*.rst`` and ``*.py`` file under it, sorted.
- a ``.jsonl`` file: passed through (documents with a non-empty ``text``).

What a source reads is input: under a directory (named or given) only regular files whose
real path stays inside that directory, each of at most ``max_file_bytes`` (default
:data:`MAX_FILE_BYTES`; a gzip file's text too). A symlink that leaves the folder (say, to a
private file), a device or FIFO (``/dev/zero``) and a larger file are skipped and reported
(:class:`Skipped`), never read.

Several sources are concatenated in the order given (:func:`build_corpus` takes a list), so
longer training horizons get more real text offline, e.g. ``python-stdlib`` then
``python-site-packages``, capped with ``max_bytes``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import stat
import sysconfig
from typing import Iterator, Optional, Sequence, Union

from tst_megatron.data.files import atomic_path
from tst_megatron.progress import progress

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# Installed third-party packages, caches, and CPython's own regression-test suite (mostly
# generated fixtures) are not part of the corpus.
_SKIPPED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})


#: The largest file a source reads (bytes of text, after gzip); a larger one is skipped.
MAX_FILE_BYTES = 64 * 2**20


class Skipped:
    """The files a source did not read, ``(path, reason)`` each, in the order met."""

    def __init__(self, max_file_bytes: int = MAX_FILE_BYTES):
        self.max_file_bytes = max_file_bytes
        self.files: list[tuple[str, str]] = []

    def readable(self, path: str, root_real: str) -> bool:
        """Whether ``path`` is a regular file whose real path is inside ``root_real`` (the
        source folder's real path) and no larger than the limit; else record why not."""
        real = os.path.realpath(path)
        if not (real == root_real or real.startswith(root_real + os.sep)):
            self.files.append((path, f"a link leaving {root_real}"))
            return False
        try:
            info = os.stat(real)
        except OSError as exc:
            self.files.append((path, f"unreadable: {exc.strerror}"))
            return False
        if not stat.S_ISREG(info.st_mode):
            self.files.append((path, "not a regular file"))
            return False
        if info.st_size > self.max_file_bytes:
            self.files.append((path, f"{info.st_size:,} bytes, over {self.max_file_bytes:,}"))
            return False
        return True

    def read(self, path: str) -> Optional[str]:
        """The text of ``path`` (checked by :meth:`readable`), at most the limit in bytes
        (a gzip file decompressed; None, recorded, when its text is larger)."""
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            data = f.read(self.max_file_bytes + 1)
        if len(data) > self.max_file_bytes:
            self.files.append((path, f"its text is over {self.max_file_bytes:,} bytes"))
            return None
        # as text mode reads it (universal newlines), so a corpus is what it was before
        return data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _texts(paths: Sequence[str], root: str, skipped: "Skipped") -> Iterator[str]:
    """The text of each of ``paths`` (under ``root``) that :meth:`Skipped.readable` allows."""
    root_real = os.path.realpath(root)
    for path in paths:
        if skipped.readable(path, root_real):
            text = skipped.read(path)
            if text is not None:
                yield text


def python_stdlib_documents(skipped: Optional["Skipped"] = None) -> Iterator[str]:
    """The standard library's ``.py`` files, then the pydoc topics, in a fixed order."""
    skipped = skipped if skipped is not None else Skipped()
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    yield from _texts(sorted(paths), root, skipped)
    # the stdlib's documentation text: only for that corpus source
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def _sorted_files(root: str, keep) -> list[str]:
    """Files under ``root`` for which ``keep(name)`` is true, skipping test and cache dirs."""
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        paths += [os.path.join(directory, f) for f in files if keep(f)]
    return sorted(paths)


def python_site_packages_documents(skipped: Optional["Skipped"] = None) -> Iterator[str]:
    """The installed third-party packages' ``.py`` files (purelib, then platlib), sorted,
    without pip's editable finders (:func:`_is_package_source`)."""
    skipped = skipped if skipped is not None else Skipped()
    roots = []
    for key in ("purelib", "platlib"):
        root = os.path.realpath(sysconfig.get_paths()[key])
        if root not in roots and os.path.isdir(root):
            roots.append(root)
    for root in roots:
        yield from _texts(_sorted_files(root, _is_package_source), root, skipped)


def _is_package_source(name: str) -> bool:
    """A ``.py`` file name of an installed package's own code: not pip's editable finder
    ``__editable___<project>_finder.py``, generated at install time with the checkout's
    absolute path in it, so that the corpus does not change with where the project lives (a
    checkout at ``/work/bench`` instead of ``/work/main`` moved the 600-step horizon baseline
    by 0.014 nats)."""
    return name.endswith(".py") and not name.startswith("__editable__")


_DOC_NAMES = ("README", "NEWS", "copyright", "AUTHORS", "THANKS", "TODO")


def system_docs_documents(
    root: str = "/usr/share/doc", skipped: Optional["Skipped"] = None
) -> Iterator[str]:
    """Plain-text files under ``root`` (default ``/usr/share/doc``), gzip ones decompressed.

    Raises:
        ValueError: ``root`` is not a directory.
    """
    skipped = skipped if skipped is not None else Skipped()
    root_real = os.path.realpath(root)
    if not os.path.isdir(root):
        raise ValueError(f"corpus source system-docs needs {root}, which is not a directory")

    def keep(name: str) -> bool:
        base = name[:-3] if name.endswith(".gz") else name
        return (
            base.endswith((".txt", ".md", ".rst"))
            or base.startswith(_DOC_NAMES)
            or (name.endswith(".gz") and base.startswith(("changelog", "NEWS", "README")))
        )

    for path in _sorted_files(root, keep):
        if not skipped.readable(path, root_real):
            continue
        try:
            text = skipped.read(path)
        except (OSError, EOFError):  # a corrupt or non-gzip file: not text, skip it
            continue
        if text is not None:
            yield text


def directory_documents(root: str, skipped: Optional["Skipped"] = None) -> Iterator[str]:
    """Each text file under ``root`` (sorted by path) that :meth:`Skipped.readable` allows."""
    skipped = skipped if skipped is not None else Skipped()
    paths = [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(TEXT_SUFFIXES)
    ]
    yield from _texts(sorted(paths), root, skipped)


def jsonl_documents(path: str, key: str = "text") -> Iterator[str]:
    """The ``key`` field of each line of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)[key]
                except (json.JSONDecodeError, KeyError) as exc:
                    raise ValueError(
                        f"{path}:{number}: not a JSON object with {key!r}: {exc}"
                    ) from exc


SOURCES = ("python-stdlib", "python-site-packages", "system-docs")
"""The named sources (besides a directory or a ``.jsonl`` file)."""


def documents(source: str, skipped: Optional[Skipped] = None) -> Iterator[str]:
    """Documents of ``source`` (one of :data:`SOURCES`, a directory or a ``.jsonl`` file);
    the files it does not read go to ``skipped``.

    Raises:
        ValueError: the source does not exist or is of an unknown kind.
    """
    if source == "python-stdlib":
        return python_stdlib_documents(skipped)
    if source == "python-site-packages":
        return python_site_packages_documents(skipped)
    if source == "system-docs":
        return system_docs_documents(skipped=skipped)
    if os.path.isdir(source):
        return directory_documents(source, skipped)
    if os.path.isfile(source) and source.endswith(".jsonl"):
        return jsonl_documents(source)
    raise ValueError(
        f"corpus source {source!r} is not {', '.join(SOURCES)}, a directory or a .jsonl file"
    )


def _all_documents(sources: Sequence[str], skipped: Skipped) -> Iterator[str]:
    for source in sources:
        yield from documents(source, skipped)


def build_corpus(
    source: Union[str, Sequence[str]],
    output: str,
    *,
    max_documents: Optional[int] = None,
    max_bytes: Optional[int] = None,
    unique: bool = False,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> dict:
    """Write the non-empty documents of ``source`` to the JSONL file ``output``.

    Args:
        source: one source (see :func:`documents`) or a list of them, read in that order.
        output: the JSONL file to write (atomically: nothing is left on error).
        max_documents: stop after this many documents (None: no limit).
        max_bytes: stop after the document that brings the UTF-8 text to at least this many
            bytes (None: no limit).
        unique: keep only the first of documents with the same text (SHA-256 of the UTF-8
            bytes), e.g. the licence texts that many Debian packages ship as ``copyright``:
            a repeated document would put training text into the validation split.
        max_file_bytes: the largest file read from a folder (:class:`Skipped`).

    Returns ``{"documents": n, "bytes": total UTF-8 bytes of text, "duplicates": documents
    dropped as repeats, "skipped": [(path, reason), ...] files not read}``.

    Raises:
        ValueError: unknown source, or no non-empty document (nothing is written).
    """
    sources = [source] if isinstance(source, str) else list(source)
    for name in sources:  # fail on a bad name before reading the earlier sources
        if name not in SOURCES and not os.path.exists(name):
            documents(name)
    count = size = repeats = 0
    seen: set = set()
    skipped = Skipped(max_file_bytes)
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        label = "+".join(os.path.basename(s.rstrip("/")) or s for s in sources)
        texts = _all_documents(sources, skipped)
        for text in progress(texts, desc=f"corpus {label}", unit=" docs"):
            if not text.strip():
                continue
            if unique:
                digest = hashlib.sha256(text.encode("utf-8")).digest()
                if digest in seen:
                    repeats += 1
                    continue
                seen.add(digest)
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            count += 1
            size += len(text.encode("utf-8"))
            if max_documents is not None and count >= max_documents:
                break
            if max_bytes is not None and size >= max_bytes:
                break
        out.flush()
        if count == 0:
            raise ValueError(f"corpus source {source!r} has no non-empty document")
    return {"documents": count, "bytes": size, "duplicates": repeats, "skipped": skipped.files}
