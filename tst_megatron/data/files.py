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
import struct
import threading
from typing import Iterator, Mapping, Optional

import numpy as np
import torch.distributed as dist

from tst_megatron.errors import ConfigError


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temporary path next to ``path``; rename it to ``path`` if the block succeeds,
    delete it otherwise."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    unique = f"{os.getpid()}-{threading.get_ident()}"  # megatron-core may build in threads
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{unique}")
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


#: Bytes of each file region :func:`data_identity` hashes (start, middle and end).
IDENTITY_REGION = 1 << 16


def data_identity(prefix: str) -> str:
    """What the data under ``prefix`` is, independent of where it lives or when it was
    copied: a SHA-256 (hex, 32 digits) of the sizes of its ``.bin`` and ``.idx`` and of three
    :data:`IDENTITY_REGION`-byte regions of each (start, middle, end). Re-preprocessing in
    place changes it (other documents give another ``.idx``); ``cp`` or ``rsync`` does not.
    Bounded cost: at most 384 KiB read per prefix, whatever the size (every rank reads it).

    Raises:
        OSError: a file is missing or unreadable.
    """
    digest = hashlib.sha256()
    for suffix in (".idx", ".bin"):
        path = prefix + suffix
        size = os.path.getsize(path)
        digest.update(f"{suffix}:{size};".encode())
        with open(path, "rb") as f:
            for start in sorted(
                {0, max(0, size // 2 - IDENTITY_REGION // 2), max(0, size - IDENTITY_REGION)}
            ):
                f.seek(start)
                digest.update(f.read(IDENTITY_REGION))
    return digest.hexdigest()[:32]


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
    then beside the ``.bin``) and still matches the files' sizes and times and their sampled
    content (:func:`data_identity`: a stamp forged with ``stat``'s values alone does not
    match); else None."""
    identity = file_identity(prefix)
    content = None
    for path in dict.fromkeys([stamp_path(prefix, cache_path), stamp_path(prefix)]):
        try:
            with open(path) as f:
                stamp = json.load(f)
            if stamp["files"] != identity:
                continue
            content = content or data_identity(prefix)
            if stamp["content"] == content:
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
    stamp["content"] = data_identity(prefix)
    stamp.update(min=int(lo), max=int(hi))
    if counts:
        stamp["counts"] = {str(int(k)): int(v) for k, v in sorted(counts.items())}
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        json.dump(stamp, f, indent=1)
    return path


# --- the ids a data file holds ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataFile:
    """One ``.bin/.idx`` pair, as its ``.idx`` header describes it."""

    prefix: str
    """Path without ``.bin``/``.idx``."""
    dtype: type
    """Token dtype of the ``.bin`` (numpy.uint16 or numpy.int32 from Megatron's tools)."""
    sequences: int
    """Sequences (documents, for GPT data) in the ``.idx``."""
    tokens: int
    """Tokens in the ``.bin``."""


def open_data_file(prefix: str) -> DataFile:
    """Read the ``.idx`` header and check both files' sizes against it (O(1) reads).

    Raises:
        ConfigError: a missing file, a file that is not a Megatron index, a truncated or
            mismatched ``.idx``/``.bin``, or an empty dataset, naming the file.
    """
    # megatron-core: heavy, imported when used
    from megatron.core.datasets.indexed_dataset import DType

    for suffix in (".bin", ".idx"):
        if not os.path.isfile(prefix + suffix):
            raise ConfigError(
                f"--data-path: {prefix + suffix} does not exist (run tools/preprocess_data.py)"
            )
    idx_size, bin_size = os.path.getsize(prefix + ".idx"), os.path.getsize(prefix + ".bin")
    with open(prefix + ".idx", "rb") as f:
        header = f.read(34)  # magic (9), version (8), dtype code (1), sequences (8), documents (8)
    try:
        if not header.startswith(b"MMIDIDX\x00\x00") or len(header) < 34:
            raise ValueError
        dtype = DType.dtype_from_code(header[17])
    except ValueError:
        raise ConfigError(f"--data-path: {prefix}.idx is not a Megatron index file") from None
    sequences, documents = struct.unpack("<QQ", header[18:34])
    expected = 34 + sequences * (4 + 8) + documents * 8  # lengths, pointers, document indices
    if idx_size != expected:
        raise ConfigError(
            f"--data-path: {prefix}.idx has {idx_size} bytes but its header describes "
            f"{expected}: the file is truncated or corrupt; rerun tools/preprocess_data.py"
        )
    itemsize = np.dtype(dtype).itemsize
    tokens = 0
    if sequences:
        last_length = np.memmap(prefix + ".idx", np.int32, "r", 34 + 4 * (sequences - 1), (1,))
        last_pointer = np.memmap(
            prefix + ".idx", np.int64, "r", 34 + 4 * sequences + 8 * (sequences - 1), (1,)
        )
        tokens = (int(last_pointer[0]) + int(last_length[0]) * itemsize) // itemsize
    if bin_size != tokens * itemsize:
        raise ConfigError(
            f"--data-path: {prefix}.bin has {bin_size} bytes but {prefix}.idx describes "
            f"{tokens * itemsize}: the .bin is truncated or belongs to another index; rerun "
            "tools/preprocess_data.py"
        )
    if tokens == 0:
        raise ConfigError(f"--data-path: {prefix}.bin holds no tokens")
    return DataFile(prefix, dtype, sequences, tokens)


def scan_token_range(
    file: DataFile,
    start: int = 0,
    stop: Optional[int] = None,
    chunk: int = 1 << 24,
    *,
    count: tuple[int, ...] = (),
) -> Optional[TokenStats]:
    """The :class:`~tst_megatron.data.files.TokenStats` of ``file``'s ``.bin`` tokens
    ``[start, stop)``: ``(min, max)`` id and the occurrences of each id in ``count``; None if
    the slice is empty. Read in chunks of ``chunk`` tokens so memory stays bounded."""
    tokens = np.memmap(file.prefix + ".bin", dtype=file.dtype, mode="r")
    stop = file.tokens if stop is None else stop
    lo = hi = None
    counts = dict.fromkeys(count, 0)
    for a in range(start, stop, chunk):
        part = tokens[a : min(a + chunk, stop)]
        a_lo, a_hi = int(part.min()), int(part.max())
        lo, hi = (a_lo, a_hi) if lo is None else (min(lo, a_lo), max(hi, a_hi))
        for token_id in counts:
            if a_lo <= token_id <= a_hi:
                counts[token_id] += int(np.count_nonzero(part == token_id))
    return None if lo is None else TokenStats(lo, hi, counts)


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _merge(parts: list[TokenStats], earlier: Optional[TokenStats]) -> TokenStats:
    """One file's stats from the stats of its slices, keeping counts an earlier stamp of the
    same file recorded for other ids."""
    counts = dict(earlier.counts) if earlier is not None else {}
    for token_id in parts[0].counts:
        counts[token_id] = sum(p.counts[token_id] for p in parts)
    return TokenStats(min(p.min for p in parts), max(p.max for p in parts), counts)


def token_ranges(
    files: list[DataFile], *, cache_path: Optional[str] = None, count: tuple[int, ...] = ()
) -> list[TokenStats]:
    """The :class:`~tst_megatron.data.files.TokenStats` of each file (id range, and the
    occurrences of the ids in ``count``), the same on every rank, reading each ``.bin`` at
    most once per change of the file (and of the ids asked).

    Rank 0 looks for a stamp (:func:`tst_megatron.data.files.read_stamp`: written by
    ``tools/preprocess_data.py`` or by an earlier start, valid while the ``.bin``/``.idx``
    sizes and modification times are unchanged, and enough when it has counted the ids of
    ``count`` that lie in its range) and broadcasts what it found. Files without one are
    scanned once, split evenly over all ranks (each reads ``1/world`` of the tokens), the
    partial stats are gathered, and rank 0 writes the stamp (in ``cache_path`` when given,
    else beside the ``.bin``; a read-only place only costs the next start a scan).
    Must be called on every rank (it uses collectives when ``torch.distributed`` is
    initialised): the other ranks wait in the broadcast while rank 0 reads the stamps.
    """
    rank, world = _distributed()
    known = [read_stamp(f.prefix, cache_path) for f in files] if rank == 0 else None
    if world > 1:
        box = [known]
        dist.broadcast_object_list(box, src=0)
        known = box[0]
    enough = [k is not None and all(k.count(i) is not None for i in count) for k in known]
    if all(enough):
        return known
    partial = [
        None
        if ok
        else scan_token_range(
            f, f.tokens * rank // world, f.tokens * (rank + 1) // world, count=count
        )
        for f, ok in zip(files, enough)
    ]
    gathered = [partial]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, partial)
    stats = []
    for i, (f, k, ok) in enumerate(zip(files, known, enough)):
        if not ok:
            k = _merge([g[i] for g in gathered if g[i] is not None], k)
            if rank == 0:
                try:
                    write_stamp(f.prefix, k.min, k.max, cache_path=cache_path, counts=k.counts)
                except OSError as exc:
                    print(f" warning: cannot record the token range of {f.prefix}.bin ({exc})")
        stats.append(k)
    return stats
