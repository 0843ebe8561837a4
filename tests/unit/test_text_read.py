"""The text a run reads (``checks/reads.py``), as the dry run prints it: tokens per phase, the
total and the ratio to a baseline of the same line, against arithmetic written here; with a
small data file, the epochs of its training split and the note when the run repeats data that
a baseline would not."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from tests.unit.test_data_boundary import write_dataset  # noqa: E402
from tests.unit.test_dry_run import SMALL, dry  # noqa: E402

#: Qwen3-235B-A22B's published line: --train-samples 268,554,688 at --seq-length 4096 (only
#: the counts matter here; a tiny model stands in).
QWEN3 = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
    "--global-batch-size", "1024", "--lr", "1e-3", "--eval-interval", "1000",
    "--train-samples", "268554688", "--lr-decay-samples", "268554688", "--num-workers", "0",
]  # fmt: skip


def _note(text: str, start: str) -> str:
    (line,) = [x for x in text.splitlines() if x.startswith(f" note: {start}")]
    return line


def test_at_s4_r03_the_run_reads_1_9x_its_baseline_s_text():
    """N = 268,554,688 // 1024 = 262,260 steps, N1 = round(0.3 N) = 78,678; phase 1 reads
    78,678 x 1024 samples of 4 x 4096 tokens, phase 2 the rest at 4096."""
    r = dry(QWEN3 + ["--tst-bag-size", "4"])
    assert r.returncode == 0, r.stderr
    n = 268_554_688 // 1024
    n1 = round(0.3 * n)
    phase1, phase2 = n1 * 1024 * 4 * 4096, (n - n1) * 1024 * 4096
    baseline = n * 1024 * 4096
    line = _note(r.stdout, "text:")
    assert line == (
        " note: text: phase 1 reads 1.32T tokens, phase 2 0.77T: 2.09T in all, "
        f"{(phase1 + phase2) / baseline:.2f}x the 1.10T a baseline of this line "
        "(--tst-bag-size 1) reads"
    ), line
    assert "1.90x" in line


def test_output_mode_and_a_baseline_read_the_baseline_s_text():
    out = _note(dry(QWEN3 + ["--tst-bag-size", "4", "--tst-mode", "output"]).stdout, "text:")
    assert "1.00x the 1.10T" in out, out
    base = _note(dry(QWEN3).stdout, "text:")
    assert base == (
        " note: text: 1.10T tokens (268,554,240 samples of 4096), as a baseline of this line "
        "(no phase 1)"
    ), base


def test_epochs_of_a_small_data_file_and_the_note_when_only_tst_repeats_it(tmp_path):
    """One file of 3,001 tokens (100 documents of 30, then one token), all of it the training
    split: (3,001 - 1) // 16 = 187 windows per epoch. 10 steps of 8 samples at T = 16, N1 = 3,
    S = 2: phase 1 reads 24 x 2 = 48 windows, phase 2 56, a baseline 80."""
    prefix = write_dataset(tmp_path / "d", [[i % 60] * 30 for i in range(100)] + [[1]])
    data = [a for a in SMALL if a != "--mock-data"] + ["--data-path", prefix, "--split", "100,0,0"]
    data += ["--device", "cpu", "--eval-iters", "0"]
    r = dry(data)
    assert r.returncode == 0, r.stderr
    per_epoch = (3_001 - 1) // 16
    e1, e2, base = 48 / per_epoch, 56 / per_epoch, 80 / per_epoch
    assert _note(r.stdout, "data:") == (
        f" note: data: this run reads {e1 + e2:.2f} epochs of the training split (phase 1 "
        f"{e1:.2f}, phase 2 {e2:.2f}); a baseline of this line reads {base:.2f}"
    )
    assert "repeats data" not in r.stdout
    # 30 steps: 9 x 8 x 2 = 144 + 21 x 8 = 168 windows = 1.67 epochs; a baseline's 240 = 1.28:
    # both repeat, so no note; 20 steps: 6 x 8 x 2 + 14 x 8 = 208 (1.11) against 160 (0.86)
    more = dry(SMALL_STEPS(data, 20))
    assert more.returncode == 0, more.stderr
    note = _note(more.stdout, "this run repeats data")
    assert f"{208 / per_epoch:.2f} epochs" in note and f"reads {160 / per_epoch:.2f}" in note
    both = dry(SMALL_STEPS(data, 30))
    assert "repeats data" not in both.stdout and f"reads {240 / per_epoch:.2f}" in both.stdout


def SMALL_STEPS(argv, steps):  # noqa: N802
    out = list(argv)
    out[out.index("--train-iters") + 1] = str(steps)
    return out


def test_a_blend_names_the_most_read_dataset(tmp_path):
    """Weights 0.8 / 0.2 over two files of the same size: the first is read four times as
    much."""
    a = write_dataset(tmp_path / "a", [[3] * 30 for _ in range(100)] + [[1]])
    b = write_dataset(tmp_path / "b", [[4] * 30 for _ in range(100)] + [[1]])
    data = [x for x in SMALL if x != "--mock-data"] + ["--split", "100,0,0", "--device", "cpu"]
    data += ["--data-path", "0.8", a, "0.2", b, "--eval-iters", "0"]
    r = dry(data)
    assert r.returncode == 0, r.stderr
    line = _note(r.stdout, "data:")
    assert f"of {a} (the most-read dataset)" in line
    assert f"reads {0.8 * 104 / 187:.2f} epochs" in line, line
