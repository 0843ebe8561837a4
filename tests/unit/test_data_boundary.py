"""The data boundary: token ids checked once at start-up (and remembered), the --split and
blend defects, index caches that are damaged, and DataLoader workers (one process)."""

import os

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from tests.defaults import TEST_DEFAULTS
from tst_megatron.errors import ConfigError
from tst_megatron.training import data as data_mod
from tst_megatron.training.config import DataArgs, parse_args
from tst_megatron.training.data import (
    BatchLayout,
    TrainStream,
    build_datasets,
    build_tokenizer,
    check_data_files,
    microbatches,
)

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

    monkeypatch.setattr(data_mod, "scan_token_range", no_read)
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
    monkeypatch.setattr(data_mod, "scan_token_range", lambda *a, **k: 1 / 0)
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
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data_mod.check_mock_data(tok, VOCAB)
    train, _, _ = build_datasets(
        DataArgs(mock_data=True), tok, seq_length=32, samples=(50, 0, 0), seed=1
    )
    ids = torch.stack([torch.cat([train[i]["tokens"], train[i]["labels"]]) for i in range(50)])
    assert 0 <= int(ids.min()) and int(ids.max()) < VOCAB

    class Wide:
        vocab_size, eod = VOCAB, VOCAB  # an EOD id past the table

    with pytest.raises(ConfigError, match=f"mock documents hold token id {VOCAB}, outside"):
        data_mod.check_mock_data(Wide(), VOCAB)


# --- --split and blends ----------------------------------------------------------------------


@pytest.mark.timeout(60)  # megatron-core loops forever on an empty split
def test_split_that_leaves_a_split_no_documents_is_one_line(tmp_path):
    prefix = write_dataset(tmp_path / "c", random_documents(810))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=prefix, split="99990,8,2", data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as err:
        build_datasets(data, tok, seq_length=16, samples=(40, 8, 0), seed=1)
    assert str(err.value) == (
        f"--split 99990,8,2 gives the validation split none of the 810 documents of {prefix} "
        "(training 810, validation 0, test 0); give it a larger share"
    )
    # an empty split asked for nothing is simply not built
    train, valid, test = build_datasets(
        DataArgs(data_path=prefix, split="99,1,0.001", data_cache_path=str(tmp_path / "cache")),
        tok,
        seq_length=16,
        samples=(40, 8, 0),
        seed=1,
    )
    assert len(train) >= 40 and len(valid) >= 8 and test is None


def test_weighted_blend_unquoted_and_quoted(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    base = ["--mock-data", "--train-iters", "4", "--vocab-size", str(VOCAB)]
    unquoted = parse_args([*base, "--data-path", "0.7", a, "0.3", b])
    quoted = parse_args([*base, "--data-path", f"0.7 {a} 0.3 {b}"])
    assert unquoted.data.data_path == quoted.data.data_path == f"0.7 {a} 0.3 {b}"
    assert parse_args([*base, "--data-path", a]).data.data_path == a


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """torch.distributed initialised as the trainer has it (1 gloo process), then torn down."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_weighted_blend_samples_are_batched(tmp_path, gloo_world_of_one):
    a = write_dataset(tmp_path / "a", random_documents(60, seed=1))
    b = write_dataset(tmp_path / "b", random_documents(60, seed=2))
    quoted = parse_args(["--mock-data", "--vocab-size", "64", "--data-path", f"0.7 {a} 0.3 {b}"])
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=quoted.data.data_path, split="90,10,0", data_cache_path=str(tmp_path))
    train, valid, _ = build_datasets(data, tok, seq_length=8, samples=(64, 8, 0), seed=1)
    assert "dataset_id" in valid[0]  # megatron-core's blend adds a numpy.int16 to each sample
    layout = BatchLayout(2, 1, 0, 2)
    (batch, _) = microbatches(valid.__getitem__, layout, step=0, device=torch.device("cpu"))
    assert batch["tokens"].shape == (2, 8) and "dataset_id" not in batch
    stream = TrainStream(train, bag_size=2, phase1_samples=8, seed=1)
    for phase in (1, 2):
        batches = stream.batches(phase, 0, layout, device=torch.device("cpu"))
        assert batches[0]["tokens"].shape == (2, 8 * (2 if phase == 1 else 1))


# --- index caches ------------------------------------------------------------------------------


def test_damaged_index_cache_is_named_and_rebuilt(tmp_path, capsys):
    from tst_megatron.training.index_cache import CachedGPTDatasetConfig, npy_problem

    prefix = write_dataset(tmp_path / "d", random_documents(100))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
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
    config = data_mod._dataset_config(data, tok, 16, 1, ([prefix], None))
    assert isinstance(config, CachedGPTDatasetConfig)
    config.build_missing_cache = False
    from megatron.core.datasets.gpt_dataset import GPTDataset

    from tst_megatron.training.index_cache import build_splits

    with pytest.raises(ConfigError, match=rf"{victim} has \d+ bytes .* delete it"):
        build_splits(GPTDataset, [50, 0, 0], config, local_rank=0, prefixes=[prefix])


# --- --num-workers --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [BatchLayout(2, 1, 0, 3), BatchLayout(1, 2, 1, 2)])
def test_workers_give_the_same_batches_in_the_same_order(tmp_path, layout):
    prefix = write_dataset(tmp_path / "w", random_documents(200))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=8, samples=(300, 0, 0), seed=1)
    cpu = torch.device("cpu")

    def read(num_workers, start):
        stream = TrainStream(train, bag_size=2, phase1_samples=24, seed=5, num_workers=num_workers)
        steps = [(1, s) for s in range(start, 4)] + [(2, s) for s in range(0, 5)]
        # as the trainer reads: phases bound to stream.samples(phase), read with read_step
        return [data_mod.read_step(stream.samples(p), layout, step=s, device=cpu) for p, s in steps]

    for start in (0, 2):  # a fresh run and a resumed one
        plain, workers = read(0, start), read(2, start)
        assert len(plain) == len(workers) == 9 - start
        for a, b in zip(plain, workers):
            assert len(a) == len(b) == layout.num_microbatches
            for x, y in zip(a, b):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    # the reference: the stream's own samples in megatron-core's sampler order
    stream = TrainStream(train, bag_size=2, phase1_samples=24, seed=5, num_workers=2)
    batches = stream.batches(1, 1, layout, device=cpu)
    ref = list(microbatches(stream.phase1_sample, layout, step=1, device=cpu))
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(batches, ref))


def test_workers_report_running_out_of_data(tmp_path):
    prefix = write_dataset(tmp_path / "s", random_documents(30))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=8, samples=(40, 0, 0), seed=1)
    for workers in (0, 2):
        stream = TrainStream(train, bag_size=2, phase1_samples=4, seed=5, num_workers=workers)
        layout = BatchLayout(2, 1, 0, 1)
        with pytest.raises(IndexError, match="phase-1 sample 4 is past the 4 planned"):
            for step in range(3):
                stream.batches(1, step, layout, device=torch.device("cpu"))


def test_num_workers_is_accepted(tmp_path):
    from tst_megatron.training.config import validate

    cfg = parse_args(
        [
            *TEST_DEFAULTS,
            "--mock-data",
            "--vocab-size",
            "64",
            "--train-iters",
            "4",
            "--num-workers",
            "2",
        ]
    )
    validate(cfg, 1, "cpu")
    assert cfg.data.num_workers == 2
    bad = parse_args(
        [
            *TEST_DEFAULTS,
            "--mock-data",
            "--vocab-size",
            "64",
            "--train-iters",
            "4",
            "--num-workers",
            "-1",
        ]
    )
    with pytest.raises(ConfigError, match="--num-workers must be >= 0"):
        validate(bad, 1, "cpu")


def test_workers_outlive_a_sigterm_sent_to_the_whole_job_step(tmp_path):
    # Slurm signals every process of a step; --exit-signal-handler must still get its batches
    import signal
    import time

    import psutil

    prefix = write_dataset(tmp_path / "t", random_documents(200))
    tok = build_tokenizer("NullTokenizer", vocab_size=VOCAB, model=None)
    data = DataArgs(data_path=prefix, split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=8, samples=(300, 0, 0), seed=1)
    layout, cpu = BatchLayout(2, 1, 0, 2), torch.device("cpu")
    plain = TrainStream(train, bag_size=2, phase1_samples=40, seed=5)
    before = {p.pid for p in psutil.Process().children()}
    stream = TrainStream(train, bag_size=2, phase1_samples=40, seed=5, num_workers=2)
    stream.batches(1, 0, layout, device=cpu)
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
    time.sleep(0.5)
    for step in range(1, 6):
        got = stream.batches(1, step, layout, device=cpu)
        ref = plain.batches(1, step, layout, device=cpu)
        assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, ref))
    stream.close()  # then they end (as they do at exit, before multiprocessing joins them)
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert alive == []
