"""Caches keyed by what the data is, not where it lives: a corpus re-preprocessed in place
under the same prefix (the same documents plus new ones) with the same ``--data-cache-path``
trains on the new data, with a ``note:``; a resume on such files is one line; a copy of the
files keeps their identity."""

from __future__ import annotations

import argparse
import re
import shutil

import pytest

pytest.importorskip("megatron.core")

from tests.unit.test_data_boundary import null_tokenizer, write_dataset  # noqa: E402
from tst_megatron.data.files import data_identity  # noqa: E402
from tst_megatron.data.gpt_datasets import DataSettings, build_datasets  # noqa: E402
from tst_megatron.data.stream import TrainStream  # noqa: E402

OLD = [[(7 * d + i) % 50 for i in range(30)] + [63] for d in range(200)]  # ids < 50, EOD 63
NEW_ONLY = 55  # a token the added documents hold and the old ones do not


def _stream(prefix, cache, capsys=None):
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=cache)
    train, _, _ = build_datasets(data, null_tokenizer(), seq_length=16, samples=(200, 0, 0), seed=1)
    stream = TrainStream(train, windows_per_sample=2, phase1_samples=20, seed=3, cache_dir=cache)
    tokens = set()
    for i in range(20):
        tokens |= set(stream.phase1_sample(i)["tokens"].tolist())
    for i in range(len(stream.phase2)):
        tokens |= set(stream.phase2_sample(i)["tokens"].tolist())
    return stream, tokens


def test_data_re_preprocessed_in_place_is_trained_on_with_a_note(tmp_path, capsys):
    prefix = str(tmp_path / "corpus_text_document")
    cache = str(tmp_path / "cache")
    write_dataset(prefix, OLD)
    _, before = _stream(prefix, cache)
    assert NEW_ONLY not in before
    capsys.readouterr()
    # the same documents, then 400 new ones, preprocessed again under the same prefix
    write_dataset(prefix, OLD + [[NEW_ONLY] * 30 + [63] for _ in range(400)])
    _, after = _stream(prefix, cache)
    assert NEW_ONLY in after  # the new documents are read: the orders were built again
    out = capsys.readouterr().out
    assert out.count("note: the data of --data-path changed since the caches in") == 1, out
    _, again = _stream(prefix, cache)  # unchanged since: the caches are used, no note
    assert again == after and "changed since" not in capsys.readouterr().out


def test_a_copy_keeps_the_identity_and_a_rewrite_changes_it(tmp_path):
    a = write_dataset(tmp_path / "a", OLD)
    for suffix in (".bin", ".idx"):
        shutil.copy(a + suffix, str(tmp_path / "b") + suffix)  # a new mtime, the same bytes
    assert data_identity(a) == data_identity(str(tmp_path / "b"))
    changed = OLD[:-1] + [[(x + 1) % 50 for x in OLD[-1][:-1]] + [63]]  # the same sizes
    write_dataset(tmp_path / "b", changed)
    assert data_identity(a) != data_identity(str(tmp_path / "b"))


def test_a_resume_on_re_preprocessed_data_is_one_line(tmp_path):
    from tst_megatron.training.checks.resume import current_data_identity, data_change_problem

    prefix = write_dataset(tmp_path / "c", OLD)
    args = argparse.Namespace(mock_data=False, data_path=[prefix], data_args_path=None)
    saved = argparse.Namespace(tst_data_identity=current_data_identity(args))
    assert data_change_problem(args, saved, "the checkpoint of iteration 4") is None
    write_dataset(prefix, OLD + OLD[:10])
    line = data_change_problem(args, saved, "the checkpoint of iteration 4")
    assert line.startswith("the checkpoint of iteration 4 was trained on other data than the")
    assert "\n" not in line
    older = argparse.Namespace()  # a checkpoint written before the identity was recorded
    assert data_change_problem(args, older, "the checkpoint of iteration 4") is None


def _plant_zeros(path):
    """Replace the .npy at ``path`` by zeros of its shape and dtype (the same size and header)."""
    import numpy as np

    array = np.load(path, mmap_mode="r")
    zeros = np.zeros(array.shape, dtype=array.dtype)
    del array
    np.save(path, zeros)


def test_planted_zeros_in_the_sample_orders_are_never_trained_on(tmp_path, capsys):
    """``blocks``/``phase2`` replaced by zeros of the same shape (every sample window 0): a
    rank that builds rebuilds them (a warning naming the file), one that only reads stops in
    one line; the samples are the true ones."""
    from tst_megatron.errors import ConfigError

    prefix = write_dataset(tmp_path / "d", OLD)
    cache = str(tmp_path / "cache")
    stream, _ = _stream(prefix, cache)
    truth = [stream.phase1_sample(i)["tokens"] for i in range(20)]
    for name in ("blocks", "phase2"):
        (path,) = [p for p in (tmp_path / "cache").glob(f"*-TrainStream-{name}.npy")]
        _plant_zeros(path)
        data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=cache)
        train, _, _ = build_datasets(
            data, null_tokenizer(), seq_length=16, samples=(200, 0, 0), seed=1
        )
        settings = dict(windows_per_sample=2, phase1_samples=20, seed=3, cache_dir=cache)
        planted = f"{path} holds (other values than|values outside)"
        with pytest.raises(ConfigError, match=planted):
            TrainStream(train, build=False, **settings)
        capsys.readouterr()
        rebuilt = TrainStream(train, **settings)
        assert re.search(f"TST sample-order cache {planted}", capsys.readouterr().out)
        assert all((rebuilt.phase1_sample(i)["tokens"] == truth[i]).all() for i in range(20))


def test_planted_zeros_in_megatron_core_s_index_cache_are_rebuilt(tmp_path, capsys):
    """megatron-core trusts its own index caches by name: a shuffle index replaced by zeros of
    the same shape (every sample the first) is rebuilt here, with the samples as before."""
    prefix = write_dataset(tmp_path / "e", OLD)
    cache = tmp_path / "cache"
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=str(cache))
    train, _, _ = build_datasets(data, null_tokenizer(), seq_length=16, samples=(200, 0, 0), seed=1)
    truth = [train[i]["tokens"] for i in range(len(train))]
    (path,) = cache.glob("*-GPTDataset-train-shuffle_index.npy")
    _plant_zeros(path)
    capsys.readouterr()
    train, _, _ = build_datasets(data, null_tokenizer(), seq_length=16, samples=(200, 0, 0), seed=1)
    out = capsys.readouterr().out
    assert re.search(f"dataset index cache {path} holds (other values|values outside)", out), out
    assert all((train[i]["tokens"] == t).all() for i, t in enumerate(truth))


def test_a_stamp_does_not_survive_new_content_with_the_old_size_and_times(tmp_path):
    """The token-range stamp (which spares a start the ``.bin`` scan) matched sizes and
    modification times only: a ``.bin`` rewritten with an id outside the vocabulary, its times
    set back with ``os.utime``, kept it. Its sampled content is part of it now."""
    import os

    from tst_megatron.data.files import read_stamp, write_stamp

    prefix = write_dataset(tmp_path / "s", OLD)
    write_stamp(prefix, 0, 63)
    assert read_stamp(prefix) is not None
    stat = os.stat(prefix + ".bin")
    data = bytearray(open(prefix + ".bin", "rb").read())
    data[:4] = (10**6).to_bytes(4, "little")  # the first token: an id outside the vocabulary
    open(prefix + ".bin", "wb").write(bytes(data))
    os.utime(prefix + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(prefix + ".bin").st_size == stat.st_size
    assert read_stamp(prefix) is None
