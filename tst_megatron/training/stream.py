"""TST's training order: phase-1 blocks and phase-2 windows over megatron-core's samples,
built once per cache directory and memory-mapped by every rank.

The training data is one ``GPTDataset`` (or ``MockGPTDataset``, or a blend of them) of
``T``-token samples. Read in *stream order* (megatron-core's sample shuffle undone), its
samples are consecutive windows of the packed token stream: window ``j`` holds tokens
``[j*T, (j+1)*T]``. :class:`TrainStream` groups the windows into blocks of ``S`` consecutive
windows of one stream and shuffles the blocks once (seeded):
- phase-1 sample ``i`` is block ``blocks[i]``: ``S`` windows concatenated, exactly ``S*T + 1``
  contiguous tokens (``docs/design.md``, "Phase 1 data");
- phase 2 reads the windows phase 1 did not use, each once, in a second seeded shuffle, so it
  continues through the data instead of rereading what phase 1 consumed, and its
  micro-batches hold independent windows (``docs/design.md``, "The schedule").
A blend has one stream per dataset (:func:`stream_parts`); a block never straddles two.

The orders are arrays of one index per window (1.1 B windows for the published DeepSeek-V3
line at ``S = 4``). As megatron-core does for its own indices, they are computed once per
cache directory, by the rank that builds megatron-core's caches there
(:func:`~tst_megatron.training.index_cache.is_cache_builder`), written to a temporary name
and renamed, and memory-mapped by every rank (:func:`open_stream`): a rank holds O(1) of
them in its own memory, and DataLoader workers map the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np
import torch

from tst_megatron.data.files import atomic_path
from tst_megatron.errors import ConfigError

FORMAT = 1
"""Bumped whenever the orders computed from the same inputs change: it enters the cache key."""

_ARRAYS = ("blocks", "phase2")


def index_dtype(n: int) -> np.dtype:
    """The narrowest index dtype for ``n`` windows, as megatron-core's ``_build_shuffle_index``
    picks (uint32 below 2**32, else int64): 4 bytes a window for every real corpus."""
    return np.dtype(np.uint32 if n < 2**32 - 1 else np.int64)


def inverse_permutation(perm: np.ndarray, chunk: int = 1 << 24) -> np.ndarray:
    """``inv`` with ``inv[perm[k]] = k``: what ``np.argsort(perm)`` gives for a permutation of
    ``0..n-1``, in O(n) time and one array of :func:`index_dtype` (argsort is O(n log n) and
    int64); ``perm`` (megatron-core's memory-mapped shuffle index) is read in chunks."""
    dtype = index_dtype(len(perm))
    inv = np.empty(len(perm), dtype=dtype)
    for start in range(0, len(perm), chunk):
        part = np.asarray(perm[start : start + chunk])
        inv[part] = np.arange(start, start + len(part), dtype=dtype)
    return inv


def stream_parts(dataset) -> list[tuple[object, int]]:
    """The training data as contiguous token streams: ``[(component, n)]``, the first ``n``
    windows of each component's stream.

    A ``GPTDataset`` is one stream: its samples with megatron-core's sample shuffle undone,
    consecutive ``T``-token windows of the packed token stream. A blend (megatron-core's
    ``BlendedDataset``) has one stream per dataset, each the first ``n_d`` windows of that
    dataset's stream, ``n_d`` being the samples the blend draws from it (so the blend's
    weights hold; one O(N) count over its memory-mapped dataset index); taking the blend's
    own order instead would put unrelated windows side by side.
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


def build_orders(parts, *, bag_size: int, phase1_samples: int, seed: int, chunk: int = 1 << 24):
    """Yields ``(name, array)``, the arrays of :class:`TrainStream` one at a time (so that a
    writer can free each before the next is made): ``order<p>`` for each part (its stream
    order), ``blocks`` (the first global window of each block phase 1 reads: the first
    ``phase1_samples`` of all blocks shuffled with ``RandomState(seed)``) and ``phase2``
    (every window no phase-1 sample uses, shuffled with ``default_rng([seed, 2])``). Global window ``g`` is window ``g - offset[p]`` of part ``p``,
    the parts laid end to end.

    Peak memory, for the cache builder only: the largest part's order (4 bytes a window),
    then the blocks (12 bytes a block), a mask (1 byte a window) and phase 2 (4 bytes a
    window) at once.
    """
    sizes = [n for _, n in parts]
    total = int(sum(sizes))
    dtype = index_dtype(total)
    for p, (d, n) in enumerate(parts):
        yield f"order{p}", _stream_order(d, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    starts = np.concatenate(
        [off + np.arange(n // bag_size, dtype=dtype) * bag_size for off, n in zip(offsets, sizes)]
    ).astype(dtype, copy=False)
    # RandomState(seed).permutation(len(starts)) without its int64 copy: shuffle draws the
    # same numbers whatever the dtype
    perm = np.arange(len(starts), dtype=dtype)
    np.random.RandomState(seed).shuffle(perm)
    blocks = starts[perm[:phase1_samples]]  # the blocks phase 1 reads
    del starts, perm
    unused = np.ones(total, dtype=bool)
    for k in range(bag_size):
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


def describe(parts, *, bag_size: int, phase1_samples: int, seed: int) -> Optional[dict]:
    """What the orders depend on: each part's megatron-core description hash (its data,
    split, ``--seq-length``, ``--seed`` and sample count) and window count, ``S`` (the
    windows of a phase-1 sample, which ``--tst-mode`` sets), the phase-1 samples
    (``N1`` x the global batch, summed over a batch-size ramp) and the seed. None when a part
    has no description (a stand-in dataset): nothing is cached then."""
    hashes = [getattr(d, "unique_description_hash", None) for d, _ in parts]
    if not all(hashes):
        return None
    return {
        "class": "TrainStream",
        "format": FORMAT,
        "parts": [[h, n] for h, (_, n) in zip(hashes, parts)],
        "bag_size": bag_size,
        "phase1_samples": phase1_samples,
        "seed": seed,
    }


def cache_files(directory: str, description: dict, parts: int) -> dict:
    """``{name: path}`` of one stream's cache: ``<key>-TrainStream-<name>.npy`` and the
    description, the key a SHA-256 of the description (any changed input, another file)."""
    key = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()[:24]
    names = [f"order{p}" for p in range(parts)] + list(_ARRAYS)
    files = {n: os.path.join(directory, f"{key}-TrainStream-{n}.npy") for n in names}
    files["description"] = os.path.join(directory, f"{key}-TrainStream-description.json")
    return files


def cache_problem(files: dict, description: dict) -> Optional[str]:
    """Why the cache ``files`` cannot be used (a file missing, truncated or corrupt, or a
    description other than ``description``), or None. Reads headers only."""
    from tst_megatron.training.index_cache import npy_problem

    for name, path in files.items():
        if not os.path.isfile(path):
            return f"{path} is missing"
        if name != "description" and (why := npy_problem(path)) is not None:
            return f"{path} {why}"
    try:
        with open(files["description"]) as f:
            if json.load(f) != description:
                return f"{files['description']} describes other data or settings"
    except (OSError, ValueError) as exc:
        return f"{files['description']} is unreadable ({exc})"
    return None


def write_cache(files: dict, arrays, description: dict) -> None:
    """Each ``(name, array)`` of ``arrays`` to a temporary name, then renamed; the description
    last (a reader needs all of them)."""
    for name, array in arrays:
        with atomic_path(files[name]) as tmp, open(tmp, "wb") as f:
            np.save(f, array)
        del array
    with atomic_path(files["description"]) as tmp, open(tmp, "w") as f:
        json.dump(description, f, sort_keys=True)


def check_enough_blocks(parts, bag_size: int, phase1_samples: int) -> None:
    """Raises ConfigError when the ``parts`` of :func:`stream_parts` hold fewer blocks of
    ``bag_size`` windows than phase 1 reads."""
    blocks = sum(n // bag_size for _, n in parts)
    if blocks < phase1_samples:
        raise ConfigError(
            f"the data gives {blocks} phase-1 samples of {bag_size} windows but phase "
            f"1 needs {phase1_samples}; add data or lower --tst-phase1-iters/--train-iters"
        )


class TrainStream:
    """Phase-1 and phase-2 training samples from one dataset of ``T``-token windows.

    The windows, in stream order (:func:`stream_parts`), are grouped into blocks of ``S``
    consecutive windows of one stream, and the blocks are shuffled once (seeded):
    - phase-1 sample ``i`` is block ``blocks[i]``: ``S`` windows concatenated, exactly
      ``S*T + 1`` contiguous tokens;
    - phase 2 reads every window that no phase-1 sample uses, each once, in a second seeded
      shuffle (``phase2``): served in block order, the ``S`` windows of a block would share a
      micro-batch, a correlated batch.
    Both orders depend only on the data, ``S``, the phase-1 sample count and ``seed``, so
    they are the same on every rank, in DataLoader workers, after a resume and whether
    computed here or mapped from a cache.

    Args:
        dataset: a megatron-core ``GPTDataset`` of ``T``-token samples (or a blend).
        bag_size: ``S`` (windows per phase-1 sample).
        phase1_samples: samples phase 1 consumes in the whole run (``N1 * global batch``).
        seed: seeds both shuffles.
        cache_dir: where the orders are cached (``--data-cache-path``); None: in memory.
        build: True: compute a missing or damaged cache and write it; False: only map it.

    Attributes:
        parts: ``[(component, order)]``, window ``j`` of a component's stream being
            ``component[order[j]]``; ``blocks``, ``phase2``: index arrays (memory-mapped when
            cached).

    Raises:
        ConfigError: fewer blocks of ``S`` windows than phase-1 samples; or, with
            ``build=False``, a missing, damaged or stale cache.
    """

    def __init__(
        self,
        dataset,
        *,
        bag_size: int,
        phase1_samples: int,
        seed: int,
        cache_dir: Optional[str] = None,
        build: bool = True,
    ):
        self.bag_size, self.phase1_samples = bag_size, phase1_samples
        parts = stream_parts(dataset)
        check_enough_blocks(parts, bag_size, phase1_samples)
        settings = dict(bag_size=bag_size, phase1_samples=phase1_samples, seed=seed)
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
        names = [n for n in self.files if n != "description"]
        return {n: np.load(self.files[n], mmap_mode="r") for n in names}

    def _set(self, arrays: dict) -> None:
        orders = [arrays[f"order{p}"] for p in range(len(self._datasets))]
        self.parts = list(zip(self._datasets, orders))
        self.offsets = np.concatenate([[0], np.cumsum([len(o) for o in orders])])
        self.blocks, self.phase2 = arrays["blocks"], arrays["phase2"]

    def __getstate__(self) -> dict:
        """A cached stream travels to DataLoader workers as its file names (they map the
        files again), not as copies of the arrays."""
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
        """``S*T``-token sample ``i`` of phase 1 (``tokens``, ``labels``, ``loss_mask`` ``[S*T]``)."""
        if i >= self.phase1_samples:
            raise IndexError(f"phase-1 sample {i} is past the {self.phase1_samples} planned")
        first = int(self.blocks[i])
        windows = [self.window(first + k) for k in range(self.bag_size)]
        return {
            key: torch.cat([w[key] for w in windows]) for key in ("tokens", "labels", "loss_mask")
        }

    def phase2_sample(self, i: int) -> dict:
        """``T``-token sample ``i`` of phase 2: the ``i``-th of the windows phase 1 left, in
        their shuffled order."""
        if i >= len(self.phase2):
            raise IndexError(
                f"phase 1 left {len(self.phase2)} windows of the data; phase-2 sample {i} is "
                "past them"
            )
        return self.window(int(self.phase2[i]))


def open_stream(dataset, *, bag_size: int, phase1_samples: int, seed: int, cache_dir, local_rank):
    """:class:`TrainStream` with its orders cached in ``cache_dir``: the ranks that build
    megatron-core's caches there compute and write them (once per directory, so once per node
    with a node-local ``--data-cache-path``), every other rank waits, then maps them. Without
    a cache directory (mock data without ``--data-cache-path``) every rank computes them.
    Must be called on every rank.

    A rank's failure in either step (a builder's full disk, a reader that cannot see the files)
    is raised on every rank, so none is left waiting for it.

    Raises:
        ConfigError: as :class:`TrainStream`, or another rank's failure (its message).
    """
    import torch.distributed as dist

    from tst_megatron.training.index_cache import is_cache_builder

    settings = dict(bag_size=bag_size, phase1_samples=phase1_samples, seed=seed)
    if cache_dir is None or not (dist.is_available() and dist.is_initialized()):
        return TrainStream(dataset, cache_dir=cache_dir, **settings)
    check_enough_blocks(stream_parts(dataset), bag_size, phase1_samples)  # before any wait
    builder = is_cache_builder(cache_dir, local_rank)
    stream = _everywhere(lambda: TrainStream(dataset, cache_dir=cache_dir, **settings), builder)
    reader = _everywhere(
        lambda: TrainStream(dataset, cache_dir=cache_dir, build=False, **settings), not builder
    )
    return stream or reader


def _everywhere(make, mine: bool):
    """``make()`` on the ranks where ``mine`` (None elsewhere); then every rank learns every
    rank's failure (``all_gather_object``, a collective: it also waits for the slowest) and
    raises the first as a ConfigError."""
    import torch.distributed as dist

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
