"""Content checks of cached index arrays, at a bounded cost: what a cache file must hold,
recorded when it is built (:func:`summary`) and compared before it is used (:func:`problem`).

A cache directory is often a shared filesystem; a file there of the right name, size and
``.npy`` header can still hold other values (planted, or damaged in place). The shape and
dtype are compared exactly; the values through a SHA-256 of :data:`BLOCKS` fixed blocks of
:data:`BLOCK` elements spread over the array (the first and the last included), whose values
must also lie in the recorded ``[min, max]`` (the whole array's, at build time). So a replaced
array is caught unless it agrees with the original on every sampled element; the cost does
not grow with the array (1 MiB read for ``uint32``; ``docs/results/cache_check.md``).
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

#: Sampled blocks per array, and elements per block.
BLOCKS, BLOCK = 64, 4096


def _starts(n: int) -> list[int]:
    """The first element of each sampled block of an ``n``-element array (sorted, unique)."""
    if n <= BLOCKS * BLOCK:
        return [0] if n else []
    last = n - BLOCK
    return sorted({round(i * last / (BLOCKS - 1)) for i in range(BLOCKS)})


def _sample(array: np.ndarray) -> np.ndarray:
    """The sampled elements of a 1-D ``array`` (a copy of at most ``BLOCKS * BLOCK``)."""
    flat = array.reshape(-1) if array.ndim != 1 else array
    n = len(flat)
    if n <= BLOCKS * BLOCK:
        return np.ascontiguousarray(flat)
    return np.concatenate([np.asarray(flat[s : s + BLOCK]) for s in _starts(n)])


def summary(array: np.ndarray) -> dict:
    """What :func:`problem` checks, for ``array`` as built: ``{"shape", "dtype", "min",
    "max", "sample"}`` (``min``/``max`` over the whole array, None when empty or not numeric;
    ``sample``: the SHA-256 of the sampled blocks' bytes)."""
    numeric = array.dtype.kind in "iub" and array.size
    return {
        "shape": list(array.shape),
        "dtype": array.dtype.str,
        "min": int(array.min()) if numeric else None,
        "max": int(array.max()) if numeric else None,
        "sample": hashlib.sha256(_sample(array).tobytes()).hexdigest(),
    }


def problem(array: np.ndarray, recorded: Optional[dict]) -> Optional[str]:
    """Why ``array`` (typically memory-mapped) is not the array :func:`summary` recorded, or
    None: no record, another shape or dtype, a sampled value outside ``[min, max]``, or other
    sampled values."""
    if not isinstance(recorded, dict):
        return "has no content record (built before records were kept, or not by this project)"
    if list(array.shape) != recorded.get("shape") or array.dtype.str != recorded.get("dtype"):
        return (
            f"holds {array.dtype.str} {list(array.shape)} where {recorded.get('dtype')} "
            f"{recorded.get('shape')} was built"
        )
    sample = _sample(array)
    low, high = recorded.get("min"), recorded.get("max")
    if low is not None and sample.size and (int(sample.min()) < low or int(sample.max()) > high):
        return f"holds values outside [{low}, {high}], the range it was built with"
    if hashlib.sha256(sample.tobytes()).hexdigest() != recorded.get("sample"):
        return "holds other values than it was built with (planted or damaged)"
    return None
