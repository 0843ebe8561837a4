"""Multi-token prediction (``--mtp-num-layers``) inside Megatron-LM's own loop on 2 gloo
processes: the MTP block is skipped in phase 1 and trains from the switch
(:class:`tst_megatron.training.gpt.TSTGPTModel`).

One spawn, two ``pretrain()`` runs of the tiny GPT of ``test_megatron_lm.py`` with one MTP
layer (RoPE: Megatron-LM refuses MTP with learned absolute positions):

- DP=2 with ``--overlap-grad-reduce`` and buckets of 1000 elements, so that some buckets hold
  only MTP parameters: megatron-core DDP asserts at the next step when a bucket's parameters
  got no gradient (``_ParamAndGradBucketGroup.reset``), which is why phase 1 gives them an
  exact zero;
- TP=2 with sequence parallelism (the MTP block's layers and its logits are split too).

PP=2 is not run here: with MTP, megatron-core gives the last stage its own copy of the
embedding and sets it up with ``weight.data.cuda()``
(``LanguageModule.setup_embeddings_and_output_layer``, as for tied embeddings), which the
CPU runtime does not redirect.

Both switch in-process with finite losses in both phases, and Megatron-LM logs the MTP loss
(``mtp_1 loss``, ``MTPLossLoggingHelper``) in phase 2 only.
"""

from __future__ import annotations

import math
import re

import pytest

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import BASE, NO_DROPOUT  # noqa: E402
from tests.launcher import losses as _losses  # noqa: E402
from tests.launcher import pretrain_child as _pretrain_child  # noqa: E402

MTP = ["--mtp-num-layers", "1", "--position-embedding-type", "rope"]
_MTP_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| mtp_1 loss: ([0-9.E+-]+) \|")


def _fresh_pretrain_child(rank, world, *, runs):
    """``_pretrain_child`` with megatron-core's MTP logging state emptied before each run:
    ``MTPLossLoggingHelper.tracker`` is a class attribute that Megatron-LM's
    ``destroy_global_state`` leaves in place, so a second ``pretrain()`` in one process
    would log ``mtp_1 loss: 0`` in its phase 1 (the first run's zeroed entry)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    printed = []
    for argv in runs:
        MTPLossLoggingHelper.tracker.clear()
        printed += _pretrain_child(rank, world, runs=[argv])
    return printed


@pytest.fixture(scope="module")
def runs():
    base = BASE + NO_DROPOUT + MTP
    argvs = {
        "dp2": base + ["--overlap-grad-reduce", "--ddp-bucket-size", "1000"],
        "tp2": base + ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    }
    first, last = run_distributed(_fresh_pretrain_child, 2, runs=list(argvs.values()))
    return {name: (first[i], last[i]) for i, name in enumerate(argvs)}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_mtp_trains_from_the_switch_and_is_logged_in_phase2_only(runs, layout):
    first, last = runs[layout]
    train, valid = _losses(last)
    assert sorted(train) == [1, 2, 3, 4, 5, 6], last[-3000:]
    assert all(math.isfinite(float(v)) for v in train.values())
    assert sorted(valid) == [3, 6]
    assert all(math.isfinite(float(v)) for v in valid.values())
    assert "TST: phase 1 (bags) from iteration 0, until 3" in first
    assert "TST: phase 2 (next-token) from iteration 3 (switch at 3)" in first
    mtp = {int(i): float(v) for i, v in _MTP_LOSS.findall(last)}
    assert sorted(mtp) == [4, 5, 6], last[-3000:]  # phase 2 only (the switch is at 3)
    assert all(math.isfinite(v) and v > 0 for v in mtp.values())
