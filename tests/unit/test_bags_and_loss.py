"""Single-process tests of bag folding, target alignment, slot weights, the multi-target CE
(no TP group) and the MCE reduction, against plain float64 references."""

import re

import pytest
import torch
import torch.nn.functional as F

from tst_megatron.superposition import (
    align_bag_targets,
    bag_weights,
    fold_bags,
    multi_hot_cross_entropy,
    vocab_parallel_multi_target_cross_entropy,
)


def test_fold_bags_layout():
    tokens = torch.arange(2 * 12).view(2, 12)
    bags = fold_bags(tokens, 3)
    assert bags.shape == (2, 4, 3)
    for i in range(2):
        for j in range(4):
            for k in range(3):
                assert bags[i, j, k] == tokens[i, j * 3 + k]


@pytest.mark.parametrize(
    "shape,size,message",
    [
        ((2, 10), 3, "not a multiple of bag_size 3"),
        ((2, 9), 0, "bag_size must be"),
        ((9,), 3, "must be [b, S*T]"),
        ((2, 10), 2.0, "bag_size must be an integer >= 1, got 2.0"),
        ((2, 10), True, "bag_size must be an integer >= 1, got True"),
    ],
)
def test_fold_bags_errors(shape, size, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fold_bags(torch.zeros(shape, dtype=torch.long), size)


@pytest.mark.parametrize("bag_size", [1, 2, 4])
def test_align_bag_targets_matches_definition(bag_size):
    latent = 5
    x = torch.randint(0, 100, (3, bag_size * latent + 1))  # the sample's L + 1 tokens
    labels = x[:, 1:]
    loss_mask = (torch.rand(labels.shape) > 0.2).float()
    targets, mask = align_bag_targets(labels, loss_mask, bag_size)
    assert targets.shape == mask.shape == (3, latent, bag_size)
    assert targets.dtype == torch.int64 and mask.dtype == torch.float32
    for i in range(3):
        for j in range(latent):
            for k in range(bag_size):
                pos = (j + 1) * bag_size + k  # index into x of the target token
                if pos <= bag_size * latent:
                    assert targets[i, j, k] == x[i, pos]
                    assert mask[i, j, k] == loss_mask[i, pos - 1]  # mask of that label
                else:
                    assert targets[i, j, k] == 0 and mask[i, j, k] == 0
    # The last latent position has only slot 0 valid (given an unmasked last label).
    full_t, full_m = align_bag_targets(labels, torch.ones_like(loss_mask), bag_size)
    assert full_m[:, -1].sum(dim=-1).tolist() == [1.0, 1.0, 1.0]
    assert full_m[:, :-1].min() == 1.0


def test_align_bag_targets_errors():
    with pytest.raises(ValueError, match="differ in shape"):
        align_bag_targets(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 6), 2)


def test_bag_weights():
    torch.testing.assert_close(bag_weights(4), torch.full((4,), 0.25))
    power = bag_weights(3, "power")
    expected = torch.tensor([1.0, 1 / 2, 1 / 3], dtype=torch.float64)
    torch.testing.assert_close(power, (expected / expected.sum()).float())
    assert power.dtype == torch.float32 and abs(power.sum().item() - 1) < 1e-6
    with pytest.raises(ValueError, match="unknown bag weighting 'cubic'"):
        bag_weights(3, "cubic")
    with pytest.raises(ValueError, match="bag_size must be"):
        bag_weights(0)


def _reference_ce(logits, targets):
    vocab = logits.shape[-1]
    return torch.stack(
        [
            F.cross_entropy(
                logits.reshape(-1, vocab), targets[..., k].reshape(-1), reduction="none"
            ).view(targets.shape[:-1])
            for k in range(targets.shape[-1])
        ],
        dim=-1,
    )


@pytest.mark.parametrize("k", [1, 3, 8])
def test_multi_target_ce_single_process(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(4, 5, 50, generator=g) * 3
    targets = torch.randint(0, 50, (4, 5, k), generator=g)
    targets[0, 0] = 9  # all slots the same token: counted k times
    upstream = torch.randn(4, 5, k, generator=g, dtype=torch.float64) - 0.4
    x = logits.clone().requires_grad_(True)
    ce = vocab_parallel_multi_target_cross_entropy(x, targets)
    ce.backward(upstream.float())
    assert ce.dtype == torch.float32 and ce.shape == (4, 5, k)
    assert torch.equal(x.detach(), logits), "input modified"
    ref_x = logits.double().requires_grad_(True)
    ref = _reference_ce(ref_x, targets)
    ref.backward(upstream)
    torch.testing.assert_close(ce.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-5, atol=1e-6)


def test_multi_target_ce_errors():
    with pytest.raises(ValueError, match="must agree"):
        vocab_parallel_multi_target_cross_entropy(
            torch.zeros(2, 3, 10), torch.zeros(2, 4, 1, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="target id 10 is outside the vocabulary"):
        vocab_parallel_multi_target_cross_entropy(
            torch.zeros(2, 10), torch.full((2, 1), 10), check=True
        )
    with pytest.raises(ValueError, match="integer tensor"):
        vocab_parallel_multi_target_cross_entropy(torch.zeros(2, 10), torch.zeros(2, 1))


def test_multi_hot_cross_entropy_matches_definition():
    g = torch.Generator().manual_seed(0)
    ce = (torch.rand(3, 4, 6, generator=g, dtype=torch.float64) * 5).requires_grad_(True)
    mask = (torch.rand(3, 4, 6, generator=g) > 0.4).float()
    w = bag_weights(6, "power")
    loss_sum, weight_sum = multi_hot_cross_entropy(ce, mask, w)
    upstream = 2.3
    (loss_sum * upstream).backward()
    ref_loss, ref_weight = 0.0, 0.0
    for idx in torch.cartesian_prod(torch.arange(3), torch.arange(4), torch.arange(6)).tolist():
        i, j, k = idx
        ref_loss += w[k].item() * mask[i, j, k].item() * ce[i, j, k].item()
        ref_weight += w[k].item() * mask[i, j, k].item()
    assert abs(loss_sum.item() - ref_loss) < 1e-5 and abs(weight_sum.item() - ref_weight) < 1e-6
    torch.testing.assert_close(ce.grad, (upstream * mask * w).double(), rtol=1e-6, atol=1e-7)


def test_uniform_full_mask_equals_mean_of_slot_means():
    """The paper's loss: with uniform weights and no masking, MCE = mean of per-slot CE means."""
    ce = torch.rand(2, 5, 4, dtype=torch.float64)
    loss_sum, weight_sum = multi_hot_cross_entropy(ce, torch.ones_like(ce), bag_weights(4))
    expected = torch.stack([ce[..., k].mean() for k in range(4)]).mean()
    assert abs((loss_sum / weight_sum).item() - expected.item()) < 1e-6


def test_multi_hot_all_masked_is_zero_and_finite():
    ce = torch.tensor([[float("nan"), float("inf"), 1.0]], requires_grad=True)
    loss_sum, weight_sum = multi_hot_cross_entropy(ce, torch.zeros(1, 3), bag_weights(3))
    assert loss_sum.item() == 0.0 and weight_sum.item() == 0.0
    (loss_sum * 3.1).backward()
    assert torch.isfinite(ce.grad).all() and (ce.grad == 0).all()
    with pytest.raises(ValueError, match="shapes do not match"):
        multi_hot_cross_entropy(ce, torch.zeros(1, 2), bag_weights(3))


@pytest.mark.parametrize("inplace", [False, True])
def test_multi_target_ce_inplace_matches_reference(inplace):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 2, 40, generator=g) * 2  # sequence-first [T, b, V]
    targets = torch.randint(0, 40, (5, 2, 3), generator=g)
    upstream = torch.randn(5, 2, 3, generator=g, dtype=torch.float64) + 0.2
    x = logits.clone().requires_grad_(True)
    work = x * 1.0  # a non-leaf, like the output layer's logits
    ce = vocab_parallel_multi_target_cross_entropy(work, targets, inplace=inplace)
    ce.backward(upstream.float())
    assert torch.equal(work.detach(), logits) != inplace  # in place: overwritten by softmax
    ref_x = logits.double().requires_grad_(True)
    ref = _reference_ce(ref_x, targets)
    ref.backward(upstream)
    torch.testing.assert_close(ce.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_masked_position_with_non_finite_logit_gets_zero_gradient(bad):
    """Phase 1: a non-finite logit at a latent position whose slots are all masked
    contributes exactly zero to the loss and to every gradient (selection, not 0 * nan)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 30, generator=g)
    logits[1, 2, 7] = bad
    targets = torch.randint(0, 30, (2, 4, 4), generator=g)
    mask = torch.ones(2, 4, 4)
    mask[1, 2, :] = 0.0  # every slot of that position is masked
    mask[0, 3, 1:] = 0.0  # the last-bag pattern
    x = logits.clone().requires_grad_(True)
    ce = vocab_parallel_multi_target_cross_entropy(x * 1.0, targets, inplace=True)
    loss_sum, weight_sum = multi_hot_cross_entropy(ce, mask, bag_weights(4, "power"))
    (loss_sum / weight_sum * 1.3).backward()
    assert torch.isfinite(loss_sum) and torch.isfinite(x.grad).all()
    assert (x.grad[1, 2] == 0).all()
    # Everything else equals a float64 reference without the bad position.
    keep = torch.ones(2, 4, dtype=torch.bool)
    keep[1, 2] = False
    ref_x = logits.double().masked_fill(~keep[..., None], 0.0).requires_grad_(True)
    w = bag_weights(4, "power").double()
    ref_ce = _reference_ce(ref_x, targets)
    ref_loss = (ref_ce * mask * w).sum()
    (ref_loss / (mask * w).sum() * 1.3).backward()
    torch.testing.assert_close(loss_sum.double(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double()[keep], ref_x.grad[keep], rtol=1e-5, atol=1e-6)


def test_targets_and_weights_keep_their_dtypes_and_the_labels_device():
    """Targets int64, masks and slot weights float32, whatever torch's default dtype, on the
    labels' device (the meta device stands in for a GPU: a mask made on the CPU would not
    be on it)."""
    from tst_megatron.superposition.bags import following_token_targets, phase1_weights

    labels = torch.randint(0, 9, (2, 12), dtype=torch.int32)
    mask = torch.ones(2, 12, dtype=torch.bool)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for targets, slots in (
            align_bag_targets(labels, mask, 3),
            following_token_targets(labels, mask, 3),
        ):
            assert (targets.dtype, slots.dtype) == (torch.int64, torch.float32)
        for mode in ("full", "input", "output"):
            assert phase1_weights(3, "uniform", mode).dtype == torch.float32
    finally:
        torch.set_default_dtype(default)
    meta = (labels.to("meta"), mask.to("meta"))
    for targets, slots in (align_bag_targets(*meta, 3), following_token_targets(*meta, 3)):
        assert targets.device.type == slots.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inplace", [False, True])
def test_multi_target_ce_in_half_precision_matches_the_reference_on_its_logits(dtype, inplace):
    """bf16/fp16 logits: fp32 CE against float64 on the logits as rounded, the gradient in
    the logits' dtype, and the input left as it was unless ``inplace``."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(3, 4, 48, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 48, (3, 4, 5), generator=g)
    targets[1, 1] = 17  # all slots the same token
    upstream = torch.randn(3, 4, 5, generator=g, dtype=torch.float64) + 0.3
    x = logits.clone().requires_grad_(True)
    work = x * 1  # a non-leaf, like the output layer's logits
    ce = vocab_parallel_multi_target_cross_entropy(work, targets, inplace=inplace)
    ce.backward(upstream.float())
    assert ce.dtype == torch.float32 and x.grad.dtype == dtype
    if not inplace:
        assert torch.equal(work.detach(), logits)
    ref_x = logits.double().requires_grad_(True)
    ref = _reference_ce(ref_x, targets)
    ref.backward(upstream)
    torch.testing.assert_close(ce.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("scale", [3.0, 300.0])  # 300: a wrong max would overflow exp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_target_ce_at_tp_2_in_one_process_matches_the_reference(monkeypatch, scale, dtype):
    """TP = 2 with the ranks as threads (``tests/unit/threaded_tp.py``): the MAX then the one
    SUM all-reduce on the given group, each rank's CE equal to the float64 reference of the
    whole vocabulary, its gradient that of its shard; targets on both shards' edges."""
    from tests.unit.threaded_tp import DIST, run_ranks
    from tst_megatron.superposition import cross_entropy

    monkeypatch.setattr(cross_entropy, "dist", DIST)
    g = torch.Generator().manual_seed(4)
    V = 40
    logits = (torch.randn(3, 4, V, generator=g) * scale).to(dtype)
    targets = torch.randint(0, V, (3, 4, 4), generator=g)
    targets[0, 0] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])
    targets[1, 2] = 7  # all slots the same token
    upstream = torch.randn(3, 4, 4, generator=g, dtype=torch.float64) + 0.3

    def rank(group):
        r = group.rank()
        local = logits[..., r * V // 2 : (r + 1) * V // 2].clone().requires_grad_(True)
        ce = vocab_parallel_multi_target_cross_entropy(local, targets, tp_group=group, check=True)
        ce.backward(upstream.float())
        return ce.detach(), local.grad

    (first, second), group = run_ranks(2, rank)
    MAX, SUM = torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.SUM
    assert sorted(group.calls, key=lambda call: call[0]) == [(0, MAX), (0, SUM), (1, MAX), (1, SUM)]
    ref_x = logits.double().requires_grad_(True)
    ref = _reference_ce(ref_x, targets)
    ref.backward(upstream)
    for ce in (first[0], second[0]):
        assert ce.dtype == torch.float32
        torch.testing.assert_close(ce.double(), ref.detach(), rtol=1e-5, atol=1e-4)
    grad = torch.cat([first[1], second[1]], dim=-1)
    assert grad.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grad.double(), ref_x.grad, **tol)


def test_the_target_check_at_tp_2_uses_the_whole_vocabulary(monkeypatch):
    from tests.unit.threaded_tp import DIST, run_ranks
    from tst_megatron.superposition import cross_entropy

    monkeypatch.setattr(cross_entropy, "dist", DIST)
    logits = torch.zeros(2, 3, 10)

    def rank(group, bad):
        targets = torch.full((2, 3, 2), 19)
        targets[1, 1, 1] = bad
        return vocab_parallel_multi_target_cross_entropy(
            logits, targets, tp_group=group, check=True
        )

    run_ranks(2, lambda group: rank(group, 19))  # 19 < 2 x 10: accepted
    with pytest.raises(ValueError, match=r"^target id 20 is outside the vocabulary \[0, 20\)$"):
        run_ranks(2, lambda group: rank(group, 20))
    # unchecked by default: an id past the vocabulary scores as if it were in no shard
    run_ranks(2, lambda group: vocab_parallel_multi_target_cross_entropy(
        logits, torch.full((2, 3, 1), 25), tp_group=group))  # fmt: skip


def test_slot_weights_are_normalised_in_float64_then_rounded_once():
    for size in range(1, 17):
        uniform = torch.full((size,), 1.0 / size, dtype=torch.float64)
        power = 1.0 / torch.arange(1, size + 1, dtype=torch.float64)
        for weighting, exact in (("uniform", uniform), ("power", power / power.sum())):
            got = bag_weights(size, weighting)
            assert got.dtype == torch.float32
            assert torch.equal(got, exact.to(torch.float32)), (size, weighting)


def test_multi_hot_loss_is_float32_on_the_mask_s_device():
    """float64 slot weights (a caller's) do not turn the sums into float64; weights on the
    CPU follow a mask on another device (the meta device stands in for a GPU)."""
    ce = torch.rand(2, 3, 4)
    mask = torch.ones(2, 3, 4)
    loss_sum, weight_sum = multi_hot_cross_entropy(
        ce, mask, torch.full((4,), 0.25, dtype=torch.float64)
    )
    assert loss_sum.dtype == weight_sum.dtype == torch.float32
    loss_sum, weight_sum = multi_hot_cross_entropy(ce.to("meta"), mask.to("meta"), bag_weights(4))
    assert loss_sum.device.type == weight_sum.device.type == "meta"


def test_mismatched_shapes_are_named_in_full():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "logits (2, 3, 10) and targets (2, 4, 1) must agree in all but the last dimension"
        ),
    ):
        vocab_parallel_multi_target_cross_entropy(
            torch.zeros(2, 3, 10), torch.zeros(2, 4, 1, dtype=torch.long)
        )


def test_int32_targets_score_as_int64_ones():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 20, generator=g)
    targets = torch.randint(0, 20, (2, 3, 2), generator=g)
    want = vocab_parallel_multi_target_cross_entropy(logits, targets)
    got = vocab_parallel_multi_target_cross_entropy(logits, targets.to(torch.int32))
    assert torch.equal(got, want)
