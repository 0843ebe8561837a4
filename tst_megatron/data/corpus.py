"""Build a JSONL text corpus (``{"text": ...}`` per document) from a real source.

Sources:
- ``python-stdlib``: the running Python's standard-library source files (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, without ``site-packages`` and the regression-test
  directories) and its documentation
  topics (``pydoc_data.topics``): real text every Python installation ships, one document
  per file or topic, in sorted (deterministic) order.
- a directory: every ``*.txt``, ``*.md``, ``*.rst`` and ``*.py`` file under it, sorted.
- a ``.jsonl`` file: passed through (documents with a non-empty ``text``).
"""

from __future__ import annotations

import json
import os
import sysconfig
from typing import Iterator, Optional

from tqdm import tqdm

from tst_megatron.data.files import atomic_path

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py")
# Installed third-party packages, caches, and CPython's own regression-test suite (mostly
# generated fixtures) are not part of the corpus.
_SKIPPED_DIRS = frozenset({"site-packages", "__pycache__", "test", "tests", "idle_test"})


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def python_stdlib_documents() -> Iterator[str]:
    """The standard library's ``.py`` files, then the pydoc topics, in a fixed order."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        paths += [os.path.join(directory, f) for f in files if f.endswith(".py")]
    for path in sorted(paths):
        yield _read(path)
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield topics[name]


def directory_documents(root: str) -> Iterator[str]:
    """Each text file under ``root`` (sorted by path)."""
    paths = [
        os.path.join(d, f)
        for d, _, files in os.walk(root)
        for f in files
        if f.endswith(TEXT_SUFFIXES)
    ]
    for path in sorted(paths):
        yield _read(path)


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


def documents(source: str) -> Iterator[str]:
    """Documents of ``source`` (``python-stdlib``, a directory or a ``.jsonl`` file).

    Raises:
        ValueError: the source does not exist or is of an unknown kind.
    """
    if source == "python-stdlib":
        return python_stdlib_documents()
    if os.path.isdir(source):
        return directory_documents(source)
    if os.path.isfile(source) and source.endswith(".jsonl"):
        return jsonl_documents(source)
    raise ValueError(f"corpus source {source!r} is not python-stdlib, a directory or a .jsonl file")


def build_corpus(source: str, output: str, *, max_documents: Optional[int] = None) -> dict:
    """Write the non-empty documents of ``source`` to the JSONL file ``output``.

    Returns ``{"documents": n, "bytes": total UTF-8 bytes of text}``.

    Raises:
        ValueError: unknown source, or no non-empty document (nothing is written).
    """
    count = size = 0
    with atomic_path(output) as tmp, open(tmp, "w", encoding="utf-8") as out:
        for text in tqdm(documents(source), desc=f"corpus {source}", unit=" docs"):
            if not text.strip():
                continue
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            count += 1
            size += len(text.encode("utf-8"))
            if max_documents is not None and count >= max_documents:
                break
        out.flush()
        if count == 0:
            raise ValueError(f"corpus source {source!r} has no non-empty document")
    return {"documents": count, "bytes": size}
