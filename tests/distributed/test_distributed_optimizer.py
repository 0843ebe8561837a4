"""megatron-core's distributed optimizer with overlapped gradient reduce-scatter and parameter
all-gather (``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather``, the
setting of every published MoE recipe) on 2 CPU processes, through the TST switch: equal to
Megatron-LM's plain optimizer (1 process; with EP=2, 2 processes).

Two things are checked that only this setting reaches. Phase 1's bag embedding reads the
word-embedding weight without calling its module, and a model with MTP skips its MTP block
in phase 1; megatron-core's DDP waits for a module's all-gathered parameters in that module's
forward pre-hook, so both run the hooks themselves. Without the first, phase 1 read stale
embedding weights (the loss differed from iteration 2 on); without the second, an MTP bucket
kept its all-gather in flight (an ``AssertionError`` at the next step). Small DDP buckets
(``--ddp-bucket-size``) put MTP parameters in buckets of their own.
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import BASE, DIST_OPT, EP2, MTP, NO_DROPOUT, log_lines, pretrain_child  # noqa: E402

_KEYS = ("mce loss", "lm loss", "mtp_1 loss")


def _losses(text: str) -> dict:
    """``{(iteration, key): value}`` of the training log lines (log interval 1)."""
    lines = log_lines(text, _KEYS)
    return {(i, key): value for i, values in lines.items() for key, value in values.items()}


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mtp", "ep2"])
def test_distributed_optimizer_with_overlap_equals_one_process(model):
    flags = BASE + NO_DROPOUT + (MTP if model == "mtp" else EP2)
    # Megatron-LM prints its log lines on the last rank
    reference = run_distributed(pretrain_child, 1 if model == "mtp" else 2, runs=[flags])[-1]
    printed = run_distributed(pretrain_child, 2, runs=[flags + DIST_OPT])[-1]
    expected, got = _losses(reference[0]), _losses(printed[0])
    assert sorted(i for i, _ in expected) == sorted(i for i, _ in got)
    assert {i for i, _ in got} == {1, 2, 3, 4, 5, 6}, printed[0][-3000:]
    if model == "mtp":
        assert (6, "mtp_1 loss") in got  # MTP trains after the switch
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=2e-6, abs=1e-6), (key, got[key], value)
