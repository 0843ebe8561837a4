"""Phase 1's loss holds no logits-sized tensor beyond what megatron-core's own CE holds, in
bf16 and fp16 (a CPU run trains in fp32, where the loss reuses the logits in place and hides a
copy: on an H200 at 8,192 tokens x 131,072 entries phase 1 measured +2,049.5 MB, one bf16
logits-sized tensor).

Each case runs, forward and backward, the output layer's matmul (which keeps its input and
weight, not its logits) and then a loss at the model's seam (``compute_language_model_loss``
of :class:`~tst_megatron.models.seams.TSTLossSeam`) on the sequence-first ``[T, b, V]``
logits, under a tracker of live tensor bytes (``benchmarks/measure.py``). The reference is
megatron-core's ``vocab_parallel_cross_entropy`` on the same logits, as a stock
``pretrain_gpt.py`` run scores them.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from measure import PeakTensorMemory  # noqa: E402

T, B, H, V, S = 128, 2, 16, 8192, 4
LOGITS = T * B * V  # entries of one logits-sized tensor


@pytest.fixture(scope="module", autouse=True)
def group():
    """A 1-process gloo group: megatron-core's CE reads its TP group."""
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if owned:
        dist.destroy_process_group()


def _seam():
    """The loss seam of a model at TP = 1: ``TSTLossSeam`` over megatron-core's
    ``LanguageModule.compute_language_model_loss`` (no fusion)."""
    import torch.distributed as dist
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from tst_megatron.models.seams import TSTLossSeam

    class Seam(TSTLossSeam, LanguageModule):
        def __init__(self):  # no module state: only what the loss reads
            torch.nn.Module.__init__(self)
            self.tp_group, self.vocab_size = dist.group.WORLD, V
            self.config = type("C", (), {"cross_entropy_loss_fusion": False})()

    return Seam()


def _peak(dtype, loss_of_logits) -> int:
    """Peak live bytes of ``matmul -> loss_of_logits(logits) -> backward`` with ``dtype``
    activations, over the bytes of the inputs made before the tracker starts."""
    torch.manual_seed(0)
    hidden = torch.randn(T, B, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    upstream = torch.rand(())  # a non-unit upstream gradient
    with PeakTensorMemory() as memory:
        logits = hidden @ weight.t()  # [T, b, V]: the output layer's logits
        loss = loss_of_logits(logits)
        del logits  # the model drops its reference once the loss is computed
        loss.backward(upstream)
    return memory.peak


def _labels(shape):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(1))


def _megatron_core(logits):
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits, _labels((T, B)), tp_group=dist.group.WORLD).sum()


def _phase1(logits):
    return _seam().compute_language_model_loss(_labels((B, T, S)), logits).sum()


def _phase2(logits):
    return _seam().compute_language_model_loss(_labels((B, T)), logits).sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("loss", [_phase1, _phase2], ids=["phase1", "phase2"])
def test_the_loss_seam_holds_no_more_than_megatron_cores_cross_entropy(dtype, loss):
    reference = _peak(dtype, _megatron_core)
    got = _peak(dtype, loss)
    # within a few [T, b, S]-sized tensors (targets, masks, per-slot CE): far below one
    # logits-sized tensor of this dtype
    slack = 16 * T * B * S * 8
    assert slack < LOGITS * torch.finfo(dtype).bits // 8
    assert got <= reference + slack, (
        f"{loss.__name__} {dtype}: peak {got:,} B against megatron-core's {reference:,} B "
        f"(+{(got - reference) / (LOGITS * torch.finfo(dtype).bits // 8):.2f} logits-sized "
        f"{dtype} tensors)"
    )


def test_the_tracker_sees_a_logits_sized_copy():
    """The measurement can fail: one extra ``[T, b, V]`` fp32 copy kept to the end shows."""
    kept = []

    def copying(logits):
        kept.append(logits.float() * 1.0)
        return _megatron_core(logits)

    extra = _peak(torch.bfloat16, copying) - _peak(torch.bfloat16, _megatron_core)
    assert extra >= LOGITS * 4, extra
