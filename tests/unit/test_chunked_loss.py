"""The chunked output layer + cross-entropy (``superposition/chunked_loss.py``) against a
plain float64 reference written here (``log_softmax`` of ``hidden @ W^T`` per slot), and its
memory against megatron-core's CE path (the output layer's matmul, then
``vocab_parallel_cross_entropy``) on the same hidden states and weight.

``tests/distributed/test_chunked_loss_tp.py`` runs TP = 2, with and without sequence
parallelism, against the 1-process result.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tst_megatron.superposition.chunked_loss import chunk_bounds, chunked_output_cross_entropy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from measure import PeakTensorMemory  # noqa: E402


def _reference(hidden, weight, targets):
    """Per-slot CE ``[T, b, k]``: ``-log_softmax(hidden @ W^T)[t_k]``, float64, plainly."""
    log_p = torch.log_softmax((hidden @ weight.t()).double(), dim=-1)
    return -torch.gather(log_p, -1, targets)


def _case(T=7, b=2, h=5, V=11, k=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, b, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(V, h, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, V, (T, b, k), generator=g)
    if k > 1:
        targets[0, 0, 1] = targets[0, 0, 0]  # a duplicate target: its gradients add up
    upstream = torch.rand(T, b, k, generator=g, dtype=torch.float64) * 3
    upstream[2, 1] = 0.0  # a masked position
    return hidden, weight, targets, upstream


def _grads(loss_fn, hidden, weight, targets, upstream):
    hidden.grad = weight.grad = None
    loss = loss_fn(hidden, weight, targets)
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunks", [1, 2, 3, 7, 8])
@pytest.mark.parametrize("k", [1, 4])
def test_loss_and_every_gradient_equal_the_float64_reference(chunks, k):
    """Phase 1's ``k = S`` slots and phase 2's ``k = 1``; chunk counts that do not divide
    ``T`` (7) and that exceed it (8); a duplicate target; a masked position; a random,
    non-unit upstream gradient."""
    hidden, weight, targets, upstream = _case(k=k)
    ref = _grads(_reference, hidden, weight, targets, upstream)
    got = _grads(
        lambda h, w, t: chunked_output_cross_entropy(h, w, t, chunks=chunks),
        hidden, weight, targets, upstream,
    )  # fmt: skip
    for name, r, x in zip(("loss", "dL/dh", "dL/dW"), ref, got):
        assert x.dtype == torch.float64, name
        torch.testing.assert_close(x, r, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.equal(got[1][2, 1], torch.zeros_like(got[1][2, 1]))  # masked: exactly 0


@pytest.mark.parametrize("chunks", [1, 3])
def test_predictions_are_the_first_argmax_of_the_logits(chunks):
    """What megatron-core's MTP acceptance counts take (``torch.argmax`` of the logits, the
    first of equal maxima): two vocabulary rows made equal and large tie at most positions."""
    hidden, weight, targets, _ = _case(k=1)
    with torch.no_grad():  # multiples of 1/4: exact logits, so equal rows tie exactly
        hidden.copy_(torch.round(hidden * 4) / 4)
        weight.copy_(torch.round(weight * 4) / 4)
        weight[9] = weight[4] = 4 * weight[4]
    logits = (hidden @ weight.t()).detach()
    expected = torch.argmax(logits, dim=-1)
    assert (expected == 4).sum() >= 3  # the tie is taken (4 before 9), not avoided
    predictions = torch.full(targets.shape[:2], -1, dtype=torch.int64)
    chunked_output_cross_entropy(hidden, weight, targets, chunks=chunks, predictions=predictions)
    assert torch.equal(predictions, expected), (predictions, expected)


def test_a_detached_weight_gets_no_gradient_and_the_hidden_gradient_is_unchanged():
    """MTP's ``mtp_detach_heads`` passes the output weight detached: no weight-sized gradient
    is computed, and ``dL/dh`` is as with the weight attached."""
    hidden, weight, targets, upstream = _case(k=1)
    attached = _grads(
        lambda h, w, t: chunked_output_cross_entropy(h, w, t, chunks=3),
        hidden, weight, targets, upstream,
    )  # fmt: skip
    hidden.grad = weight.grad = None
    loss = chunked_output_cross_entropy(hidden, weight.detach(), targets, chunks=3)
    loss.backward(upstream)
    assert weight.grad is None
    torch.testing.assert_close(hidden.grad, attached[1], rtol=0, atol=0)


def test_a_masked_position_with_non_finite_logits_gets_exactly_zero_gradient():
    """megatron-core's CE backward is ``(softmax - onehot) * g``: ``nan * 0`` at a masked
    position whose logits are not finite."""
    hidden, weight, targets, upstream = _case()
    with torch.no_grad():
        hidden[2, 1, 0] = float("inf")
    loss, dh, dw = _grads(
        lambda h, w, t: chunked_output_cross_entropy(h, w, t, chunks=3),
        hidden, weight, targets, upstream,
    )  # fmt: skip
    # dL/dz is 0 there, so dL/dh is 0 (0 @ W) and finite everywhere; dL/dW = dz^T @ h meets
    # the inf as 0 * inf, in megatron-core's output layer as here
    assert torch.equal(dh[2, 1], torch.zeros_like(dh[2, 1])) and torch.isfinite(dh).all()


def test_gradient_accumulation_fusion_adds_the_weight_gradient_to_main_grad():
    """megatron-core DDP's protocol, as ``ColumnParallelLinear`` follows it with
    ``gradient_accumulation_fusion``: the gradient is added to ``weight.main_grad`` (here
    float64, as fp32 is on a GPU: wider than the activations, so the block-wise path runs),
    ``grad_added_to_main_grad`` is set, and two micro-batches accumulate."""
    hidden, weight, targets, upstream = _case(T=9, V=19, k=2, dtype=torch.float32)
    reference_weight = weight.detach().double().requires_grad_()
    ref = _reference(hidden.detach().double(), reference_weight, targets)
    ref.backward(upstream)
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float64)
    weight.grad_added_to_main_grad = False
    for _ in range(2):  # two micro-batches
        loss = chunked_output_cross_entropy(hidden, weight, targets, chunks=4, into_main_grad=True)
        loss.backward(upstream.float())
    assert weight.grad_added_to_main_grad and weight.grad.shape == weight.shape
    torch.testing.assert_close(weight.main_grad, 2 * reference_weight.grad, rtol=1e-5, atol=1e-6)


def test_float32_equals_megatron_cores_path_to_round_off():
    """The same numbers as the output layer's matmul followed by megatron-core's
    ``vocab_parallel_cross_entropy`` (``k = 1``, TP = 1), in float32."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        hidden, weight, targets, upstream = _case(T=16, b=2, h=8, V=64, k=1, dtype=torch.float32)

        def megatron_core(h, w, t):
            logits = h @ w.t()
            return vocab_parallel_cross_entropy(logits, t[..., 0], tp_group=dist.group.WORLD)[
                ..., None
            ]

        ref = _grads(megatron_core, hidden, weight, targets, upstream)
        got = _grads(
            lambda h, w, t: chunked_output_cross_entropy(h, w, t, chunks=4),
            hidden, weight, targets, upstream,
        )  # fmt: skip
        for r, x in zip(ref, got):
            torch.testing.assert_close(x, r, rtol=2e-6, atol=2e-6)
    finally:
        if owned:
            dist.destroy_process_group()


def test_chunk_bounds_cover_every_position_once():
    for length in range(0, 12):
        for chunks in range(1, 14):
            bounds = chunk_bounds(length, chunks)
            covered = [i for start, end in bounds for i in range(start, end)]
            assert covered == list(range(length)) and len(bounds) == min(chunks, length)
            sizes = [end - start for start, end in bounds]
            assert not sizes or max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunk_bounds(4, 0)


def test_shapes_that_do_not_agree_are_refused():
    hidden, weight, targets, _ = _case()
    with pytest.raises(ValueError, match="targets must be"):
        chunked_output_cross_entropy(hidden, weight, targets[:-1], chunks=2)
    with pytest.raises(ValueError, match="weight must be"):
        chunked_output_cross_entropy(hidden, weight[:, :-1], targets, chunks=2)
    with pytest.raises(ValueError, match="integer"):
        chunked_output_cross_entropy(hidden, weight, targets.double(), chunks=2)
    with pytest.raises(ValueError, match="chunks must be >= 1"):
        chunked_output_cross_entropy(hidden, weight, targets, chunks=0)


#: A head-heavy shape for the memory test: the logits dwarf everything else.
T, B, H, V = 128, 2, 16, 8192
LOGITS_BF16 = T * B * V * 2  # bytes of one bf16 logits-sized tensor


def _peak(loss_fn, dtype, k) -> int:
    torch.manual_seed(0)
    hidden = torch.randn(T, B, H, dtype=dtype, requires_grad=True)
    weight = torch.randn(V, H, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, V, (T, B, k))
    upstream = torch.rand(T, B, k)
    with PeakTensorMemory() as memory:
        loss = loss_fn(hidden, weight, targets)
        loss.backward(upstream)
    return memory.peak


def _megatron_core_path(hidden, weight, targets):
    """The unchunked path in phase 1/2: the output layer's logits, then the project's
    vocab-parallel CE (which holds exactly megatron-core's CE memory,
    ``tests/unit/test_loss_memory.py``)."""
    from tst_megatron.superposition import vocab_parallel_multi_target_cross_entropy

    logits = hidden @ weight.t()
    return vocab_parallel_multi_target_cross_entropy(logits, targets, inplace=True)


@pytest.mark.parametrize("k", [1, 4])
def test_at_8_chunks_the_bf16_peak_is_at_most_a_quarter_of_the_unchunked_path(k):
    """Peak live tensor bytes of forward + backward in bf16 (where fp32 would hide the
    logits' fp32 copy). Fails if a full logits-sized tensor comes back."""
    unchunked = _peak(_megatron_core_path, torch.bfloat16, k)
    chunked = _peak(
        lambda h, w, t: chunked_output_cross_entropy(h, w, t, chunks=8), torch.bfloat16, k
    )
    assert unchunked >= 3 * LOGITS_BF16, unchunked  # bf16 logits + their fp32 softmax
    assert chunked <= 0.25 * unchunked, (chunked, unchunked)
    assert chunked < LOGITS_BF16, chunked  # not even one bf16 logits-sized tensor


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--tst-loss-chunks", "0"], "--tst-loss-chunks must be an integer >= 1, got 0"),
        (
            ["--tst-loss-chunks", "4", "--cross-entropy-loss-fusion"],
            "--tst-loss-chunks 4 is not supported with --cross-entropy-loss-fusion",
        ),
    ],
)  # fmt: skip
def test_what_the_chunked_head_cannot_run_with_is_one_line(flags, fragment):
    """The dry run (the launch runs the same rules): settings that read the full logits
    between the output layer and the loss, or another loss implementation."""
    import io

    pytest.importorskip("megatron.training")
    from tests.unit.test_checkpoint_input import DRY
    from tst_megatron.training.dry_run import dry_run

    err = io.StringIO()
    assert dry_run(DRY + flags, out=io.StringIO(), err=err) == 2
    errors = [x for x in err.getvalue().splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and fragment in errors[0], err.getvalue()
    ok = io.StringIO()
    assert dry_run(DRY + ["--tst-loss-chunks", "4"], out=ok, err=io.StringIO()) == 0


def test_every_setting_the_chunked_head_refuses_is_named():
    """The rules without a launch (some need a GPU to pass ``validate_args``): each setting
    alone gives its line; none with one chunk."""
    import argparse

    from tst_megatron.training.checks.tst import loss_chunk_problems

    cases = {
        "cross_entropy_loss_fusion": (True, "--cross-entropy-loss-fusion"),
        "use_mup": (True, "--use-mup"),
        "defer_embedding_wgrad_compute": (True, "--defer-embedding-wgrad-compute"),
    }
    for name, (value, flag) in cases.items():
        (line,) = loss_chunk_problems(argparse.Namespace(**{name: value}), 2)
        assert line.startswith(f"--tst-loss-chunks 2 is not supported with {flag}"), line
        assert loss_chunk_problems(argparse.Namespace(**{name: value}), 1) == []
    mxfp8 = argparse.Namespace(fp8="e4m3", fp8_recipe="mxfp8", fp8_output_proj=True)
    (line,) = loss_chunk_problems(mxfp8, 8)
    assert "TELMHeadColumnParallelLinear" in line, line
    assert loss_chunk_problems(argparse.Namespace(fp8="e4m3", fp8_recipe="mxfp8"), 8) == []


def test_a_checkpoint_saved_before_the_flag_existed_still_plans():
    """Saved ``args`` without ``tst_loss_chunks`` (a checkpoint of the previous release): the
    resume rules plan its run with the default, 1 (an AttributeError before)."""
    import argparse

    pytest.importorskip("megatron.training")
    from tst_megatron.loop.plan import tst_config

    saved = argparse.Namespace(
        tst_bag_size=2, tst_phase1_iters=3, tst_phase1_fraction=None,
        tst_bag_weighting="uniform", tst_save_at_switch=True, tst_mode="full",
    )  # fmt: skip
    assert tst_config(saved).loss_chunks == 1 and tst_config(saved).bag_size == 2
