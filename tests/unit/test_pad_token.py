"""A tokenizer's pad id in the data: megatron-core's ``GPTDataset`` replaces every
token equal to its pad id by 0 and masks its loss. A pad id that occurs in the data is refused
at start-up, one line naming the file and the flag; the dataset's cached loss mask is never
written by a sample. Hugging Face tokenizers are built here, from a BPE trained on a few
lines (no hub access)."""

import re

import numpy as np
import pytest
import torch

from tests.unit.test_data_boundary import megatron_tokenizer, null_tokenizer, write_dataset
from tst_megatron.data.gpt_datasets import (
    DataSettings,
    build_datasets,
    check_data_files,
    dataset_pad_id,
)
from tst_megatron.errors import ConfigError

CORPUS = ["the quick brown fox jumps over the lazy dog. " * 20, "def main(argv): return 0\n" * 10]
EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Hugging Face tokenizer directories over one byte-level BPE, differing in ``pad_token``:
    ``word`` (the ordinary token of " fox"), ``eos`` (= EOS), ``none``, ``special`` (a
    dedicated ``<pad>``). Returns ``{name: directory}`` and the id of " fox"."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("hf")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=300, special_tokens=[EOS])
    plain = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS)
    (fox,) = plain.encode(" fox")
    pads = {"word": plain.convert_ids_to_tokens(fox), "eos": EOS, "none": None, "special": "<pad>"}
    dirs = {}
    for name, pad in pads.items():
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOS, pad_token=pad)
        tok.save_pretrained(str(d / name))
        dirs[name] = str(d / name)
    return dirs, fox


def _tokenizer(hf, name):
    """Megatron-LM's tokenizer for ``--tokenizer-type HuggingFaceTokenizer`` on directory
    ``name`` of :func:`hf`."""
    return megatron_tokenizer(
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf[0][name]
    )


def _documents(tok, texts):
    return [list(tok.tokenize(text)) + [tok.eod] for text in texts]


def _pad_id(tok, prefix, cache, **settings):
    """:func:`dataset_pad_id` of the training dataset built on ``prefix`` with ``tok``."""
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=str(cache), **settings)
    train, _, _ = build_datasets(data, tok, seq_length=8, samples=(4, 0, 0), seed=1)
    return dataset_pad_id(train)


def test_pad_id_is_the_one_megatron_core_uses(hf, tmp_path):
    """The pad id read from megatron-core's built dataset, for each kind of tokenizer, against
    the ids worked out by hand here; ``--allow-ambiguous-pad-tokens`` keeps a pad that is also
    EOS (megatron-core then masks it)."""
    from tst_megatron.data.tokenizer import train_tokenizer

    sp = train_tokenizer(CORPUS * 20, str(tmp_path / "sp"), vocab_size=300)
    tokenizers = {name: _tokenizer(hf, name) for name in hf[0]}
    tokenizers["sentencepiece"] = megatron_tokenizer(
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp
    )
    tokenizers["null"] = null_tokenizer(64)
    prefix = write_dataset(tmp_path / "ids", [[1, 2, 3, 4, 5, 6, 7, 8, 9] * 4] * 8)
    expected = {"word": hf[1], "eos": None, "none": None, "special": 300, "sentencepiece": 3}
    for name, tok in tokenizers.items():
        assert _pad_id(tok, prefix, tmp_path / name) == expected.get(name), name
    eos = tokenizers["eos"].eod
    ambiguous = _pad_id(tokenizers["eos"], prefix, tmp_path / "a", allow_ambiguous_pad_tokens=True)
    assert ambiguous == eos  # without the flag: None (above)


def test_megatron_lm_s_data_flags_reach_megatron_core_s_dataset_config():
    """``--allow-ambiguous-pad-tokens``, ``--mid-level-dataset-surplus`` and
    ``--num-dataset-builder-threads`` parsed by Megatron-LM reach the ``GPTDatasetConfig``
    the launcher builds (defaults: Megatron-LM's)."""
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from tst_megatron.data.gpt_datasets import _dataset_config, data_settings

    parser = add_megatron_arguments(argparse.ArgumentParser())
    flags = ["--data-path", "x", "--split", "1,0,0"]
    given = ["--allow-ambiguous-pad-tokens", "--mid-level-dataset-surplus", "0.5"]
    given += ["--num-dataset-builder-threads", "3"]
    for argv, expected in ((flags, (False, 0.005, 1)), (flags + given, (True, 0.5, 3))):
        args = parser.parse_args(argv)
        config = _dataset_config(data_settings(args), null_tokenizer(64), 8, 1, (["x"], None))
        got = (
            config.allow_ambiguous_pad_tokens,
            config.mid_level_dataset_surplus,
            config.num_dataset_builder_threads,
        )
        assert got == expected


def test_data_holding_the_pad_id_is_refused_in_one_line(hf, tmp_path):
    tok = _tokenizer(hf, "word")
    fox = hf[1]
    docs = _documents(tok, ["the quick brown fox jumps", "a lazy dog", "fox, fox and the dog"])
    n = sum(doc.count(fox) for doc in docs)  # 4
    prefix = write_dataset(tmp_path / "fox", docs)
    assert _pad_id(tok, prefix, tmp_path / "c") == fox
    with pytest.raises(ConfigError) as info:
        check_data_files(prefix, tok.vocab_size, pad_id=fox)
    message = str(info.value)
    assert message.count("\n") == 0
    assert f"fox.bin holds {n} tokens of id {fox}, the pad id of --tokenizer-model" in message
    # without " fox" the same tokenizer is fine
    clean = write_dataset(tmp_path / "clean", _documents(tok, ["the lazy dog", "def main(argv)"]))
    check_data_files(clean, tok.vocab_size, pad_id=fox)
    # a pad that is EOS (megatron-core then uses none) or a dedicated token: the data passes
    for name in ("eos", "special", "none"):
        other = _tokenizer(hf, name)
        check_data_files(prefix, other.vocab_size, pad_id=_pad_id(other, prefix, tmp_path / name))
    # --allow-ambiguous-pad-tokens makes EOS the pad id, which every document holds: refused,
    # naming the flag; the "word" pad is refused with or without it
    eos = _tokenizer(hf, "eos")
    pad = _pad_id(eos, prefix, tmp_path / "flag", allow_ambiguous_pad_tokens=True)
    with pytest.raises(ConfigError, match="or drop --allow-ambiguous-pad-tokens"):
        check_data_files(prefix, eos.vocab_size, pad_id=pad, pad_flag=True)
    assert _pad_id(tok, prefix, tmp_path / "flag2", allow_ambiguous_pad_tokens=True) == fox


def test_pad_id_count_is_remembered_in_the_stamp(hf, tmp_path, monkeypatch):
    from tst_megatron.data.files import read_stamp, write_stamp

    tok = _tokenizer(hf, "word")
    fox = hf[1]
    docs = _documents(tok, ["the quick brown fox", "the dog"] * 10)
    prefix = write_dataset(tmp_path / "d", docs)
    write_stamp(prefix, 0, tok.vocab_size - 1)  # a range-only stamp: the count is not known
    with pytest.raises(ConfigError, match=f"holds 10 tokens of id {fox}"):
        check_data_files(prefix, tok.vocab_size, pad_id=fox)  # reads the .bin once
    stamp = read_stamp(prefix)
    assert stamp.counts == {fox: 10} and (stamp.min, stamp.max) == (
        min(map(min, docs)),
        max(map(max, docs)),
    )
    monkeypatch.setattr("tst_megatron.data.files.scan_token_range", lambda *a, **k: 1 / 0)
    with pytest.raises(ConfigError, match=f"holds 10 tokens of id {fox}"):
        check_data_files(prefix, tok.vocab_size, pad_id=fox)  # the stamp answers
    check_data_files(prefix, tok.vocab_size, pad_id=tok.vocab_size - 1)  # outside the range
    check_data_files(prefix, tok.vocab_size)


def test_the_cached_loss_mask_is_never_written(hf, tmp_path):
    """Data holding the pad id, read past the start-up check: each sample masks its own pad
    labels (megatron-core's rule) and nothing else; the cached mask stays all ones."""
    tok = _tokenizer(hf, "word")
    fox = hf[1]
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(40):
        doc = [int(i) for i in rng.integers(1, tok.vocab_size, rng.integers(5, 30))]
        doc = [fox if i == fox or rng.random() < 0.1 else i for i in doc]
        docs.append(doc + [tok.eod])
    prefix = write_dataset(tmp_path / "pads", docs)
    cache = str(tmp_path / "cache")
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=cache)
    train, _, _ = build_datasets(data, tok, seq_length=16, samples=(40, 0, 0), seed=1)
    texts = [
        torch.from_numpy(train._query_document_sample_shuffle_indices(i)[0]).long()
        for i in range(len(train))
    ]
    expected = [(text[1:] != fox).float() for text in texts]  # megatron-core's rule, only it
    first = next(i for i, mask in enumerate(expected) if (mask == 0).any())
    order = [first] + [i for i in range(len(train)) if i != first]  # a pad label read first
    ones = torch.ones(16)
    for i in order:
        assert torch.equal(train[i]["loss_mask"], expected[i]), i
        assert torch.equal(train.cached_loss_mask, ones), i
    masked_positions = int(sum((mask == 0).sum() for mask in expected))
    assert masked_positions > 10


@pytest.mark.slow
def test_the_launcher_stops_before_training_naming_the_flag(hf, tmp_path, run_launcher):
    """The launcher (``examples/pretrain_gpt_tst.py``, Megatron-LM's ``pretrain()``) on
    data holding the tokenizer's pad id: it stops with a line naming the file, the id and
    ``--tokenizer-model`` before any training step."""
    tok = _tokenizer(hf, "word")
    prefix = write_dataset(tmp_path / "fox", _documents(tok, ["the quick brown fox jumps"] * 30))
    argv = [
        *("--device", "cpu", "--tokenizer-type", "HuggingFaceTokenizer"),
        *("--tokenizer-model", hf[0]["word"], "--data-path", prefix, "--split", "90,10,0"),
        *("--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2"),
        *("--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1"),
        *("--global-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"),
        *("--tst-bag-size", "2", "--data-cache-path", str(tmp_path / "cache")),
        *("--eval-interval", "2", "--eval-iters", "1"),
    ]
    proc = run_launcher(*argv)
    # The check runs in the launcher's datasets provider, which pretrain() calls after
    # building the model and before the first step; the launcher's main() does not turn a
    # ConfigError raised inside pretrain() into "error:" lines (yet), so the line is looked
    # for in the whole of stderr.
    found = [line for line in proc.stderr.splitlines() if f"holds 30 tokens of id {hf[1]}" in line]
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert found and "fox.bin" in found[0] and "the pad id of --tokenizer-model" in found[0]
    assert not re.search(r"iteration\s+\d+/\s*\d+ \|", proc.stdout)  # no step was taken
