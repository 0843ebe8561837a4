"""megatron-core's dataset index caches, built once per node and written atomically.

Upstream (megatron-core 0.19) only global rank 0 builds a missing cache, writing in place: a
node-local ``--data-cache-path`` gives ``FileNotFoundError`` elsewhere, and a reader can map a
half-written file ("mmap length is greater than file size"). Here, through megatron-core's
seams: :func:`is_cache_builder` picks one builder per directory, :func:`build_splits` builds
then reads, and the dataset subclasses compute in memory and rename temporary files.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import uuid
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.datasets import blended_dataset, gpt_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

from tst_megatron.data import array_check
from tst_megatron.data.files import atomic_path
from tst_megatron.errors import ConfigError


class _NoCacheNotice(logging.Filter):
    """Drops megatron-core's "not saved" warning: :meth:`_AtomicIndexCache._build_or_load`
    saves them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because path_to_cache is None" not in record.getMessage()


for _module in (gpt_dataset, blended_dataset):
    _module.logger.addFilter(_NoCacheNotice())


def npy_problem(path: str) -> Optional[str]:
    """Why the ``.npy`` file ``path`` cannot be mapped (bad header, or a size other than its
    header's), or None. Reads the header only."""
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(f)
            else:
                shape, _, dtype = np.lib.format.read_array_header_2_0(f)
            header = f.tell()
    except (OSError, ValueError) as exc:
        return f"is not a readable .npy file ({exc})"
    if dtype.hasobject:
        return None
    expected = header + int(np.prod(shape)) * dtype.itemsize
    size = os.path.getsize(path)
    if size != expected:
        return f"has {size} bytes but its header describes {expected} (truncated or corrupt)"
    return None


def _content_problems(arrays: list[str], checks: str) -> list[tuple[str, str]]:
    """``[(path, why)]`` for the first cached array whose content is not the one recorded in
    ``checks`` when it was built (:func:`~tst_megatron.data.array_check.problem`; a missing
    record counts: megatron-core itself, or an older version, built it)."""
    try:
        with open(checks) as f:
            records = json.load(f)
    except (OSError, ValueError):
        records = {}
    for path in arrays:
        try:
            array = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as exc:  # an object array: not one megatron-core writes here
            return [(path, f"is not a numeric array ({exc})")]
        if (why := array_check.problem(array, records.get(os.path.basename(path)))) is not None:
            return [(path, why)]
    return []


@dataclasses.dataclass
class CachedGPTDatasetConfig(GPTDatasetConfig):
    """megatron-core's ``GPTDatasetConfig`` plus who may write a missing index cache."""

    build_missing_cache: bool = True
    """True: compute and write a missing or damaged cache. False: only read; a missing file
    is an error."""

    data_identity: str = ""
    """What the data files are (:func:`~tst_megatron.data.files.data_identity` of each prefix,
    combined): part of every real dataset's cache key (:meth:`GPTDataset._key_config_attributes`),
    so data re-preprocessed under the same prefix gets new index caches and sample orders."""


class _AtomicIndexCache:
    """Mixin over a megatron-core dataset with cache files ``<hash>-<class>-<split>-<affix>``;
    subclasses define ``_split_name``."""

    _affixes: tuple = ()
    """The ``.npy`` files of the cache (besides ``description.txt``)."""

    def _cache_dir(self) -> Optional[str]:
        return self.config.path_to_cache

    def _cache_paths(self, directory: str) -> list[str]:
        """``[description.txt, *arrays]`` as megatron-core names them."""
        base = f"{self.unique_description_hash}-{type(self).__name__}-{self._split_name()}"
        affixes = ("description.txt", *self._affixes)
        return [os.path.join(directory, f"{base}-{a}") for a in affixes]

    def _build_or_load(self, build: Callable[[], tuple]) -> tuple:
        """Wraps megatron-core's ``build()``: it loads sound files; else the arrays are
        computed in memory and written atomically here."""
        directory = self._cache_dir()
        if not directory:
            return build()
        description, *arrays = self._cache_paths(directory)
        checks = description.replace("-description.txt", "-tst_checks.json")
        if all(map(os.path.isfile, [description, *arrays])):
            damaged = [(p, why) for p in arrays if (why := npy_problem(p)) is not None]
            damaged = damaged or _content_problems(arrays, checks)
            if not damaged:
                return build()  # megatron-core maps the files
            path, why = damaged[0]
            if not self.config.build_missing_cache:
                raise ConfigError(
                    f"dataset index cache {path} {why}; delete it (or the whole "
                    "--data-cache-path directory) and restart to rebuild it"
                )
            print(f" warning: dataset index cache {path} {why}; rebuilding it", flush=True)
        elif not self.config.build_missing_cache:
            missing = next(p for p in [description, *arrays] if not os.path.isfile(p))
            raise RuntimeError(f"dataset index cache {missing} was not built by this node")
        original = self.config
        self.config = copy.copy(original)
        self.config.path_to_cache = ""  # megatron-core then computes in memory, writes nothing
        try:
            result = build()
        finally:
            self.config = original
        os.makedirs(directory, exist_ok=True)
        records = {}
        for path, array in zip(arrays, result):
            records[os.path.basename(path)] = array_check.summary(np.asarray(array))
            with atomic_path(path) as tmp, open(tmp, "wb") as f:
                np.save(f, array, allow_pickle=True)
        with atomic_path(checks) as tmp, open(tmp, "w") as f:
            json.dump(records, f, sort_keys=True)
        with atomic_path(description) as tmp, open(tmp, "w") as f:
            f.write(self.unique_description)  # last: megatron-core needs all files for a hit
        return result


class _MaskCacheFilled:
    """Mixin over megatron-core's ``GPTDataset`` that fills its mask cache at construction.

    Workaround: megatron-core 0.19's ``GPTDataset.__getitem__`` caches the first sample's loss
    mask and zeroes it at that sample's pad labels, so every later sample loses those positions.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.masks_and_position_ids_are_cacheable:
            tokens = torch.zeros(self.config.sequence_length, dtype=torch.long)  # not read
            masks = gpt_dataset._get_ltor_masks_and_position_ids(
                tokens,
                self.config.tokenizer.eod,
                self.config.reset_position_ids,
                self.config.reset_attention_mask,
                self.config.eod_mask_loss,
                self.config.create_attention_mask,
            )
            self.cached_attention_mask, self.cached_loss_mask, self.cached_position_ids = masks
            self.masks_and_position_ids_are_cached = True


# megatron-core's class names are kept: they enter the cache file names and hash.


class GPTDataset(_AtomicIndexCache, _MaskCacheFilled, gpt_dataset.GPTDataset):
    """megatron-core's ``GPTDataset`` with per-node atomic index caches and a prefilled mask
    cache."""

    _affixes = ("document_index.npy", "sample_index.npy", "shuffle_index.npy")

    @staticmethod
    def _key_config_attributes() -> list[str]:
        """megatron-core's key attributes plus the data's identity: megatron-core keys its
        caches by the data's path, so a corpus re-preprocessed in place reused the old
        orders (and a different one crashed in ``__getitem__``)."""
        return gpt_dataset.GPTDataset._key_config_attributes() + ["data_identity"]

    def _split_name(self) -> str:
        return self.index_split.name

    def _cache_dir(self) -> Optional[str]:
        if self.config.path_to_cache is None and not self.config.mock:  # upstream's default
            return os.path.join(self.dataset.path_prefix, "cache", f"{type(self).__name__}_indices")
        return self.config.path_to_cache

    def _build_document_sample_shuffle_indices(self):
        return self._build_or_load(super()._build_document_sample_shuffle_indices)


class MockGPTDataset(_AtomicIndexCache, _MaskCacheFilled, gpt_dataset.MockGPTDataset):
    """megatron-core's ``MockGPTDataset`` with the same cache handling as :class:`GPTDataset`."""

    _affixes = GPTDataset._affixes
    _split_name = GPTDataset._split_name
    _cache_dir = GPTDataset._cache_dir

    def _build_document_sample_shuffle_indices(self):
        return self._build_or_load(super()._build_document_sample_shuffle_indices)


class BlendedDataset(_AtomicIndexCache, blended_dataset.BlendedDataset):
    """megatron-core's ``BlendedDataset`` with the same cache handling as :class:`GPTDataset`."""

    _affixes = ("dataset_index.npy", "dataset_sample_index.npy")

    def _split_name(self) -> str:
        return self.split.name

    def _build_indices(self):
        return self._build_or_load(super()._build_indices)


class _Builder(BlendedMegatronDatasetBuilder):
    """megatron-core's builder, building blends with :class:`BlendedDataset`."""

    @staticmethod
    def build_generic_dataset(cls, is_built_on_rank, synchronize_ranks, *args):
        if cls is blended_dataset.BlendedDataset:
            cls = BlendedDataset
        return BlendedMegatronDatasetBuilder.build_generic_dataset(
            cls, is_built_on_rank, synchronize_ranks, *args
        )


def cache_dir_of(path_to_cache: Optional[str], prefixes: Optional[list]) -> Optional[str]:
    """``--data-cache-path``, else megatron-core's default under the first prefix, else None
    (mock data: nothing cached)."""
    if path_to_cache:
        return path_to_cache
    if not prefixes:
        return None
    return os.path.join(prefixes[0], "cache", "GPTDataset_indices")


def is_cache_builder(directory: str, local_rank: int) -> bool:
    """Whether this rank builds the index caches of ``directory`` (call on every rank): global
    rank 0, and local rank 0 of each node that cannot see rank 0's marker file there.

    Raises:
        ConfigError: the directory cannot be created or written.
    """
    rank = dist.get_rank()
    box = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)

    def marker(r: int) -> str:
        return os.path.join(directory, f".probe-{box[0]}-{r}")

    try:
        if local_rank == 0:
            os.makedirs(directory, exist_ok=True)
            open(marker(rank), "w").close()
    except OSError as exc:
        raise ConfigError(f"--data-cache-path: cannot write to {directory} ({exc})") from None
    dist.barrier()
    sees_rank0 = os.path.exists(marker(0))
    dist.barrier()
    if local_rank == 0:
        os.remove(marker(rank))
    return rank == 0 or (local_rank == 0 and not sees_rank0)


def build_splits(cls, sizes: list, config, *, local_rank: int, prefixes=None) -> list:
    """``[train, valid, test]`` from ``BlendedMegatronDatasetBuilder(cls, sizes, ...,
    config).build()``, built by the :func:`is_cache_builder` ranks, then read by the others.

    ``cls``: megatron-core's ``GPTDataset`` or ``MockGPTDataset``; ``config``: a
    :class:`CachedGPTDatasetConfig`; ``prefixes``: for the default cache directory. Call on
    every rank.
    """
    cls = {gpt_dataset.GPTDataset: GPTDataset, gpt_dataset.MockGPTDataset: MockGPTDataset}[cls]
    directory = cache_dir_of(config.path_to_cache, None if config.mock else prefixes)
    if not (dist.is_available() and dist.is_initialized()) or directory is None:
        return _Builder(cls, sizes, lambda: True, config).build()
    builder = is_cache_builder(directory, local_rank)
    first = copy.copy(config)
    first.build_missing_cache = True
    second = copy.copy(config)
    second.build_missing_cache = False
    built = _Builder(cls, sizes, lambda: builder, first).build()
    read = _Builder(cls, sizes, lambda: not builder, second).build()
    return built if builder else read
