"""TST's sample orders cached per cache directory and memory-mapped (issue 34).

The reference is the order as it was computed in every rank's memory before the cache,
written plainly here: ``argsort`` of megatron-core's shuffle index, ``RandomState(seed)``'s
permutation of the block starts, the unused windows through a Python set, and
``default_rng([seed, 2])``'s shuffle of them.
"""

import os
import pickle

import numpy as np
import pytest

from tests.unit.test_data_boundary import write_dataset
from tests.unit.test_data_order import _datasets, index_coded_documents
from tst_megatron.data.stream import (
    TrainStream,
    build_orders,
    inverse_permutation,
    stream_parts,
)
from tst_megatron.errors import ConfigError

S, N1, SEED = 4, 50, 7


def reference_orders(dataset, bag_size, phase1_samples, seed):
    """(stream order, blocks phase 1 reads, phase2) of one ``GPTDataset`` as the in-memory
    code made them."""
    order = np.argsort(np.asarray(dataset.shuffle_index, dtype=np.int64))
    n = len(dataset)
    starts = np.arange(n // bag_size, dtype=np.int64) * bag_size
    blocks = starts[np.random.RandomState(seed).permutation(len(starts))][:phase1_samples]
    used = {int(b) + k for b in blocks[:phase1_samples] for k in range(bag_size)}
    phase2 = np.array([w for w in range(n) if w not in used], dtype=np.int64)
    np.random.default_rng([seed, 2]).shuffle(phase2)
    return order[:n], blocks, phase2


@pytest.fixture()
def train(tmp_path):
    docs, _ = index_coded_documents(800)
    return _datasets(tmp_path, write_dataset(tmp_path / "ic", docs), 1200)


def cache_names(directory):
    return sorted(n for n in os.listdir(directory) if "-TrainStream-" in n)


def test_inverse_permutation_is_argsort():
    perm = np.random.default_rng(0).permutation(10_007)
    inv = inverse_permutation(perm)
    assert inv.dtype == np.uint32 and np.array_equal(inv, np.argsort(perm))


def test_orders_built_in_small_chunks_equal_the_reference(train):
    """The builder reads the shuffle index and the phase-2 mask in chunks (16 M windows in a
    real run): a chunk of 7 windows crosses every boundary case."""
    arrays = dict(
        build_orders(
            stream_parts(train), windows_per_sample=S, phase1_samples=N1, seed=SEED, chunk=7
        )
    )
    for got, want in zip(
        (arrays["order0"], arrays["blocks"], arrays["phase2"]), reference_orders(train, S, N1, SEED)
    ):
        assert got.dtype == np.uint32 and np.array_equal(got, want)


def test_cached_orders_equal_the_in_memory_reference_and_are_mapped(train, tmp_path):
    cache = str(tmp_path / "orders")
    os.makedirs(cache)
    (ref_order, ref_blocks, ref_phase2) = reference_orders(train, S, N1, SEED)
    plain = TrainStream(train, windows_per_sample=S, phase1_samples=N1, seed=SEED)  # no cache
    first = TrainStream(train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache)
    files = cache_names(cache)
    assert len(files) == 5  # order0, blocks, phase2, checks, description
    mtimes = [os.stat(os.path.join(cache, n)).st_mtime_ns for n in files]
    second = TrainStream(train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache)
    assert [os.stat(os.path.join(cache, n)).st_mtime_ns for n in files] == mtimes  # mapped
    for stream in (plain, first, second):
        ((_, order),) = stream.parts
        assert np.array_equal(order, ref_order)
        assert np.array_equal(stream.blocks, ref_blocks)
        assert np.array_equal(stream.phase2, ref_phase2)
    assert isinstance(second.blocks, np.memmap) and isinstance(second.parts[0][1], np.memmap)
    assert not isinstance(plain.blocks, np.memmap)
    for i in (0, 17, N1 - 1):
        assert np.array_equal(second.phase1_sample(i)["tokens"], plain.phase1_sample(i)["tokens"])
    for i in (0, 33, len(ref_phase2) - 1):
        assert np.array_equal(second.phase2_sample(i)["tokens"], plain.phase2_sample(i)["tokens"])
    # a DataLoader worker gets the file names, not the arrays, and maps the same files
    assert not {"parts", "blocks", "phase2"} & set(second.__getstate__())
    assert {"parts", "blocks", "phase2"} <= set(plain.__getstate__())
    worker = pickle.loads(pickle.dumps(second))
    assert isinstance(worker.phase2, np.memmap)
    assert np.array_equal(worker.phase2_sample(5)["tokens"], plain.phase2_sample(5)["tokens"])


def test_every_setting_the_orders_depend_on_keys_its_own_cache(train, tmp_path):
    cache = str(tmp_path / "orders")
    os.makedirs(cache)
    settings = [(S, N1, SEED), (2, N1, SEED), (S, N1 + 8, SEED), (S, N1, SEED + 1)]
    for bag, n1, seed in settings:
        stream = TrainStream(
            train, windows_per_sample=bag, phase1_samples=n1, seed=seed, cache_dir=cache
        )
        _, blocks, phase2 = reference_orders(train, bag, n1, seed)
        assert np.array_equal(stream.blocks, blocks) and np.array_equal(stream.phase2, phase2)
    assert len(cache_names(cache)) == 5 * len(
        settings
    )  # order0, blocks, phase2, checks, description


@pytest.mark.parametrize("damage", ["truncate", "description"])
def test_damaged_cache_is_rebuilt_by_the_builder_and_refused_by_a_reader(
    train, tmp_path, capsys, damage
):
    cache = str(tmp_path / "orders")
    os.makedirs(cache)
    TrainStream(train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache)
    if damage == "truncate":
        victim = next(os.path.join(cache, n) for n in cache_names(cache) if "phase2" in n)
        with open(victim, "r+b") as f:
            f.truncate(os.path.getsize(victim) - 8)
        why = "truncated or corrupt"
    else:
        victim = next(os.path.join(cache, n) for n in cache_names(cache) if "description" in n)
        with open(victim, "w") as f:
            f.write('{"class": "TrainStream", "windows_per_sample": 3}')
        why = "describes other data or settings"
    with pytest.raises(ConfigError, match=f"TST sample-order cache .*{why}.*delete it") as err:
        TrainStream(
            train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache, build=False
        )
    assert "\n" not in str(err.value)
    rebuilt = TrainStream(
        train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache
    )
    assert "rebuilding it" in capsys.readouterr().out
    _, blocks, phase2 = reference_orders(train, S, N1, SEED)
    assert np.array_equal(rebuilt.blocks, blocks) and np.array_equal(rebuilt.phase2, phase2)
    again = TrainStream(train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache)
    assert np.array_equal(again.phase2, phase2) and "rebuilding" not in capsys.readouterr().out


def test_a_reader_without_the_cache_is_refused_in_one_line(train, tmp_path):
    cache = str(tmp_path / "empty")
    os.makedirs(cache)
    with pytest.raises(ConfigError, match=r"TST sample-order cache .* is missing; delete it"):
        TrainStream(
            train, windows_per_sample=S, phase1_samples=N1, seed=SEED, cache_dir=cache, build=False
        )
    assert cache_names(cache) == []
