"""megatron-core 0.19 scales the MoE aux loss and z-loss by the TP x CP group size itself.

With per-token loss (``calculate_per_token_loss``, always on in this project) the router
attaches each balancing loss for backward scaled by the tokens the loss function counts, so
that ``finalize_model_grads``' division by the global token count leaves the TP=1 gradient.
Under sequence or context parallelism the router sees ``1/(TP*CP)`` of those tokens; up to
megatron-core 0.18 it used its local count (the balancing gradient shrank by TP x CP), which
the project corrected with a router of its own. This test is why that router is gone: it
reads what ``TopKRouter`` attaches on a stub with 3 local tokens and a TP x CP group of 2.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from megatron.core.transformer.moe.router import TopKRouter

TOKENS, GROUP = 3, 2


class _SizeOnlyGroup:
    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


@dataclasses.dataclass
class _Config:
    num_layers: int = 1
    mtp_num_layers: Optional[int] = None
    mtp_use_repeated_layer: bool = False
    moe_z_loss_coeff: float = 1.0


def _stub_router() -> TopKRouter:
    router = TopKRouter.__new__(TopKRouter)
    torch.nn.Module.__init__(router)
    router.config = _Config()
    router.layer_number = None  # megatron-core skips its logging for it
    router.is_mtp_layer = False
    router.calculate_per_token_loss = True
    router.tp_cp_group = _SizeOnlyGroup(GROUP)
    router.tp_dp_cp_group = _SizeOnlyGroup(GROUP)
    router.training = True
    return router


def test_the_aux_loss_is_scaled_by_the_tokens_of_the_whole_tp_cp_group():
    with torch.enable_grad():
        aux = torch.tensor(1.0, requires_grad=True)
        out = _stub_router().attach_and_log_load_balancing_loss(
            torch.zeros(TOKENS, 2, requires_grad=True), 1.0, aux, "probe", None,
            valid_token_count=TOKENS,
        )  # fmt: skip
    assert float(out.grad_fn.saved_tensors[0].detach()) == TOKENS * GROUP  # 0.18: TOKENS


def test_the_z_loss_is_scaled_by_the_tokens_of_the_whole_tp_cp_group():
    logits = torch.randn(TOKENS, 2, generator=torch.Generator().manual_seed(0))
    with torch.enable_grad():
        out = _stub_router().apply_z_loss(logits.clone().requires_grad_())
    # the z-loss of these local logits at coefficient 1 / GROUP: megatron-core averages the
    # TP x CP ranks' local z-losses (it divides the coefficient by the group size)
    z_loss = float(torch.logsumexp(logits.double(), -1).square().mean()) / GROUP
    attached = float(out.grad_fn.saved_tensors[0].detach())
    assert abs(attached / z_loss - TOKENS * GROUP) < 1e-5  # 0.18 and before: TOKENS
