"""The committed MoE reports rebuild byte for byte from their kept arm files
(``docs/results/moe_arms*``) with ``--report-only``, by the command each report names; and
the corpus record that lets them rebuild where the corpus is gone."""

import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import types

import pytest

from tests.launcher import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from study.definitions import Corpus, Run  # noqa: E402
from study.runner import CORPUS_FILE, horizons_corpus, prepare_data, run_arm  # noqa: E402
from tst_vs_baseline import parse  # noqa: E402

RESULTS = os.path.join(ROOT, "docs", "results")
REPORTS = {"tst_moe": "moe_arms", "tst_moe_prose": "moe_arms_prose"}
"""Each rebuilt report and the folder of its kept arm files."""


def _args(tmp_path, split="99,1,0"):
    return types.SimpleNamespace(work_dir=str(tmp_path / "work"), split=split, node_rank=0)


def test_report_only_reads_the_corpus_record_where_the_corpus_is_gone(tmp_path):
    args = _args(tmp_path)
    with pytest.raises(SystemExit, match="no dataset .* and no .*corpus.json"):
        horizons_corpus(args, str(tmp_path / "gone_text_document"), "gone")
    (tmp_path / "work").mkdir()
    record = {"digest": "abcd", "split": "99,1,0", "train_tokens": 10, "valid_tokens": 2}
    (tmp_path / "work" / CORPUS_FILE).write_text(json.dumps(record))
    corpus = horizons_corpus(args, str(tmp_path / "gone_text_document"), "gone")
    assert (corpus.digest, corpus.train_tokens, corpus.valid_tokens) == ("abcd", 10, 2)
    with pytest.raises(SystemExit, match="of --split 99,1,0, not 98,2,0"):
        horizons_corpus(_args(tmp_path, "98,2,0"), str(tmp_path / "gone_text_document"), "g")


def _dataset(tmp_path, lengths) -> str:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "c_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for n in lengths:
        builder.add_document(np.arange(n, dtype=np.int32), [n])
    builder.finalize(prefix + ".idx")
    return prefix


def test_a_given_data_path_gets_its_digest_and_split_sizes(tmp_path):
    prefix = _dataset(tmp_path, [5, 7, 11, 13] * 25)  # 98,2,0: the last 2 of 100 documents
    base = ["--horizons", "600", "--data-path", prefix, "--work-dir", str(tmp_path / "w")]
    corpus = prepare_data(parse(base))
    assert corpus.prefix == prefix and len(corpus.digest) == 16
    assert (corpus.train_tokens, corpus.valid_tokens) == (36 * 24 + 5 + 7, 11 + 13)
    assert json.loads((tmp_path / "w" / CORPUS_FILE).read_text())["digest"] == corpus.digest
    other = parse(["--horizons", "600", "--data-path", prefix, "--work-dir", str(tmp_path / "x")])
    assert prepare_data(other, record=False) == corpus  # a borrower writes no record
    assert not (tmp_path / "x").exists()
    report_only = parse([*base[:-1], str(tmp_path / "y"), "--report-only"])
    assert prepare_data(report_only) == corpus and not (tmp_path / "y").exists()


def test_the_corpus_record_is_written_from_the_dataset(tmp_path):
    prefix = _dataset(tmp_path, [5, 7, 11, 13])  # split 50,50,0: documents 0-1 train, 2-3 valid
    corpus = horizons_corpus(_args(tmp_path, "50,50,0"), prefix, "c")
    assert (corpus.train_tokens, corpus.valid_tokens) == (12, 24) and len(corpus.digest) == 16
    record = json.loads((tmp_path / "work" / CORPUS_FILE).read_text())
    assert record == {
        "digest": corpus.digest,
        "split": "50,50,0",
        "train_tokens": 12,
        "valid_tokens": 24,
    }


def test_keep_arms_copies_each_arm_and_refuses_another_corpus(tmp_path):
    work, kept = tmp_path / "work", tmp_path / "kept"
    arm = {"name": "h8-seed1-x", "valid": [[8, 2.5]], "corpus_digest": "abcd"}
    (work / "h8-seed1-x").mkdir(parents=True)
    (work / "h8-seed1-x" / "arm.json").write_text(json.dumps(arm))
    args = types.SimpleNamespace(
        work_dir=str(work), keep_arms=str(kept), reuse=True, report_only=True, node_rank=0
    )
    corpus = Corpus("c", "c", digest="abcd")
    assert run_arm(args, "h8-seed1-x", [], Run(8, 1, 1), corpus) == arm  # read back, kept
    copy = kept / "h8-seed1-x.json.gz"
    first = copy.read_bytes()
    assert json.loads(gzip.decompress(first)) == arm
    copy.unlink()
    run_arm(args, "h8-seed1-x", [], Run(8, 1, 1), corpus)
    assert copy.read_bytes() == first  # no timestamp: the same arm, the same bytes
    record = {"digest": "ffff", "split": "50,50,0", "train_tokens": 1, "valid_tokens": 1}
    (kept / CORPUS_FILE).write_text(json.dumps(record))
    prefix = _dataset(tmp_path, [5, 7])
    args = types.SimpleNamespace(
        work_dir=str(work), keep_arms=str(kept), split="50,50,0", node_rank=0
    )
    with pytest.raises(SystemExit, match="records corpus ffff .*; this run's is [0-9a-f]{16}"):
        horizons_corpus(args, prefix, "c")


@pytest.mark.slow
@pytest.mark.parametrize("report", sorted(REPORTS))
def test_a_moe_report_rebuilds_from_its_arm_files(report, tmp_path):
    """The report's own command (its footer) with ``--output-dir`` added, run where only the
    kept arm files and corpus record are: the same text, byte for byte."""
    with open(os.path.join(RESULTS, report + ".md")) as f:
        text = f.read()
    (footer,) = [x for x in text.splitlines() if x.startswith("Written from the recorded arm")]
    argv = shlex.split(footer.split("`.venv/bin/python ")[1].split("`;")[0])
    assert argv[0] == "benchmarks/tst_vs_baseline.py" and "--report-only" in argv
    work = argv[argv.index("--work-dir") + 1]
    assert not os.path.isabs(work), "the footer's --work-dir must be relative to rebuild"
    kept = os.path.join(RESULTS, REPORTS[report])
    for name in os.listdir(kept):
        if name.endswith(".json.gz"):
            arm = tmp_path / work / name[: -len(".json.gz")]
            arm.mkdir(parents=True)
            with gzip.open(os.path.join(kept, name)) as f:
                (arm / "arm.json").write_bytes(f.read())
    shutil.copy(os.path.join(kept, CORPUS_FILE), tmp_path / work / CORPUS_FILE)
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(os.path.join(RESULTS, "tst_moe_cost.md"), out)  # the report links it
    command = [sys.executable, os.path.join(ROOT, argv[0]), *argv[1:], "--output-dir", str(out)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rebuilt = (out / (report + ".md")).read_text().replace(f" --output-dir {out}", "")
    assert rebuilt == text
