"""The run plan's boundary cases, each against arithmetic written here: N1's rounding (the
rule for exact halves: half to even, as Python's ``round`` of the float product
``r x N``), a ``--train-samples`` that is not a multiple of the global batch, the
batch-size boundaries (a schedule entry at the run's last sample, a change at the switch
sample, a resume at the switch with another batch, a saved entry at the checkpoint's
samples), and the phase-1 targets of a sample shorter than its bag."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

pytest.importorskip("megatron.training")

from tests.unit.test_megatron_lm_args import _megatron_args  # noqa: E402
from tst_megatron.loop.plan import run_plan, train_iters  # noqa: E402
from tst_megatron.superposition.bags import align_bag_targets, following_token_targets  # noqa: E402
from tst_megatron.superposition.schedule import TSTConfig  # noqa: E402


def _half_to_even(x: float) -> int:
    """The documented rule, written out: the nearest integer; an exact half goes to the even."""
    low = math.floor(x)
    rest = x - low
    if rest != 0.5:
        return low + (1 if rest > 0.5 else 0)
    return low if low % 2 == 0 else low + 1


@pytest.mark.parametrize(
    "r, n, expected",
    [
        (0.3, 11, 3),  # 3.3: below a half
        (0.3, 13, 4),  # 3.9: above
        (0.5, 5, 2),  # 2.5: an exact half, to the even 2
        (0.5, 7, 4),  # 3.5: an exact half, to the even 4
        (0.25, 6, 2),  # 1.5 -> 2
        (0.25, 10, 2),  # 2.5 -> 2
        (0.3, 5, 2),  # 0.3 x 5 is the float 1.5 exactly: to the even 2
        (0.35, 90, 31),  # 0.35 x 90 is the float 31.499999999999996: below a half
        (0.55, 50, 28),  # 0.55 x 50 is the float 27.500000000000004: above a half
    ],
)
def test_n1_is_r_times_n_rounded_half_to_even(r, n, expected):
    assert _half_to_even(r * n) == expected
    assert TSTConfig(bag_size=4, phase1_fraction=r).phase1_steps(n) == expected
    args = _megatron_args(train_iters=n, tst_phase1_fraction=r, global_batch_size=8)
    plan = run_plan(args)
    assert plan.n1 == expected and plan.switch_sample == expected * 8


def test_train_samples_not_a_multiple_of_the_batch_gives_megatron_lm_s_iterations():
    """Megatron-LM's ``update_train_iters``: ``train_samples // global_batch_size`` (the
    remainder is not trained); 10 samples of batch 4: 2 steps, 8 samples."""
    from megatron.training.training import update_train_iters

    args = _megatron_args(train_iters=None, train_samples=10, global_batch_size=4)
    theirs = argparse.Namespace(**vars(args))
    update_train_iters(theirs)
    assert train_iters(args) == theirs.train_iters == 2
    plan = run_plan(args)
    assert (plan.n, plan.total_samples) == (2, 8)
    assert run_plan(_megatron_args(train_iters=None, train_samples=11, global_batch_size=4)).n == 2
    assert run_plan(_megatron_args(train_iters=None, train_samples=12, global_batch_size=4)).n == 3


def _scheduled(schedule: str, **overrides):
    """A run under ``--step-batch-size-schedule`` (Megatron-LM's thresholds are tokens: 32 per
    sample at --seq-length 32), no constant global batch."""
    return _megatron_args(step_batch_size_schedule=schedule, global_batch_size=None, **overrides)


def test_a_schedule_entry_at_the_run_s_last_sample_is_not_reached():
    """Batch 4 until token 512 = sample 16, then 8; 4 steps of 4 consume exactly 16 samples: the
    second entry starts where the run ends, so it trains no step."""
    plan = run_plan(_scheduled("0:4 512:8", train_iters=4, tst_phase1_iters=2))
    assert plan.total_samples == 16
    assert plan.reached_batches == ((0, 4),)
    assert plan.batches_in_phase(2) == ((0, 4),)


def test_a_batch_change_at_the_switch_sample_belongs_to_phase_2_only():
    """Batch 4 until sample 8 (token 256), then 8; N1 = 2 steps of 4 = the switch at sample 8,
    exactly where the batch changes: phase 1 trains batch 4 only, phase 2 batch 8 only."""
    plan = run_plan(_scheduled("0:4 256:8", train_iters=5, tst_phase1_iters=2))
    assert plan.switch_sample == 8 and plan.total_samples == 8 + 3 * 8
    assert plan.batches_in_phase(1) == ((0, 4),)
    assert plan.batches_in_phase(2) == ((8, 8),)


def test_a_resume_at_the_switch_with_another_batch_keeps_the_checkpoint_s_switch():
    """Saved at iteration N1 = 3 with batch 8 (24 samples consumed), resumed with batch 16:
    the three steps already taken keep their 8 (the switch sample stays 24), the rest take 16."""
    saved = _megatron_args(train_iters=10, tst_phase1_iters=3, global_batch_size=8)
    saved.consumed_train_samples = 24
    args = _megatron_args(train_iters=10, tst_phase1_iters=3, global_batch_size=16)
    plan = run_plan(args, resumed=(3, saved))
    assert plan.switch_sample == 3 * 8
    assert plan.total_samples == 3 * 8 + 7 * 16
    assert plan.global_batches == ((0, 8), (24, 16))


def test_a_saved_batch_entry_at_the_checkpoint_s_samples_was_never_trained():
    """The checkpoint's history ends with an entry that starts at exactly the samples it
    consumed (48): no step ran with it, so the resumed plan continues from batch 8 with this
    run's 16 there, not 4."""
    saved = _megatron_args(train_iters=10, tst_phase1_iters=3, global_batch_size=4)
    saved.consumed_train_samples = 48
    saved.tst_global_batches = ((0, 8), (48, 4))
    args = _megatron_args(train_iters=10, tst_phase1_iters=3, global_batch_size=16)
    plan = run_plan(args, resumed=(6, saved))
    assert plan.global_batches == ((0, 8), (48, 16))
    assert plan.switch_sample == 3 * 8 and plan.total_samples == 6 * 8 + 4 * 16


def _resumed_plan(resumed_at: int, *, drop=(), n1=3, **args_overrides):
    """The plan of a run with batch 16 resumed at ``resumed_at`` from a checkpoint of batch 8
    that consumed ``resumed_at x 8`` samples (``drop``: saved attributes it lacks)."""
    saved = _megatron_args(train_iters=10, tst_phase1_iters=n1, global_batch_size=8)
    saved.consumed_train_samples = resumed_at * 8
    for name in drop:
        delattr(saved, name)
    args = _megatron_args(train_iters=10, tst_phase1_iters=n1, global_batch_size=16)
    vars(args).update(args_overrides)
    return run_plan(args, resumed=(resumed_at, saved))


def test_only_a_complete_constant_batch_checkpoint_past_the_switch_keeps_its_batches():
    """The checkpoint's batches are kept when it is at or past N1 > 0, both runs have a
    constant batch, and it recorded its batch and consumed samples; otherwise the plan is
    this run's alone (16 per step)."""
    kept = _resumed_plan(3)
    assert kept.global_batches == ((0, 8), (24, 16)) and kept.switch_sample == 24
    assert _resumed_plan(1, n1=1).global_batches == ((0, 8), (8, 16))  # N1 = 1, resumed there
    alone = ((0, 16),)
    assert _resumed_plan(2).global_batches == alone  # before the switch (refused by the rules)
    assert _resumed_plan(3, drop=("consumed_train_samples",)).global_batches == alone
    assert _resumed_plan(3, drop=("global_batch_size",)).global_batches == alone
    assert (
        _resumed_plan(3, drop=("step_batch_size_schedule",)).global_batches == kept.global_batches
    )
    # no switch (S = 1, N1 = 0): nothing splits the data, this run's batch from the start
    assert _resumed_plan(3, tst_bag_size=1).global_batches == alone
    # this run under a step schedule: Megatron-LM's calculator plans it
    scheduled = _resumed_plan(3, step_batch_size_schedule="0:16", global_batch_size=None)
    assert scheduled.global_batches == ((0, 16),) and scheduled.switch_sample == 3 * 16


def test_the_batches_recorded_at_launch_are_the_plan_s():
    """The launch records the plan's batches on ``args`` (``tst_global_batches``, saved in
    the checkpoint); a plan built from those arguments again uses them."""
    args = _megatron_args(train_iters=10, tst_phase1_iters=3, global_batch_size=16)
    args.tst_global_batches = ((0, 8), (24, 16))
    plan = run_plan(args)
    assert plan.global_batches == ((0, 8), (24, 16))
    assert plan.switch_sample == 24 and plan.total_samples == 24 + 7 * 16


def test_a_constant_batch_is_one_entry_from_sample_0_and_no_iterations_is_0():
    from tst_megatron.loop.plan import global_batches

    assert global_batches(_megatron_args(global_batch_size=8)) == [(0, 8)]
    assert train_iters(_megatron_args(train_iters=0, train_samples=None, global_batch_size=1)) == 0


def test_an_early_schedule_entry_smaller_than_micro_batch_times_dp_is_planned():
    """Megatron-LM checks only the current batch against micro-batch x DP (after loading a
    checkpoint), so an early entry may be smaller (a run grown onto more GPUs): 4 samples per
    step until sample 8, then 8, at micro-batch 2 x DP 4."""
    args = _scheduled("0:4 256:8", train_iters=5, tst_phase1_iters=2, data_parallel_size=4)
    plan = run_plan(args)
    assert plan.switch_sample == 8 and plan.total_samples == 8 + 3 * 8
    samples = _scheduled("0:4 256:8", train_iters=None, train_samples=32, data_parallel_size=4)
    assert train_iters(samples) == 5


def _plain_following(labels, mask, bag):
    """Output mode, written out: slot ``k`` of position ``i`` is label ``i + k`` while
    ``i + k < T``, else target 0 with mask 0."""
    b, length = labels.shape
    targets = [[[0] * bag for _ in range(length)] for _ in range(b)]
    masks = [[[0.0] * bag for _ in range(length)] for _ in range(b)]
    for row in range(b):
        for i in range(length):
            for k in range(bag):
                if i + k < length:
                    targets[row][i][k] = int(labels[row, i + k])
                    masks[row][i][k] = float(mask[row, i + k])
    return torch.tensor(targets), torch.tensor(masks)


@pytest.mark.parametrize("length, bag", [(1, 4), (2, 4), (3, 5), (2, 8), (4, 4), (6, 3)])
def test_output_mode_targets_of_a_sample_shorter_than_the_bag(length, bag):
    g = torch.Generator().manual_seed(length * 10 + bag)
    labels = torch.randint(1, 50, (2, length), generator=g)
    mask = (torch.rand(2, length, generator=g) > 0.2).float()
    targets, slots = following_token_targets(labels, mask, bag)
    want_targets, want_mask = _plain_following(labels, mask, bag)
    assert torch.equal(targets, want_targets) and torch.equal(slots, want_mask)


@pytest.mark.parametrize("latent, bag", [(1, 4), (1, 2), (2, 5), (3, 3)])
def test_full_mode_targets_of_one_or_few_bags(latent, bag):
    """``x`` holds ``S*T + 1`` tokens, labels ``x[1:]``: slot ``k`` of position ``j`` targets
    ``x[(j+1)*S + k]`` where that exists, else 0 with mask 0 (one bag: only slot 0 of it)."""
    x = torch.arange(100, 100 + bag * latent + 1).unsqueeze(0)
    labels, mask = x[:, 1:], torch.ones(1, bag * latent)
    targets, slots = align_bag_targets(labels, mask, bag)
    for j in range(latent):
        for k in range(bag):
            t = (j + 1) * bag + k
            inside = t <= bag * latent
            assert int(targets[0, j, k]) == (int(x[0, t]) if inside else 0), (j, k)
            assert float(slots[0, j, k]) == (1.0 if inside else 0.0), (j, k)


def test_the_first_entry_counts_for_phase_1_when_the_batch_changes_after_one_sample():
    """Batch 4 from sample 0 and 8 from sample 1 (token 32): the first step trains batch 4
    (consumed 0), so both entries belong to phase 1 (N1 = 2: 4 + 8 = 12 samples)."""
    plan = run_plan(_scheduled("0:4 32:8", train_iters=4, tst_phase1_iters=2))
    assert plan.switch_sample == 4 + 8
    assert plan.batches_in_phase(1) == ((0, 4), (1, 8))
    assert plan.batches_in_phase(2) == ((1, 8),)


def test_a_phase_whose_only_step_has_a_batch_as_large_as_its_end_keeps_it():
    """Batch 8 from sample 0 and 16 from sample 8: N1 = 1 step of 8 ends phase 1 at sample 8,
    whose only entry is (0, 8)."""
    plan = run_plan(_scheduled("0:8 256:16", train_iters=3, tst_phase1_iters=1))
    assert plan.switch_sample == 8
    assert plan.batches_in_phase(1) == ((0, 8),)
    assert plan.batches_in_phase(2) == ((8, 16),)


@pytest.mark.parametrize("mode", ["full", "input", "output"])
def test_phase_1_targets_are_int64_and_masks_float32_whatever_comes_in(mode):
    """The documented dtypes (the CE gathers with int64 ids; the MCE weights in float32), from
    int32 labels and a bool mask."""
    from tst_megatron.superposition.bags import phase1_targets

    labels = torch.arange(12, dtype=torch.int32).view(1, 12)
    mask = torch.ones(1, 12, dtype=torch.bool)
    targets, slots = phase1_targets(labels, mask, 3, mode)
    assert targets.dtype == torch.int64 and slots.dtype == torch.float32


def test_output_mode_names_the_shapes_it_needs():
    with pytest.raises(ValueError, match=r"must be the same \[b, T\] shape"):
        following_token_targets(torch.zeros(2, 3), torch.zeros(2, 4), 2)


def test_token_id_checks_name_the_first_bad_id_and_accept_the_edges():
    """``check_token_ids`` (the bag embedding's and the CE's): 0 and V - 1 pass, as does an
    empty tensor and a single id; -1 and V are named (the low one first when both occur);
    float and bool ids are refused by dtype."""
    from tst_megatron.superposition.embedding import check_token_ids

    check_token_ids(torch.tensor([0, 5, 9]), 10)
    check_token_ids(torch.zeros(0, dtype=torch.int64), 10)
    check_token_ids(torch.tensor([0]), 10)
    check_token_ids(torch.tensor([9]), 10)
    cases = {(-1,): "token id -1 is outside", (10,): "token id 10 is outside"}
    cases[(10, -1)] = "token id -1 is outside"
    cases[(-2,)] = "token id -2 is outside"
    cases[(5, 10)] = cases[(0, 10)] = "token id 10 is outside"  # in range low, out high
    for ids, message in cases.items():
        with pytest.raises(ValueError, match=f"^{message} the vocabulary \\[0, 10\\)$"):
            check_token_ids(torch.tensor(ids), 10)
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1.0, 2.0]).half()):
        with pytest.raises(ValueError, match="^target ids must be an integer tensor, got dtype"):
            check_token_ids(bad, 10, what="target id")
