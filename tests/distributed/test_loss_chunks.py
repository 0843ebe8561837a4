"""``--tst-loss-chunks``: a CPU training through the switch with the output layer and the loss
in chunks equals the same run without (losses, validation losses and grad norms to float32
round-off), at TP = 1 with tied embeddings (1 process), TP = 2 + sequence parallelism, PP = 2
and EP = 2 (2 gloo processes), and for a ``HybridModel``; with an MTP head (GPT and hybrid
tied, and TP = 2 + SP) its loss and its acceptance rates (TensorBoard) too; and the chunked head is the
path taken (``ChunkedOutputLayer`` deferred its logits, counted here)."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import (  # noqa: E402
    BASE,
    EP2,
    MTP,
    NO_DROPOUT,
    VALID,
    log_lines,
    pretrain_child,
    scalars,
    without,
)

KEYS = ("lm loss", "mce loss", "grad norm", "mtp_1 loss")
LINE = BASE + NO_DROPOUT
#: megatron-core's MTP acceptance rates (TensorBoard only), from the argmax of the MTP logits.
ACCEPTANCE = ("mtp_1_acceptance_rate", "mtp_1_cumulative_acceptance_rate")


def _counting_child(rank, world, *, runs, model="gpt"):
    """:func:`tests.launcher.pretrain_child`, counting the chunked head's calls per run; each
    run starts with an empty MTP logging tracker (a class attribute that Megatron-LM's
    ``destroy_global_state`` keeps)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from tst_megatron.models import seams

    real, counts = seams.chunked_output_cross_entropy, []

    def counted(*args, **kwargs):
        counts[-1] += 1
        return real(*args, **kwargs)

    seams.chunked_output_cross_entropy = counted
    printed = []
    try:
        for argv in runs:
            counts.append(0)
            MTPLossLoggingHelper.tracker.clear()
            printed += pretrain_child(rank, world, runs=[argv], model=model)
    finally:
        seams.chunked_output_cross_entropy = real
    return printed, counts


def _compare(plain: str, chunked: str, name: str, mtp: bool = False):
    a, b = log_lines(plain, KEYS), log_lines(chunked, KEYS)
    assert sorted(a) == [1, 2, 3, 4, 5, 6] and sorted(b) == sorted(a), (name, chunked[-2000:])
    assert ("mtp_1 loss" in a[6]) == mtp, (name, a[6])  # phase 2 only (the switch is at 3)
    for i in a:
        assert sorted(b[i]) == sorted(a[i]), (name, i, a[i], b[i])
        for key, value in a[i].items():
            assert b[i][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, i, key)
    va, vb = VALID.findall(plain), VALID.findall(chunked)
    assert len(va) == 2 and [i for i, _ in vb] == [i for i, _ in va], (name, vb)
    for (_, x), (_, y) in zip(va, vb):
        assert float(y) == pytest.approx(float(x), rel=1e-5), (name, x, y)


def _same_acceptance(plain_tb: str, chunked_tb: str, name: str):
    """The MTP acceptance rates megatron-core logs (phase 2: iterations 4 to 6) are the same
    numbers: the chunked head's predictions are the logits' argmax."""
    a, b = scalars(plain_tb), scalars(chunked_tb)
    for tag in ACCEPTANCE:
        assert sorted(a[tag]) == [4, 5, 6] and b[tag] == a[tag], (name, tag, a[tag], b.get(tag))


#: name -> flags added to LINE; each runs with --tst-loss-chunks 1 and 3.
TWO_PROCESSES = {
    "TP 2 + SP, MTP": ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + MTP,
    "PP 2": ["--pipeline-model-parallel-size", "2"],
    "EP 2": EP2,
}


@pytest.mark.slow
def test_chunked_head_equals_the_unchunked_run_on_two_processes(tmp_path):
    runs = [
        LINE + extra + ["--tst-loss-chunks", c, "--tensorboard-dir", str(tmp_path / f"{i}-{c}")]
        for i, extra in enumerate(TWO_PROCESSES.values())
        for c in ("1", "3")
    ]
    results = run_distributed(_counting_child, world_size=2, runs=runs)
    printed, counts = results[-1]  # the last rank prints the training log
    for i, name in enumerate(TWO_PROCESSES):
        _compare(printed[2 * i], printed[2 * i + 1], name, mtp="MTP" in name)
        assert counts[2 * i] == 0 and counts[2 * i + 1] > 0, (name, counts)
    _same_acceptance(str(tmp_path / "0-1"), str(tmp_path / "0-3"), "TP 2 + SP, MTP")


@pytest.mark.slow
def test_chunked_head_equals_the_unchunked_run_in_every_tst_mode():
    """``--tst-mode input`` (one target per position in phase 1) with power weighting, and
    ``output`` (ordinary input, S targets), one process."""
    modes = {
        "input, power": ["--tst-mode", "input", "--tst-bag-weighting", "power"],
        "output": ["--tst-mode", "output"],
    }
    runs = [LINE + extra + ["--tst-loss-chunks", c] for extra in modes.values() for c in "13"]
    ((printed, counts),) = run_distributed(_counting_child, world_size=1, runs=runs)
    for i, name in enumerate(modes):
        _compare(printed[2 * i], printed[2 * i + 1], name)
        assert counts[2 * i] == 0 and counts[2 * i + 1] > 0, (name, counts)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "hybrid"])
def test_chunked_head_equals_the_unchunked_run_with_tied_embeddings(model, tmp_path):
    """One process, TP = 1, the output layer's weight the embedding's (Megatron-LM's
    default): its gradient reaches the shared parameter. Both have an MTP head (tied too:
    both heads' weight gradients reach the embedding)."""
    tied = [w for w in LINE if w != "--untie-embeddings-and-output-weights"] + MTP
    if model == "hybrid":
        tied = without(tied, "--num-layers") + ["--hybrid-layer-pattern", "*-*-/*-"]
    runs = [tied + ["--tst-loss-chunks", c, "--tensorboard-dir", str(tmp_path / c)] for c in "14"]
    ((printed, counts),) = run_distributed(_counting_child, world_size=1, runs=runs, model=model)
    _compare(printed[0], printed[1], model, mtp=True)
    assert counts[0] == 0 and counts[1] > 0, counts
    _same_acceptance(str(tmp_path / "1"), str(tmp_path / "4"), model)


@pytest.mark.slow
def test_a_resume_with_the_flag_continues_as_the_uninterrupted_run(tmp_path):
    """Saved every iteration with ``--tst-loss-chunks 4``, resumed at 3 (the switch) with the
    flag: iterations 4 to 6 as the uninterrupted run's."""
    save = str(tmp_path / "ckpt")
    line = LINE + ["--tst-loss-chunks", "4", "--ckpt-format", "torch_dist"]
    runs = [
        line + ["--save", save, "--save-interval", "1"],
        line + ["--load", save, "--ckpt-step", "3"],
    ]
    ((printed, counts),) = run_distributed(_counting_child, world_size=1, runs=runs)
    first, resumed = log_lines(printed[0], KEYS), log_lines(printed[1], KEYS)
    assert sorted(resumed) == [4, 5, 6] and all(counts), (sorted(resumed), counts)
    for i in (4, 5, 6):
        assert resumed[i]["grad norm"] == first[i]["grad norm"], (i, resumed[i], first[i])
    assert resumed[4]["lm loss"] == first[4]["lm loss"]
    assert resumed[6]["lm loss"] == first[6]["lm loss"]
    # Megatron-LM 0.19.2's log quirk (the same without the flag): the second line after a
    # restart prints the mean of the two iterations' losses
    mean = (first[4]["lm loss"] + first[5]["lm loss"]) / 2
    assert resumed[5]["lm loss"] == pytest.approx(mean, abs=2e-6), (resumed[5], mean)
