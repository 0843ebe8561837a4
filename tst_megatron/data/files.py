"""Files of a dataset: atomic writes (a crash never leaves a file that looks complete: a
temporary name in the same directory, then an atomic rename) and the token-range stamp that
lets a start-up skip reading a ``.bin`` it has checked before (its id range, and the
occurrences of the ids counted so far, such as a tokenizer's pad id)."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from typing import Iterator, Mapping, Optional


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; rename it to ``path`` if the block succeeds,
    delete it otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# --- token-id range stamps ----------------------------------------------------------------

#: Suffix of the stamp written beside a dataset's ``.bin`` (``<prefix>.token-range.json``).
STAMP_SUFFIX = ".token-range.json"


def stamp_path(prefix: str, cache_path: Optional[str] = None) -> str:
    """Where the token-range stamp of dataset ``prefix`` lives: in ``cache_path`` (the
    ``--data-cache-path``) when given, named after the prefix and a hash of its real path (so
    two datasets with one basename do not collide), else beside the ``.bin``."""
    if not cache_path:
        return prefix + STAMP_SUFFIX
    real = os.path.realpath(prefix + ".bin")
    tag = hashlib.md5(real.encode(), usedforsecurity=False).hexdigest()[:12]
    return os.path.join(cache_path, f"{os.path.basename(prefix)}-{tag}{STAMP_SUFFIX}")


def file_identity(prefix: str) -> dict:
    """What a stamp is valid for: size (bytes) and modification time (ns) of the ``.bin`` and
    the ``.idx`` of ``prefix``. A file rewritten in place changes at least one of them."""
    out = {}
    for suffix in (".bin", ".idx"):
        st = os.stat(prefix + suffix)
        out[suffix[1:]] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    return out


@dataclasses.dataclass(frozen=True)
class TokenStats:
    """What a stamp records of a ``.bin``: its id range, and how often some ids occur."""

    min: int
    """Smallest token id."""
    max: int
    """Largest token id."""
    counts: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """Occurrences of the ids counted so far (e.g. the tokenizer's pad id), by id."""

    def count(self, token_id: int) -> Optional[int]:
        """Occurrences of ``token_id``: 0 outside ``[min, max]``, the recorded count, or None
        when it was not counted."""
        if not self.min <= token_id <= self.max:
            return 0
        return self.counts.get(token_id)


def read_stamp(prefix: str, cache_path: Optional[str] = None) -> Optional[TokenStats]:
    """The :class:`TokenStats` recorded for ``prefix`` if a stamp exists (in ``cache_path``,
    then beside the ``.bin``) and still matches the files' sizes and times; else None."""
    identity = file_identity(prefix)
    for path in dict.fromkeys([stamp_path(prefix, cache_path), stamp_path(prefix)]):
        try:
            with open(path) as f:
                stamp = json.load(f)
            if stamp["files"] == identity:
                counts = {int(k): int(v) for k, v in stamp.get("counts", {}).items()}
                return TokenStats(int(stamp["min"]), int(stamp["max"]), counts)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return None


def write_stamp(
    prefix: str,
    lo: int,
    hi: int,
    cache_path: Optional[str] = None,
    *,
    counts: Optional[Mapping[int, int]] = None,
) -> str:
    """Record that every token id of ``prefix``'s ``.bin`` is in ``[lo, hi]``, and how often
    the ids of ``counts`` occur (written to a temporary name, then renamed). Returns the
    stamp's path.

    Raises:
        OSError: the stamp's directory is not writable.
    """
    path = stamp_path(prefix, cache_path)
    stamp = {"bin": os.path.realpath(prefix + ".bin"), "files": file_identity(prefix)}
    stamp.update(min=int(lo), max=int(hi))
    if counts:
        stamp["counts"] = {str(int(k)): int(v) for k, v in sorted(counts.items())}
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(stamp, f, indent=1)
    return path
