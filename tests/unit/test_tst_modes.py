"""The phase-1 superposition modes (``--tst-mode``): inputs, targets, weights,
data length, and configuration, against plain references written from the token sequence."""

import pytest
import torch

from tst_megatron.superposition.bags import (
    following_token_targets,
    phase1_inputs,
    phase1_targets,
    phase1_weights,
)
from tst_megatron.superposition.schedule import Schedule, TSTConfig

S, T, B = 3, 5, 2


def _sample(length, seed=0):
    """x: [b, length + 1] tokens; tokens, labels (x shifted), a loss mask with holes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (B, length + 1), generator=g)
    mask = (torch.rand(B, length, generator=g) > 0.25).float()
    return x, x[:, :-1], x[:, 1:], mask


def _reference_targets(x, mask, mode):
    """Written from the definitions: returns per position j a list of (target, mask) slots."""
    out = []
    for b in range(B):
        rows = []
        for j in range(T):
            slots = []
            if mode in ("full", "input"):
                for k in range(S if mode == "full" else 1):
                    i = (j + 1) * S + k  # x index of the target
                    ok = i <= S * T  # x has S*T + 1 tokens
                    slots.append((int(x[b, i]) if ok else 0, float(mask[b, i - 1]) if ok else 0.0))
            else:  # output: position j holds token x[j], targets x[j+1+k]
                for k in range(S):
                    i = j + 1 + k
                    ok = i <= T
                    slots.append((int(x[b, i]) if ok else 0, float(mask[b, i - 1]) if ok else 0.0))
            rows.append(slots)
        out.append(rows)
    return out


@pytest.mark.parametrize("mode", ["full", "input", "output"])
def test_inputs_and_targets_follow_the_definitions(mode):
    length = T if mode == "output" else S * T
    x, tokens, labels, mask = _sample(length, seed={"full": 1, "input": 2, "output": 3}[mode])
    bags = phase1_inputs(tokens, S, mode)
    targets, tmask = phase1_targets(labels, mask, S, mode)
    k = 1 if mode == "input" else S
    assert bags.shape == (B, T, 1 if mode == "output" else S)
    assert targets.shape == tmask.shape == (B, T, k)
    assert targets.dtype == torch.int64 and tmask.dtype == torch.float32
    for b in range(B):
        for j in range(T):
            if mode == "output":
                assert bags[b, j].tolist() == [int(x[b, j])]
            else:
                assert bags[b, j].tolist() == [int(x[b, j * S + m]) for m in range(S)]
    ref = _reference_targets(x, mask, mode)
    got = [
        [list(zip(targets[b, j].tolist(), tmask[b, j].tolist())) for j in range(T)]
        for b in range(B)
    ]
    assert got == ref


def test_output_mode_last_positions_lose_slots_and_s1_is_next_token():
    labels = torch.arange(1, T + 1).repeat(B, 1)
    targets, mask = following_token_targets(labels, torch.ones(B, T), S)
    assert mask[0].sum(dim=-1).tolist() == [3, 3, 3, 2, 1]
    assert targets[0, -2].tolist() == [T - 1, T, 0]
    one, one_mask = following_token_targets(labels, torch.ones(B, T), 1)
    assert torch.equal(one[..., 0], labels) and bool(one_mask.all())
    with pytest.raises(ValueError, match=r"same \[b, T\] shape"):
        following_token_targets(labels, torch.ones(B, T + 1), S)


def test_weights_per_mode():
    assert torch.equal(phase1_weights(S, "uniform", "input"), torch.ones(1))
    torch.testing.assert_close(phase1_weights(S, "uniform", "output"), torch.full((S,), 1 / S))
    power = torch.tensor([1.0, 1 / 2, 1 / 3])
    torch.testing.assert_close(phase1_weights(S, "power", "full"), power / power.sum())
    with pytest.raises(ValueError, match="unknown TST mode 'both'"):
        phase1_inputs(torch.zeros(B, S * T, dtype=torch.long), S, "both")


def test_schedule_reads_t_tokens_in_output_mode():
    for mode, data in (("full", S * T), ("input", S * T), ("output", T)):
        tst = TSTConfig(bag_size=S, phase1_iters=2, mode=mode)
        tst.validate(10)
        plan = Schedule.plan(tst, seq_length=T, train_iters=10)
        assert plan.phase1.data_seq_length == data and plan.phase1.model_seq_length == T
        assert plan.phase2.data_seq_length == T and plan.n1 == 2
        assert tst.windows_per_sample() == data // T


def test_mode_configuration_errors(capsys):
    import argparse

    from tst_megatron.loop.plan import tst_config
    from tst_megatron.training.flags import add_tst_args

    assert TSTConfig(bag_size=1, mode="output").validate(10) == [
        "--tst-mode output needs --tst-bag-size > 1 (S = 1 has no phase 1)"
    ]
    assert TSTConfig(bag_size=2, mode="output").validate(10) == []
    parser = add_tst_args(argparse.ArgumentParser())
    assert tst_config(parser.parse_args(["--tst-bag-size", "2", "--tst-mode", "input"])).mode == (
        "input"
    )
    assert tst_config(parser.parse_args([])).mode == "full"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tst-mode", "both"])
    assert "argument --tst-mode: invalid choice: 'both'" in capsys.readouterr().err
