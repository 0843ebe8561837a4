"""The forward steps' context-parallel split (megatron-core's ``get_batch_on_this_cp_rank``)
against the zig-zag rule written out plainly, on ``[b, T, S]`` bags too (whole bags per chunk),
and the phase-2 loss function's masking by selection. The CP group is a stand-in: megatron-core
asks ``torch.distributed`` for its size and this rank's place in it."""

import pytest
import torch

from tst_megatron.loop import forward
from tst_megatron.loop.forward import make_phase2_step
from tst_megatron.superposition import align_bag_targets, fold_bags


def split_for_context_parallel(batch, cp, rank):
    """``forward._cp_split`` on a stand-in CP group of ``cp`` ranks, as rank ``rank``."""
    if cp == 1:
        return forward._cp_split(batch, None)
    group = object()
    size, place = torch.distributed.get_world_size, torch.distributed.get_rank
    try:
        torch.distributed.get_world_size = lambda g=None: cp if g is group else size(g)
        torch.distributed.get_rank = lambda g=None: rank if g is group else place(g)
        return forward._cp_split(batch, group)
    finally:
        torch.distributed.get_world_size, torch.distributed.get_rank = size, place


def _zigzag_reference(batch, cp, rank):
    """megatron-core's context-parallel split (``get_batch_on_this_cp_rank`` without
    ``cu_seqlens``), written out plainly: the sequence dim
    (2 for ``attention_mask``, else 1) in ``2 * cp`` equal chunks, rank ``r`` keeps chunks ``r``
    and ``2 * cp - 1 - r``, in that order; ``None`` stays ``None``."""
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1
        chunks = value.chunk(2 * cp, dim=dim)
        out[key] = torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_equals_megatron_cores_zigzag(cp):
    g = torch.Generator().manual_seed(cp)
    b, T = 2, 16
    batch = {
        "tokens": torch.randint(0, 100, (b, T), generator=g),
        "labels": torch.randint(0, 100, (b, T), generator=g),
        "loss_mask": torch.rand(b, T, generator=g),
        "position_ids": torch.arange(T).expand(b, T),
        "attention_mask": torch.rand(b, 1, T, T, generator=g) > 0.5,
        "bags": torch.randint(0, 100, (b, T, 4), generator=g),
        "absent": None,
    }
    for rank in range(cp):
        ours = split_for_context_parallel(batch, cp, rank)
        theirs = _zigzag_reference(batch, cp, rank)
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if value is None:
                assert ours[key] is None
            else:
                assert torch.equal(ours[key], value), key
    assert split_for_context_parallel(batch, 1, 0) is batch


def test_cp_chunks_hold_whole_bags_and_their_targets():
    bag, latent, cp = 4, 8, 2
    x = torch.arange(bag * latent + 1).unsqueeze(0)  # token id = position in the sample
    bags = fold_bags(x[:, :-1], bag)
    targets, mask = align_bag_targets(x[:, 1:], torch.ones(1, bag * latent), bag)
    seen = []
    for rank in range(cp):
        local = split_for_context_parallel(
            {"bags": bags, "targets": targets, "mask": mask}, cp, rank
        )
        assert local["bags"].shape == (1, latent // cp, bag)
        for j in range(latent // cp):
            first = int(local["bags"][0, j, 0])
            assert first % bag == 0, "a CP chunk split a bag"
            assert local["bags"][0, j].tolist() == list(range(first, first + bag))
            valid = local["mask"][0, j] > 0
            # slot k of the bag starting at `first` targets token first + bag + k
            expected = torch.arange(first + bag, first + 2 * bag)
            assert torch.equal(local["targets"][0, j][valid], expected[valid])
            seen.append(first // bag)
    assert sorted(seen) == list(range(latent))
    # load balancing: rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2
    assert seen[:4] == [0, 1, 6, 7]


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_phase2_masked_non_finite_loss_contributes_zero(bad):
    """Phase 2 (training and validation use this step): a per-token loss of inf or
    nan where the loss mask is 0 leaves the loss and its gradient exactly as without it."""
    g = torch.Generator().manual_seed(1)
    b, T = 2, 6
    loss_mask = torch.ones(b, T)
    loss_mask[0, 2] = loss_mask[1, 5] = 0.0
    per_token = torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    batch = {
        "tokens": torch.zeros(b, T, dtype=torch.long),
        "labels": torch.zeros(b, T, dtype=torch.long),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(T).expand(b, T),
    }
    leaf = per_token.clone().requires_grad_(True)
    poisoned = torch.where(loss_mask > 0, leaf, torch.tensor(bad, dtype=torch.float64))

    def model(tokens, position_ids, attention_mask, labels, loss_mask):
        assert loss_mask is batch["loss_mask"]  # passed on, as pretrain_gpt.py does (MTP)
        return poisoned

    output, loss_func = make_phase2_step()(iter([batch]), model)
    loss, num_tokens, report = loss_func(output)
    (loss * 0.7).backward()
    assert int(num_tokens) == 10
    expected = (per_token * loss_mask).sum()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(leaf.grad, 0.7 * loss_mask.double())
    assert torch.isfinite(report["lm loss"]).all()


class _PerSlotModel:
    """Stands in for the last pipeline stage: returns a fixed per-slot CE ``[b, T, S]``."""

    pre_process = False

    def __init__(self, table):
        self.table = table

    def __call__(self, *args, decoder_input=None, labels=None):
        assert labels.shape == self.table.shape
        return self.table


def test_phase1_step_loss_and_gradient_are_the_papers_mce():
    """Counting scored positions (not slots) leaves the MCE as the paper defines
    it: uniform weights, no masking inside bags -> the step's ``sum loss / sum num_tokens`` is
    the mean over all scored slots of all micro-batches (the last bag of each row has only
    slot 0), and so is its gradient."""
    from tst_megatron.loop.forward import make_phase1_step

    b, T, S, M = 2, 5, 4, 3
    g = torch.Generator().manual_seed(4)
    tables = [
        (torch.rand(b, T, S, generator=g, dtype=torch.float64) * 4).requires_grad_(True)
        for _ in range(M)
    ]
    step = make_phase1_step(bag_size=S, weighting="uniform")
    losses, counts = [], []
    for table in tables:
        x = torch.randint(0, 50, (b, S * T + 1), generator=g)
        batch = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(b, S * T)}
        output, loss_func = step(iter([batch]), _PerSlotModel(table))
        loss, num_tokens, _ = loss_func(output)
        assert num_tokens.dtype == torch.int32 and int(num_tokens) == b * T  # positions
        losses.append(loss)
        counts.append(num_tokens)
    step_loss = torch.stack(losses).sum() / torch.stack(counts).sum()
    (step_loss * 1.9).backward()
    # Reference: mean over all valid slots; slot k of the last position is valid only for k=0.
    valid = torch.ones(b, T, S, dtype=torch.bool)
    valid[:, -1, 1:] = False
    every = torch.cat([t.detach()[valid] for t in tables])
    torch.testing.assert_close(step_loss.double(), every.mean(), rtol=1e-6, atol=1e-9)
    for table in tables:
        expected = torch.where(valid, 1.9 / every.numel(), 0.0).double()
        torch.testing.assert_close(table.grad, expected, rtol=1e-6, atol=1e-12)


@pytest.fixture
def rerun_state_machine(monkeypatch):
    """megatron-core's rerun state machine as ``get_rerun_state_machine`` makes it (reruns
    disabled), destroyed after the test; it names the CUDA device in its messages (a CPU run
    redirects that)."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_non_finite_scored_loss_stops_the_step_as_in_pretrain_gpt(bad, what, rerun_state_machine):
    """``--check-for-nan-in-loss-and-grad`` (on by default): with reruns disabled a NaN or Inf
    loss sum stops the step through megatron-core's rerun state machine, in both phases, with
    ``pretrain_gpt.py``'s message; ``--no-check-for-nan-in-loss-and-grad`` lets it through."""
    from types import SimpleNamespace

    from tst_megatron.loop.forward import loss_checks, make_phase1_step

    b, T, S = 2, 3, 2
    table = torch.rand(b, T, S, dtype=torch.float64)
    table[1, 1, 0] = bad  # a scored slot
    x = torch.randint(0, 50, (b, S * T + 1), generator=torch.Generator().manual_seed(0))
    bags = {"tokens": x[:, :-1], "labels": x[:, 1:], "loss_mask": torch.ones(b, S * T)}
    per_token = torch.rand(b, T, dtype=torch.float64)
    per_token[0, 1] = bad
    tokens = {
        "tokens": torch.zeros(b, T, dtype=torch.long),
        "labels": torch.zeros(b, T, dtype=torch.long),
        "loss_mask": torch.ones(b, T),
        "position_ids": torch.arange(T).expand(b, T),
    }
    for on in (True, False):
        args = SimpleNamespace(check_for_nan_in_loss_and_grad=on, check_for_spiky_loss=False)
        check = loss_checks(args)
        runs = [
            make_phase1_step(bag_size=S, weighting="uniform", check=check)(
                iter([bags]), _PerSlotModel(table)
            ),
            make_phase2_step(check=check)(iter([tokens]), lambda *a, **k: per_token),
        ]
        for output, loss_func in runs:
            if on:
                with pytest.raises(RuntimeError, match=f"found {what} in local forward loss"):
                    loss_func(output)
            else:
                assert not torch.isfinite(loss_func(output)[0])


def test_check_for_spiky_loss_warns_at_a_loss_ten_times_the_largest_seen(
    rerun_state_machine, caplog
):
    """``--check-for-spiky-loss``: after megatron-core's 100 samples of a key's loss, a loss
    more than 10 times the largest is logged as "Spiky loss" (not fatal); off, nothing is."""
    import logging
    from types import SimpleNamespace

    from tst_megatron.loop.forward import loss_checks

    for on in (False, True):
        args = SimpleNamespace(check_for_nan_in_loss_and_grad=True, check_for_spiky_loss=on)
        check = loss_checks(args)
        key = f"spiky test {on}"  # the state machine keeps each key's largest value
        with caplog.at_level(logging.WARNING, logger="megatron.core.rerun_state_machine"):
            for value in [1.0 + 0.01 * i for i in range(100)] + [5.0, 50.0]:
                check(torch.tensor(value), key)
        spiky = [r.getMessage() for r in caplog.records if "Spiky loss" in r.getMessage()]
        if on:
            assert len(spiky) == 1 and "Unexpected result 50.0" in spiky[0], spiky
        else:
            assert spiky == []
        caplog.clear()
