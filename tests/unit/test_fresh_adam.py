"""The MTP parameters' Adam at the switch (:class:`tst_megatron.loop.switch.FreshAdamForMTP`)
on a plain torch ``AdamW``, without Megatron-LM's loop: against a float64 AdamW whose moments
and step count start at the switch, for several betas (beta1 = 0 included), across a resume
(a new optimizer loaded from the old one's state dict, and a new hook), while a parameter that
trains in phase 1 keeps torch's own trajectory bitwise."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

pytest.importorskip("megatron.training")

N1, STEPS, LR, WD, EPS = 7, 20, 1e-2, 0.1, 1e-8


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mtp = torch.nn.Parameter(torch.randn(5, 3))
        self.trunk = torch.nn.Parameter(torch.randn(4))

    def _mtp_only_parameters(self):
        return [self.mtp]


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.0, 0.999), (0.5, 0.9), (0.9, 0.95)])
def test_mtp_updates_are_a_fresh_adam_from_the_switch_and_others_are_untouched(betas):
    from tst_megatron.loop.switch import FreshAdamForMTP

    torch.manual_seed(0)
    b1, b2 = betas
    model = _Model()
    trunk = torch.nn.Parameter(model.trunk.detach().clone())  # trained by a plain AdamW
    plain = torch.optim.AdamW([trunk], lr=LR, betas=betas, weight_decay=WD, eps=EPS)

    def new_optimizer(state=None):
        hook = FreshAdamForMTP(N1)
        hook.watch(lambda: model)()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=betas, weight_decay=WD, eps=EPS)
        if state is not None:
            opt.load_state_dict(state)
        opt.register_step_pre_hook(hook)
        return opt

    opt = new_optimizer()
    ref = model.mtp.detach().double().clone()
    m = v = torch.zeros_like(ref)
    args = SimpleNamespace(curr_iteration=0)
    with mock.patch("megatron.training.get_args", return_value=args):
        for it in range(STEPS):
            if it == N1 + 3:  # a resume: the state dict into a new optimizer and hook
                opt = new_optimizer(opt.state_dict())
            args.curr_iteration = it
            g = torch.zeros(5, 3) if it < N1 else torch.randn(5, 3) * 10 ** torch.randn(1)
            model.mtp.grad = g.clone()
            model.trunk.grad = torch.randn(4)
            trunk.grad = model.trunk.grad.clone()
            opt.step()
            plain.step()
            ref *= 1 - LR * WD  # AdamW's decay, also in phase 1
            if it >= N1:
                k, g = it - N1 + 1, g.double()
                m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
                denom = v.sqrt() / (1 - b2**k) ** 0.5 + EPS
                ref -= LR / (1 - b1**k) * m / denom
            assert torch.isfinite(model.mtp).all(), it
            assert (model.mtp.double() - ref).abs().max() < 1e-6, it
            assert torch.equal(model.trunk, trunk), it


class _NoStorage:
    """Stands in for a DTensor: ``data_ptr()`` is 0, so it can be found by identity only."""

    def __init__(self, main=None):
        if main is not None:
            self.main_param = main

    def data_ptr(self):
        return 0

    def numel(self):
        return 4

    def element_size(self):
        return 4


def test_the_mtp_parameters_are_found_in_every_optimizer_layout():
    """The parameter itself, its ``main_param`` (mixed precision, the distributed optimizer's
    shard copy), views into its memory (the distributed optimizer's fp32 shards, from its
    first byte to its last) and storage-less tensors by identity; not a neighbour's memory."""
    from tst_megatron.loop.switch import FreshAdamForMTP

    buffer = torch.zeros(40)  # one contiguous buffer: the MTP parameter, then another
    mtp, other = torch.nn.Parameter(buffer[:15]), torch.nn.Parameter(buffer[15:])
    mtp.main_param = torch.zeros(15)  # an fp32 copy in memory of its own
    dtensor = _NoStorage(main=_NoStorage())

    class Model:
        def _mtp_only_parameters(self):
            return [mtp, dtensor]

    model = Model()
    hook = FreshAdamForMTP(3)
    hook.watch(lambda: model)()
    first, middle, last = buffer[0:5], buffer[8:12], buffer[14:15]
    neighbour = buffer[15:20]  # starts where the MTP parameter ends
    params = [mtp, other, mtp.main_param, first, middle, last, neighbour, dtensor]
    params.append(dtensor.main_param)
    group = {"params": params}
    found = hook._find(SimpleNamespace(param_groups=[group]))
    want = [mtp, mtp.main_param, first, middle, last, dtensor, dtensor.main_param]
    assert [id(q) for _, q in found] == [id(q) for q in want]
    assert all(g is group for g, _ in found)
