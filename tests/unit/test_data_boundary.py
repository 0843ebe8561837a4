"""The data boundary: token ids checked once at start-up (and remembered), the --split and
blend defects, and index caches that are damaged (one process). The tokenizers are the ones
Megatron-LM's launcher builds (:func:`megatron_tokenizer`)."""

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tst_megatron.data import gpt_datasets as data_mod
from tst_megatron.data.gpt_datasets import DataSettings, build_datasets, check_data_files
from tst_megatron.errors import ConfigError

VOCAB = 64


def write_dataset(prefix, documents, dtype=np.int32):
    """Megatron .bin/.idx of ``documents`` (lists of ids) through megatron-core's builder."""
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


def random_documents(n, seed=0, vocab=VOCAB):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(0, vocab - 1, rng.integers(5, 40))) + [vocab - 1] for _ in range(n)]


def megatron_tokenizer(*flags):
    """The tokenizer Megatron-LM's launcher gets for the tokenizer ``flags`` (e.g.
    ``--tokenizer-type NullTokenizer --vocab-size 64``): megatron-core's ``build_tokenizer``
    on Megatron-LM's parsed arguments, as ``set_global_variables`` builds it."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
    from megatron.training.arguments import add_megatron_arguments

    args = add_megatron_arguments(argparse.ArgumentParser()).parse_args(list(flags))
    args.rank = 0  # read by its vocabulary padding's log line
    return build_tokenizer(args)


def null_tokenizer(vocab=VOCAB):
    return megatron_tokenizer("--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab))


# --- token ids: checked at start-up, once ---------------------------------------------------


def test_negative_id_in_an_int32_bin_is_refused_naming_file_and_id(tmp_path):
    # megatron-core takes -1 for its pad id: it would be rewritten to 0 and masked, silently
    docs = random_documents(20)
    docs[7][3] = -1
    prefix = write_dataset(tmp_path / "neg", docs)
    with pytest.raises(ConfigError, match=r"neg\.bin holds token id -1, outside the vocab"):
        check_data_files(prefix, VOCAB)
    docs[7][3] = VOCAB  # one past the end, as an input or a label
    prefix = write_dataset(tmp_path / "big", docs)
    with pytest.raises(ConfigError, match=rf"big\.bin holds token id {VOCAB}, outside"):
        check_data_files(prefix, VOCAB)


def test_token_range_is_read_once_then_remembered(tmp_path, monkeypatch):
    prefix = write_dataset(tmp_path / "ok", random_documents(30))
    cache = tmp_path / "cache"
    check_data_files(prefix, VOCAB, cache_path=str(cache))  # reads the .bin, writes a stamp
    stamps = list(cache.glob("ok-*.token-range.json"))
    assert len(stamps) == 1

    def no_read(*a, **k):
        raise AssertionError("the .bin was read again")

    monkeypatch.setattr("tst_megatron.data.files.scan_token_range", no_read)
    check_data_files(prefix, VOCAB, cache_path=str(cache))  # the stamp answers
    with pytest.raises(ConfigError, match="holds token id 63, outside the vocabulary"):
        check_data_files(prefix, VOCAB - 1, cache_path=str(cache))  # same stamp, other vocab
    monkeypatch.undo()
    # the file changes: the stamp no longer matches, and the new ids are read
    docs = random_documents(30)
    docs[0][0] = -1
    write_dataset(tmp_path / "ok", docs)
    with pytest.raises(ConfigError, match="holds token id -1"):
        check_data_files(prefix, VOCAB, cache_path=str(cache))


def test_preprocess_records_the_range_so_start_up_reads_nothing(tmp_path, monkeypatch):
    from tst_megatron.data.files import TokenStats, read_stamp, write_stamp

    prefix = write_dataset(tmp_path / "pre", random_documents(10))
    write_stamp(prefix, 0, VOCAB - 1)  # what tools/preprocess_data.py does after writing
    assert read_stamp(prefix, str(tmp_path / "elsewhere")) == TokenStats(0, VOCAB - 1)
    monkeypatch.setattr("tst_megatron.data.files.scan_token_range", lambda *a, **k: 1 / 0)
    check_data_files(prefix, VOCAB, cache_path=str(tmp_path / "elsewhere"))


def test_truncated_bin_or_idx_is_named(tmp_path):
    prefix = write_dataset(tmp_path / "cut", random_documents(10))
    data = open(prefix + ".bin", "rb").read()
    open(prefix + ".bin", "wb").write(data[:-8])
    with pytest.raises(ConfigError, match=r"cut\.bin has \d+ bytes but .*cut\.idx describes"):
        check_data_files(prefix, VOCAB)
    open(prefix + ".bin", "wb").write(data)
    idx = open(prefix + ".idx", "rb").read()
    open(prefix + ".idx", "wb").write(idx[:-4])
    with pytest.raises(ConfigError, match=r"cut\.idx has \d+ bytes but its header describes"):
        check_data_files(prefix, VOCAB)


def test_mock_data_ids_lie_in_the_vocabulary():
    tok = null_tokenizer()
    data_mod.check_mock_data(tok, tok.vocab_size)  # as the launcher's datasets provider does
    train, _, _ = build_datasets(
        DataSettings(mock_data=True), tok, seq_length=32, samples=(50, 0, 0), seed=1
    )
    ids = torch.stack([torch.cat([train[i]["tokens"], train[i]["labels"]]) for i in range(50)])
    assert 0 <= int(ids.min()) and int(ids.max()) < tok.vocab_size

    class Wide:
        vocab_size, eod = VOCAB, VOCAB  # an EOD id past the table

    with pytest.raises(ConfigError, match=f"mock documents hold token id {VOCAB}, outside"):
        data_mod.check_mock_data(Wide(), VOCAB)


# --- --split and blends ----------------------------------------------------------------------


@pytest.mark.timeout(60)  # megatron-core loops forever on an empty split
def test_split_that_leaves_a_split_no_documents_is_one_line(tmp_path):
    prefix = write_dataset(tmp_path / "c", random_documents(810))
    tok = null_tokenizer()
    cache = str(tmp_path / "cache")
    data = DataSettings(data_path=prefix, split="99990,8,2", data_cache_path=cache)
    with pytest.raises(ConfigError) as err:
        build_datasets(data, tok, seq_length=16, samples=(40, 8, 0), seed=1)
    assert str(err.value) == (
        f"--split 99990,8,2 gives the validation split none of the 810 documents of {prefix} "
        "(training 810, validation 0, test 0); give it a larger share"
    )
    # an empty split asked for nothing is simply not built
    train, valid, test = build_datasets(
        DataSettings(data_path=prefix, split="99,1,0.001", data_cache_path=cache),
        tok,
        seq_length=16,
        samples=(40, 8, 0),
        seed=1,
    )
    assert len(train) >= 40 and len(valid) >= 8 and test is None


def test_weighted_blend_unquoted_and_quoted(tmp_path):
    """Megatron-LM's parser takes ``--data-path`` as words; a quoted blend is one word. Both
    give the same data settings and dataset prefixes."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from tst_megatron.data.gpt_datasets import data_prefixes, data_settings

    parser = add_megatron_arguments(argparse.ArgumentParser())
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    unquoted = data_settings(parser.parse_args(["--data-path", "0.7", a, "0.3", b]))
    quoted = data_settings(parser.parse_args(["--data-path", f"0.7 {a} 0.3 {b}"]))
    assert unquoted.data_path == quoted.data_path == f"0.7 {a} 0.3 {b}"
    assert not unquoted.mock_data and data_prefixes(quoted.data_path) == [a, b]
    assert data_settings(parser.parse_args(["--data-path", a])).data_path == a
    assert data_settings(parser.parse_args([])).mock_data  # no --data-path: mock data
    # --data-args-path: a file holding what --data-path would (Megatron-LM's
    # get_blend_and_blend_per_split); not mock data
    args_file = tmp_path / "data_args.txt"
    args_file.write_text(f"0.7 {a}\n0.3 {b}\n")
    from_file = data_settings(parser.parse_args(["--data-args-path", str(args_file)]))
    assert from_file == unquoted and not from_file.mock_data


# --- index caches ------------------------------------------------------------------------------


def test_damaged_index_cache_is_named_and_rebuilt(tmp_path, capsys):
    from tst_megatron.data.index_cache import CachedGPTDatasetConfig, npy_problem

    prefix = write_dataset(tmp_path / "d", random_documents(100))
    tok = null_tokenizer()
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=16, samples=(50, 0, 0), seed=1)
    expected = [train[i]["tokens"] for i in range(len(train))]
    files = sorted((tmp_path / "cache").glob("*.npy"))
    assert len(files) == 3 and not list((tmp_path / "cache").glob(".*tmp*"))
    victim = next(f for f in files if f.name.endswith("sample_index.npy"))
    victim.write_bytes(victim.read_bytes()[:-16])  # a crash in the middle of numpy.save
    assert "truncated or corrupt" in npy_problem(str(victim))

    train, _, _ = build_datasets(data, tok, seq_length=16, samples=(50, 0, 0), seed=1)
    assert f"dataset index cache {victim} has" in capsys.readouterr().out
    assert npy_problem(str(victim)) is None
    assert all(torch.equal(train[i]["tokens"], t) for i, t in enumerate(expected))

    # a rank that only reads says which file and what to do
    victim.write_bytes(victim.read_bytes()[:-16])
    identity = data_mod.blend_identity([prefix])  # as build_datasets keys the caches
    config = data_mod._dataset_config(data, tok, 16, 1, ([prefix], None), identity)
    assert isinstance(config, CachedGPTDatasetConfig)
    config.build_missing_cache = False
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from tst_megatron.data.index_cache import build_splits

    with pytest.raises(ConfigError, match=rf"{victim} has \d+ bytes .* delete it"):
        build_splits(GPTDataset, [50, 0, 0], config, local_rank=0, prefixes=[prefix])
