"""Pipeline layouts train on exactly the numbers of one process.

With PP = 2 the previous and the next pipeline stage are the same rank. Under the interleaved
schedule (virtual stages) a rank sends that peer activations *and* gradients in one call,
and megatron-core's batched p2p (``batch_isend_irecv``) paired them in the wrong order:
micro-batches 2-3 of each step trained on swapped tensors, ~1e-4 relative off on step one
and 1% by step six, silently. Four micro-batches per step (global batch 8, micro-batch 2)
reach the steady 1F1B state where both directions are in flight; the tolerance is float32
round-off, which that bug cannot pass.
"""

import os
import shutil

import pytest

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

N, N1 = 3, 2
DENSE = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "4",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "64",
    "--seq-length",
    "16",
    "--swiglu",
    "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--train-iters",
    str(N),
    "--tst-bag-size",
    "4",
    "--tst-phase1-iters",
    str(N1),
    "--lr",
    "3e-3",
    "--lr-warmup-iters",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--log-interval",
    "1",
    "--seed",
    "5",
]
LAYOUTS = {
    "vpp": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
}


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    return trainer.train(parse_args(argv))


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """1 process, saving after step 1 (phase 1) so both layouts start from its weights."""
    root = tmp_path_factory.mktemp("pp_ref")
    (history,) = run_distributed(
        _train_child, 1, argv=DENSE + ["--save", str(root), "--save-interval", "1"]
    )
    return root, history


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_pipeline_layout_matches_one_process_to_float32_roundoff(layout, one_process, tmp_path):
    root, ref = one_process
    shutil.copytree(root / "iter_0000001", tmp_path / "iter_0000001")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    ranks = run_distributed(
        _train_child, 2, argv=DENSE + LAYOUTS[layout] + ["--load", str(tmp_path)]
    )
    for history in ranks:
        assert sorted(history["train"]) == [2, 3]  # a phase-1 step, then a phase-2 step
        for it, loss in history["train"].items():
            assert loss == pytest.approx(ref["train"][it], rel=1e-6, abs=0), (layout, it)
    assert os.path.isdir(root / "iter_0000003")
