"""Real-data tools: corpus, tokenizer, preprocessing, and the TST training stream."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sentencepiece as spm
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from tst_megatron.data.corpus import build_corpus, jsonl_documents
from tst_megatron.data.preprocess import preprocess
from tst_megatron.data.tokenizer import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """60 standard-library documents, a 512-id tokenizer, and their .bin/.idx dataset."""
    d = tmp_path_factory.mktemp("data")
    build_corpus("python-stdlib", str(d / "corpus.jsonl"), max_documents=60)
    model = train_tokenizer(
        jsonl_documents(str(d / "corpus.jsonl")), str(d / "tok"), vocab_size=512
    )
    stats = preprocess(str(d / "corpus.jsonl"), str(d / "tiny"), model, append_eod=True, workers=2)
    return d, model, stats["text"]["prefix"]


def test_corpus_is_deterministic_and_real(tmp_path):
    a = build_corpus("python-stdlib", str(tmp_path / "a.jsonl"), max_documents=25)
    b = build_corpus("python-stdlib", str(tmp_path / "b.jsonl"), max_documents=25)
    assert a == b and a["documents"] == 25
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    first = json.loads((tmp_path / "a.jsonl").read_text().splitlines()[0])["text"]
    assert "import" in first or '"""' in first  # Python source text
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_corpus_from_directory_and_jsonl(tmp_path):
    src = tmp_path / "texts"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("second")
    (src / "a.md").write_text("first")
    (src / "sub" / "c.rst").write_text("third")
    (src / "skip.bin").write_text("not text")
    (src / "empty.txt").write_text("   ")
    build_corpus(str(src), str(tmp_path / "dir.jsonl"))
    texts = [json.loads(l)["text"] for l in (tmp_path / "dir.jsonl").read_text().splitlines()]
    assert texts == ["first", "second", "third"]
    build_corpus(str(tmp_path / "dir.jsonl"), str(tmp_path / "copy.jsonl"))
    assert (tmp_path / "copy.jsonl").read_text() == (tmp_path / "dir.jsonl").read_text()


def test_corpus_reads_regular_files_inside_its_folder_only(tmp_path):
    """A symlink to a private file outside the folder, a link to /dev/zero and a file over
    the size limit are skipped and named (``tools/build_corpus.py``: one note each); a link
    that stays inside the folder is read; a CRLF file reads as text mode reads it."""
    src = tmp_path / "texts"
    src.mkdir()
    private = tmp_path / "secret.txt"
    private.write_text("PRIVATE KEY")
    private.chmod(0o600)
    (src / "a.txt").write_text("first\r\nline")
    (src / "leak.txt").symlink_to(private)
    (src / "zero.txt").symlink_to("/dev/zero")
    (src / "big.txt").write_text("x" * 2000)
    (src / "same.txt").symlink_to(src / "a.txt")
    stats = build_corpus(str(src), str(tmp_path / "out.jsonl"), max_file_bytes=1000)
    texts = [json.loads(l)["text"] for l in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert texts == ["first\nline", "first\nline"]  # a.txt, and same.txt (inside the folder)
    reasons = {os.path.basename(path): reason for path, reason in stats["skipped"]}
    assert sorted(reasons) == ["big.txt", "leak.txt", "zero.txt"], reasons
    assert reasons["leak.txt"].startswith("a link leaving") and "2,000 bytes" in reasons["big.txt"]
    assert "PRIVATE" not in (tmp_path / "out.jsonl").read_text()
    command = [sys.executable, "tools/build_corpus.py", "--source", str(src), "--output"]
    command += [str(tmp_path / "cli.jsonl"), "--max-file-bytes", "1000"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: skipped ")]
    assert len(notes) == 3 and any(f"{src / 'leak.txt'}: a link leaving" in n for n in notes)


def test_corpus_errors_write_nothing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no non-empty document"):
        build_corpus(str(tmp_path / "empty"), str(tmp_path / "out.jsonl"))
    with pytest.raises(
        ValueError,
        match="is not python-stdlib, python-site-packages, system-docs, a directory or a .jsonl",
    ):
        build_corpus(str(tmp_path / "missing"), str(tmp_path / "out.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_tokenizer_round_trip_and_special_ids(tiny):
    _, model, _ = tiny
    sp = spm.SentencePieceProcessor(model_file=model)
    assert sp.get_piece_size() == 512
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    for text in ["def f(x):\n    return x ** 2\n", "naïve café — ∑ 東京 🙂", "  two  spaces\ttab"]:
        assert sp.decode(sp.encode(text)) == text  # byte fallback: nothing is lost


def test_character_coverage_spells_rare_characters_as_bytes(tmp_path):
    # 50 distinct CJK characters, each once, beside 216k characters of code: 260 byte and
    # special pieces + ~20 common + 50 rare characters do not fit in 300 pieces at full
    # coverage; at 0.9995 the rare ones (0.02 % of the text) go to the byte fallback
    rare = "".join(chr(0x4E00 + i) for i in range(50))
    texts = ["def f(x):\n    return x + 1\n" * 8000, rare]
    with pytest.raises(ValueError, match="SentencePiece training failed"):
        train_tokenizer(texts, str(tmp_path / "full"), vocab_size=300)
    model = train_tokenizer(texts, str(tmp_path / "cov"), vocab_size=300, character_coverage=0.9995)
    sp = spm.SentencePieceProcessor(model_file=model)
    assert sp.decode(sp.encode(rare)) == rare
    assert "<0xE4>" in sp.id_to_piece(sp.encode(rare[:1]))


def test_preprocess_gives_the_exact_ids(tiny):
    d, model, prefix = tiny
    sp = spm.SentencePieceProcessor(model_file=model)
    dataset = IndexedDataset(prefix)
    docs = [json.loads(l)["text"] for l in (d / "corpus.jsonl").read_text().splitlines()]
    assert len(dataset) == len(docs) == 60
    assert dataset[0].dtype == np.uint16
    for i in (0, 17, 59):
        assert dataset[i].tolist() == sp.encode(docs[i]) + [sp.eos_id()]
    assert [p.name for p in d.iterdir() if ".tmp" in p.name] == []


def test_preprocess_errors(tmp_path, tiny):
    _, model, _ = tiny
    with pytest.raises(ValueError, match="input .* does not exist"):
        preprocess(str(tmp_path / "nope.jsonl"), str(tmp_path / "x"), model)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(ValueError, match="has no document with text in key 'text'"):
        preprocess(str(tmp_path / "blank.jsonl"), str(tmp_path / "x"), model)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.jsonl"]


def test_preprocess_counts_the_pad_id_so_start_up_reads_nothing(tiny, monkeypatch):
    """The stamp holds the SentencePiece pad id's count (never written: a control piece), so
    the start-up check of a pad-holding tokenizer needs no scan."""
    from tst_megatron.data import gpt_datasets as data_mod
    from tst_megatron.data.files import read_stamp

    _, model, prefix = tiny
    pad = spm.SentencePieceProcessor(model_file=model).pad_id()
    written = IndexedDataset(prefix)
    count = sum(int((written[i] == pad).sum()) for i in range(len(written)))
    assert (pad, count) == (3, 0)
    assert read_stamp(prefix).counts == {pad: count}
    monkeypatch.setattr("tst_megatron.data.files.scan_token_range", lambda *a, **k: 1 / 0)
    data_mod.check_data_files(prefix, 512, pad_id=pad)


def test_check_data_files(tmp_path, tiny):
    from tst_megatron.data.gpt_datasets import check_data_files

    _, _, prefix = tiny
    check_data_files(prefix, 512)
    with pytest.raises(ValueError, match=r"holds token id \d+, outside the vocabulary \[0, 100\)"):
        check_data_files(prefix, 100)
    with pytest.raises(ValueError, match="missing_text_document.bin does not exist"):
        check_data_files(str(tmp_path / "missing_text_document"), 512)
    (tmp_path / "bad.bin").write_bytes(b"\x00\x01")
    (tmp_path / "bad.idx").write_bytes(b"garbage-not-an-index")
    with pytest.raises(ValueError, match="bad.idx is not a Megatron index file"):
        check_data_files(str(tmp_path / "bad"), 512)


def _stream(tiny, bag, phase1_samples, seq_length=16):
    from tests.unit.test_data_boundary import megatron_tokenizer
    from tst_megatron.data.gpt_datasets import DataSettings, build_datasets
    from tst_megatron.data.stream import TrainStream

    d, model, prefix = tiny
    tok = megatron_tokenizer(
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model
    )
    data = DataSettings(data_path=prefix, split="100,0,0", data_cache_path=str(d / "cache"))
    train, _, _ = build_datasets(data, tok, seq_length=seq_length, samples=(400, 0, 0), seed=3)
    return train, TrainStream(train, windows_per_sample=bag, phase1_samples=phase1_samples, seed=3)


def test_phase1_and_phase2_cover_the_same_token_stream(tiny):
    bag, n1 = 4, 30
    train, stream = _stream(tiny, bag, n1)
    ((_, order),) = stream.parts
    windows = [train[int(j)] for j in order]  # stream order
    # consecutive windows continue each other: the stream is contiguous
    for a, b in zip(windows[:50], windows[1:51]):
        assert a["labels"][-1] == b["tokens"][0]
    used = []
    for i in range(n1):
        sample = stream.phase1_sample(i)
        assert sample["tokens"].shape == (bag * 16,)
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])  # S*T+1 contiguous tokens
        block = int(stream.blocks[i])
        expected = torch.cat([windows[block + k]["tokens"] for k in range(bag)])
        assert torch.equal(sample["tokens"], expected)
        used += range(block, block + bag)
    phase2 = []
    for i in range(40):
        sample = stream.phase2_sample(i)
        j = int(stream.phase2[i])
        assert torch.equal(sample["tokens"], windows[j]["tokens"])
        phase2.append(j)
    assert not set(used) & set(phase2), "phase 2 reread text phase 1 consumed"
    assert len(set(used)) == n1 * bag and len(set(phase2)) == 40


def test_stream_too_small_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="phase-1 samples of 4 windows but phase 1 needs 100000"):
        _stream(tiny, 4, 100000)


@pytest.mark.slow
def test_launcher_on_a_slice_of_the_real_corpus_workers_read_the_same_batches(tiny, tmp_path):
    """Megatron-LM's loop through the launcher on the real corpus (SentencePiece tokenizer,
    --data-path, --split) through the switch, once with --num-workers 0 and once with 2
    DataLoader workers (forked after gloo started): the same losses at every iteration, and
    the switch checkpoint."""
    from tests.distributed.harness import run_distributed
    from tests.launcher import losses as _losses
    from tests.launcher import pretrain_child_forking

    d, model, prefix = tiny
    argv = [
        "--device", "cpu", "--data-path", prefix, "--split", "95,5,0",
        "--data-cache-path", str(d / "cache"), "--tokenizer-type", "SentencePieceTokenizer",
        "--tokenizer-model", model, "--seq-length", "32", "--max-position-embeddings", "32",
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "6",
        "--tst-bag-size", "4", "--tst-phase1-iters", "3", "--eval-interval", "3",
        "--eval-iters", "1", "--lr", "3e-3", "--log-interval", "1", "--seed", "1234",
    ]  # fmt: skip
    save = str(tmp_path / "ckpt")
    runs = [
        argv + ["--num-workers", "0"],
        argv + ["--num-workers", "2", "--save", save, "--save-interval", "100"],
    ]
    ((plain, workers),) = run_distributed(pretrain_child_forking, 1, runs=runs)
    train_0, valid_0 = _losses(plain)
    train_2, valid_2 = _losses(workers)
    assert sorted(train_0) == list(range(1, 7)), plain[-3000:]
    assert train_2 == train_0 and valid_2 == valid_0 and sorted(valid_0) == [3, 6]
    assert all(np.isfinite(float(v)) for v in train_0.values())
    assert os.path.isdir(os.path.join(save, "iter_0000003"))  # the switch checkpoint
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "6"


def test_tools_are_thin_command_lines(tmp_path):
    env = dict(os.environ, PYTHONWARNINGS="ignore")

    def run(*a):
        return subprocess.run(
            [sys.executable, *a], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
        )

    r = run("tools/build_corpus.py", "--output", str(tmp_path / "c.jsonl"), "--max-documents", "5")
    assert r.returncode == 0 and "wrote 5 documents" in r.stdout, r.stderr
    r = run(
        "tools/preprocess_data.py",
        "--input",
        str(tmp_path / "c.jsonl"),
        "--output-prefix",
        str(tmp_path / "x"),
        "--tokenizer-model",
        str(tmp_path / "missing.model"),
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "error: tokenizer model"
    )


def test_loss_plot_marks_the_switch(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from tst_megatron.plots import plot_losses, read_scalars, switch_iteration, validation_tag

    writer = SummaryWriter(str(tmp_path / "tb"))
    for i in range(1, 11):
        writer.add_scalar("tst-phase", 1 if i <= 4 else 2, i)
        writer.add_scalar("mce loss" if i <= 4 else "lm loss", 5.0 - 0.1 * i, i)
    writer.add_scalar("validation lm loss", 4.5, 5)
    writer.close()
    assert switch_iteration(read_scalars(str(tmp_path / "tb"))["tst-phase"]) == 4
    out = plot_losses(str(tmp_path / "tb"), str(tmp_path / "loss.png"))
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert switch_iteration([(1, 2.0), (2, 2.0)]) is None  # a baseline run has no switch
    assert validation_tag({"lm loss validation": [(5, 4.5)], "lm loss": []}) == (
        "lm loss validation"  # Megatron-LM's loop writes "<key> validation"
    )
    assert validation_tag({"lm loss": []}) is None
    with pytest.raises(ValueError, match="is not a directory of TensorBoard events"):
        plot_losses(str(tmp_path / "nothing"), str(tmp_path / "x.png"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no training loss"):
        plot_losses(str(tmp_path / "empty"), str(tmp_path / "x.png"))


def test_preprocess_streams_its_input(tiny, tmp_path):
    """The main process's Python allocations peak at about the same size for an input 8 times
    larger (the whole input used to be read into a list first): ``tracemalloc``, 1 worker.
    ``docs/results/preprocess.md`` measures the process at 100 and 400 MB."""
    import tracemalloc

    from tst_megatron.data import preprocess as module

    d, model, _ = tiny
    line = json.dumps({"text": "def f(x):\n    return x + 1  # " + "y " * 1000}) + "\n"
    peaks = []
    for copies in (500, 4000):
        path = tmp_path / f"in{copies}.jsonl"
        path.write_text(line * copies)
        tracemalloc.start()
        module.preprocess(str(path), str(tmp_path / f"out{copies}"), model, workers=1)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    size_small, size_large = 500 * len(line), 4000 * len(line)
    # what grows is megatron-core's builder's per-document lists, not the input's bytes
    assert peaks[1] - peaks[0] < (size_large - size_small) / 4, (peaks, size_large)
