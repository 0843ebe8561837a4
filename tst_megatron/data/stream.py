"""TST's training order over megatron-core's ``T``-token samples: phase-1 blocks of ``S``
consecutive windows and the phase-2 windows phase 1 left (``docs/design.md``, "Phase 1 data",
"The schedule").

In *stream order* (megatron-core's sample shuffle undone) window ``j`` holds tokens
``[j*T, (j+1)*T]`` of the packed stream; a blend has one stream per dataset. The orders (one
index per window) are computed once per cache directory, written atomically and memory-mapped
by every rank and DataLoader worker (:func:`open_stream`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from tst_megatron.data import array_check
from tst_megatron.data.files import atomic_path
from tst_megatron.data.index_cache import is_cache_builder, npy_problem
from tst_megatron.errors import ConfigError

FORMAT = 1
"""Bumped whenever the orders computed from the same inputs change (part of the cache key)."""

_ARRAYS = ("blocks", "phase2")


def index_dtype(n: int) -> np.dtype:
    """uint32 for ``n < 2**32 - 1`` windows, else int64 (megatron-core's
    ``_build_shuffle_index``)."""
    return np.dtype(np.uint32 if n < 2**32 - 1 else np.int64)


def inverse_permutation(perm: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
    """``np.argsort(perm)`` of a permutation of ``0..n-1`` in O(n): ``inv[perm[k]] = k``,
    ``[n]`` of :func:`index_dtype`; ``perm`` (possibly memory-mapped) is read in chunks."""
    dtype = index_dtype(len(perm))
    inv = np.empty(len(perm), dtype=dtype)
    for start in range(0, len(perm), chunk):
        part = np.asarray(perm[start : start + chunk])
        inv[part] = np.arange(start, start + len(part), dtype=dtype)
    return inv


def stream_parts(dataset) -> list[tuple[object, int]]:
    """``[(component, n)]``: the data as token streams, the first ``n`` windows of each.

    A ``GPTDataset`` is one stream. A ``BlendedDataset`` has one per dataset, ``n`` being the
    samples the blend draws from it, so the blend's weights hold.
    """
    dataset[0]  # megatron-core loads a blend's indices lazily
    if hasattr(dataset, "datasets") and hasattr(dataset, "dataset_index"):  # a blend
        counts = np.bincount(dataset.dataset_index, minlength=len(dataset.datasets))
        return [(d, int(n)) for d, n in zip(dataset.datasets, counts) if n]
    return [(dataset, len(dataset))]


def _stream_order(dataset, n: int) -> np.ndarray:
    """Window ``j`` of ``dataset``'s stream is ``dataset[order[j]]``, for ``j < n``."""
    dataset[0]  # megatron-core loads its shuffle index lazily
    shuffle = getattr(dataset, "shuffle_index", None)
    if shuffle is None:
        return np.arange(n, dtype=index_dtype(n))
    return inverse_permutation(np.asarray(shuffle))[:n]


def build_orders(
    parts, *, windows_per_sample: int, phase1_samples: int, seed: int, chunk: int = 1 << 24
):
    """Yields the ``(name, array)`` of :class:`TrainStream` one at a time, so each can be freed
    before the next: ``order<p>`` per part, ``blocks`` (first global window of each phase-1
    block: the first ``phase1_samples`` of all blocks shuffled by ``RandomState(seed)``) and
    ``phase2`` (every unused window, shuffled by ``default_rng([seed, 2])``). Arrays are
    1-D, :func:`index_dtype`. Peak memory: a mask (1 byte a window), phase 2 (4 bytes a
    window) and the blocks (12 bytes a block) at once.
    """
    sizes = [n for _, n in parts]
    total = int(sum(sizes))
    dtype = index_dtype(total)
    for p, (d, n) in enumerate(parts):
        yield f"order{p}", _stream_order(d, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    starts = np.concatenate(
        [
            off + np.arange(n // windows_per_sample, dtype=dtype) * windows_per_sample
            for off, n in zip(offsets, sizes)
        ]
    ).astype(dtype, copy=False)
    # RandomState(seed).permutation(len(starts)) without its int64 copy
    perm = np.arange(len(starts), dtype=dtype)
    np.random.RandomState(seed).shuffle(perm)
    blocks = starts[perm[:phase1_samples]]  # the blocks phase 1 reads
    del starts, perm
    unused = np.ones(total, dtype=bool)
    for k in range(windows_per_sample):
        unused[blocks + k] = False
    yield "blocks", blocks
    del blocks
    phase2 = np.empty(int(np.count_nonzero(unused)), dtype=dtype)
    filled = 0
    for start in range(0, total, chunk):  # np.flatnonzero(unused), without its int64 copy
        found = np.flatnonzero(unused[start : start + chunk]).astype(dtype) + dtype.type(start)
        phase2[filled : filled + len(found)] = found
        filled += len(found)
    del unused
    np.random.default_rng([seed, 2]).shuffle(phase2)
    yield "phase2", phase2


def describe(parts, *, windows_per_sample: int, phase1_samples: int, seed: int) -> Optional[dict]:
    """The cache description: each part's megatron-core ``unique_description_hash`` and window
    count, ``S``, the phase-1 samples and the seed. None (no caching) when a part has no hash."""
    hashes = [getattr(d, "unique_description_hash", None) for d, _ in parts]
    if not all(hashes):
        return None
    return {
        "class": "TrainStream",
        "format": FORMAT,
        "parts": [[h, n] for h, (_, n) in zip(hashes, parts)],
        "windows_per_sample": windows_per_sample,
        "phase1_samples": phase1_samples,
        "seed": seed,
    }


def cache_files(directory: str, description: dict, parts: int) -> dict:
    """``{name: path}``: ``<key>-TrainStream-<name>.npy`` and ``.json``, ``key`` a SHA-256 of
    ``description``."""
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
    names = [f"order{p}" for p in range(parts)] + list(_ARRAYS)
    files = {n: os.path.join(directory, f"{key}-TrainStream-{n}.npy") for n in names}
    files["checks"] = os.path.join(directory, f"{key}-TrainStream-checks.json")
    files["description"] = os.path.join(directory, f"{key}-TrainStream-description.json")
    return files


def _array_names(files: dict) -> list[str]:
    return [n for n in files if n not in ("description", "checks")]


def cache_problem(files: dict, description: dict) -> Optional[str]:
    """Why the cache ``files`` cannot be used (missing, truncated or corrupt file, other
    description, an array whose content is not the one recorded when it was built:
    :func:`~tst_megatron.data.array_check.problem`), or None. Reads the headers and a bounded
    sample of each array."""
    for name, path in files.items():
        if not os.path.isfile(path):
            return f"{path} is missing"
        if name not in ("description", "checks") and (why := npy_problem(path)) is not None:
            return f"{path} {why}"
    try:
        with open(files["description"]) as f:
            if json.load(f) != description:
                return f"{files['description']} describes other data or settings"
        with open(files["checks"]) as f:
            checks = json.load(f)
    except (OSError, ValueError) as exc:
        return f"{files['description']} or its checks are unreadable ({exc})"
    for name in _array_names(files):
        array = np.load(files[name], mmap_mode="r")
        if (why := array_check.problem(array, checks.get(name))) is not None:
            return f"{files[name]} {why}"
    return None


def write_cache(files: dict, arrays, description: dict) -> None:
    """Writes each ``(name, array)`` atomically, then their content records
    (:func:`~tst_megatron.data.array_check.summary`), the description last."""
    checks = {}
    for name, array in arrays:
        checks[name] = array_check.summary(array)
        with atomic_path(files[name]) as tmp, open(tmp, "wb") as f:
            np.save(f, array)
        del array
    with atomic_path(files["checks"]) as tmp, open(tmp, "w") as f:
        json.dump(checks, f, sort_keys=True)
    with atomic_path(files["description"]) as tmp, open(tmp, "w") as f:
        json.dump(description, f, sort_keys=True)


def check_enough_blocks(parts, windows_per_sample: int, phase1_samples: int) -> None:
    """Raises ConfigError when ``parts`` hold fewer ``windows_per_sample``-window blocks than
    ``phase1_samples``."""
    blocks = sum(n // windows_per_sample for _, n in parts)
    if blocks < phase1_samples:
        raise ConfigError(
            f"the data gives {blocks} phase-1 samples of {windows_per_sample} windows but phase "
            f"1 needs {phase1_samples}; add data or lower --tst-phase1-iters/--train-iters"
        )


class TrainStream:
    """Phase-1 and phase-2 training samples from one dataset of ``T``-token windows: phase-1
    sample ``i`` is the ``S`` consecutive windows from ``blocks[i]``; phase 2 reads every
    other window once, in a second seeded shuffle (``phase2``).

    Args:
        dataset: a megatron-core ``GPTDataset`` of ``T``-token samples (or a blend).
        windows_per_sample: ``S`` (windows per phase-1 sample).
        phase1_samples: samples phase 1 consumes in the whole run (``N1 * global batch``).
        seed: seeds both shuffles.
        cache_dir: where the orders are cached (``--data-cache-path``); None: in memory.
        build: True: compute a missing or damaged cache and write it; False: only map it.

    Attributes:
        parts: ``[(component, order)]``, window ``j`` being ``component[order[j]]``;
            ``blocks``, ``phase2``: 1-D index arrays (memory-mapped when cached).

    Raises:
        ConfigError: fewer blocks of ``S`` windows than phase-1 samples; or, with
            ``build=False``, a missing, damaged or stale cache.
    """

    def __init__(
        self,
        dataset,
        *,
        windows_per_sample: int,
        phase1_samples: int,
        seed: int,
        cache_dir: Optional[str] = None,
        build: bool = True,
    ):
        self.windows_per_sample, self.phase1_samples = windows_per_sample, phase1_samples
        parts = stream_parts(dataset)
        check_enough_blocks(parts, windows_per_sample, phase1_samples)
        settings = dict(
            windows_per_sample=windows_per_sample, phase1_samples=phase1_samples, seed=seed
        )
        description = describe(parts, **settings) if cache_dir else None
        self.files = cache_files(cache_dir, description, len(parts)) if description else None
        if self.files is None:
            arrays = dict(build_orders(parts, **settings))
        elif (why := cache_problem(self.files, description)) is None:
            arrays = self._map()
        elif not build:
            raise ConfigError(
                f"TST sample-order cache {why}; delete it (or the whole --data-cache-path "
                "directory) and restart to rebuild it"
            )
        else:
            if os.path.exists(self.files["description"]):
                print(f" warning: TST sample-order cache {why}; rebuilding it", flush=True)
            write_cache(self.files, build_orders(parts, **settings), description)
            arrays = self._map()
        self._datasets = [d for d, _ in parts]
        self._set(arrays)

    def _map(self) -> dict:
        return {n: np.load(self.files[n], mmap_mode="r") for n in _array_names(self.files)}

    def _set(self, arrays: dict) -> None:
        orders = [arrays[f"order{p}"] for p in range(len(self._datasets))]
        self.parts = list(zip(self._datasets, orders))
        self.offsets = np.concatenate([[0], np.cumsum([len(o) for o in orders])])
        self.blocks, self.phase2 = arrays["blocks"], arrays["phase2"]

    def __getstate__(self) -> dict:
        """A cached stream pickles as its file names, not its arrays."""
        state = dict(self.__dict__)
        if self.files is not None:
            for name in ("parts", "blocks", "phase2"):
                state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.files is not None:
            self._set(self._map())

    def window(self, g: int) -> dict:
        """Global window ``g``: window ``g - offsets[p]`` of stream ``p``."""
        p = int(np.searchsorted(self.offsets, g, side="right")) - 1
        dataset, order = self.parts[p]
        return dataset[int(order[g - self.offsets[p]])]

    def phase1_sample(self, i: int) -> dict:
        """Phase-1 sample ``i``: ``tokens``, ``labels``, ``loss_mask`` ``[S*T]``; IndexError
        past ``phase1_samples``."""
        if i >= self.phase1_samples:
            raise IndexError(f"phase-1 sample {i} is past the {self.phase1_samples} planned")
        first = int(self.blocks[i])
        windows = [self.window(first + k) for k in range(self.windows_per_sample)]
        return {
            key: torch.cat([w[key] for w in windows]) for key in ("tokens", "labels", "loss_mask")
        }

    def phase2_sample(self, i: int) -> dict:
        """Phase-2 sample ``i``: window ``phase2[i]``; IndexError past the last."""
        if i >= len(self.phase2):
            raise IndexError(
                f"phase 1 left {len(self.phase2)} windows of the data; phase-2 sample {i} is "
                "past them"
            )
        return self.window(int(self.phase2[i]))


def open_stream(
    dataset, *, windows_per_sample: int, phase1_samples: int, seed: int, cache_dir, local_rank
):
    """:class:`TrainStream` cached in ``cache_dir``, written by the ``is_cache_builder`` ranks
    and then mapped by the others. Call on every rank; any rank's failure is raised on all.

    Raises:
        ConfigError: as :class:`TrainStream`, or another rank's failure (its message).
    """
    settings = dict(windows_per_sample=windows_per_sample, phase1_samples=phase1_samples, seed=seed)
    if cache_dir is None or not (dist.is_available() and dist.is_initialized()):
        return TrainStream(dataset, cache_dir=cache_dir, **settings)
    # before any wait
    check_enough_blocks(stream_parts(dataset), windows_per_sample, phase1_samples)
    builder = is_cache_builder(cache_dir, local_rank)
    stream = _everywhere(lambda: TrainStream(dataset, cache_dir=cache_dir, **settings), builder)
    reader = _everywhere(
        lambda: TrainStream(dataset, cache_dir=cache_dir, build=False, **settings), not builder
    )
    return stream or reader


def _everywhere(make, mine: bool):
    """``make()`` where ``mine`` (else None); the first failure of any rank is raised on all as
    a ConfigError (``all_gather_object``)."""
    result, error = None, None
    try:
        result = make() if mine else None
    except Exception as exc:  # any: a rank that stops here would leave the others waiting
        error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise ConfigError(first)
    return result
