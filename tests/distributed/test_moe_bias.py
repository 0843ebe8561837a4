"""MoE with biases (Megatron-LM's default: no --disable-bias-linear) trains.

megatron-core's expert MLP adds the probability-scaled fc2 bias in place; at expert TP =
EP = 1 the fc2 output was a view of an identity autograd function and the first step
raised "... is a view and is being modified inplace". The MoE layer of the trainer's model
must now match a plain float64 reference written from its weights, forward and backward.
"""

import pytest
import torch

from tests.defaults import TEST_DEFAULTS
from tests.distributed.harness import run_distributed

ARGV = [
    *TEST_DEFAULTS,
    "--mock-data",
    "--vocab-size",
    "128",
    "--make-vocab-size-divisible-by",
    "64",
    "--num-layers",
    "2",
    "--hidden-size",
    "16",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "8",
    "--swiglu",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "12",
    "--moe-router-topk",
    "2",
    "--micro-batch-size",
    "2",
    "--train-iters",
    "2",
    "--tst-bag-size",
    "2",
    "--tst-phase1-iters",
    "1",
    "--hidden-dropout",
    "0",
    "--attention-dropout",
    "0",
    "--device",
    "cpu",
    "--log-interval",
    "1",
]


def _layer_child(rank, world):
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.training.config import parse_args
    from tst_megatron.training.model import build_model, transformer_config

    initialize_model_parallel(ParallelConfig())
    set_seed(3)
    cfg = parse_args(ARGV)
    model = build_model(cfg, transformer_config(cfg, use_cpu_initialization=True), vocab_size=128)
    moe = model.decoder.layers[0].mlp
    with torch.no_grad():  # non-zero biases, so a missing or doubled bias shows
        moe.router.bias.normal_(std=0.1)
        for expert in moe.experts.local_experts:
            expert.linear_fc1.bias.normal_()
            expert.linear_fc2.bias.normal_()
    x = torch.randn(8, 2, 16, requires_grad=True)  # [s, b, h]
    out, bias = moe(x)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    experts = [
        {
            name: p.detach().double()
            for name, p in (
                ("w1", e.linear_fc1.weight),
                ("b1", e.linear_fc1.bias),
                ("w2", e.linear_fc2.weight),
                ("b2", e.linear_fc2.bias),
            )
        }
        for e in moe.experts.local_experts
    ]
    return {
        "x": x.detach(),
        "out": out.detach(),
        "bias": bias,
        "upstream": upstream,
        "dx": x.grad,
        "db2": [e.linear_fc2.bias.grad.clone() for e in moe.experts.local_experts],
        "router": (moe.router.weight.detach().double(), moe.router.bias.detach().double()),
        "experts": experts,
    }


def _reference(x, router, experts, topk=2):
    """Plain float64 MoE: router logits ``Wr x + br``, softmax over the top k, each chosen
    expert ``p * (W2 swiglu(W1 x + b1) + b2)``, summed (megatron-core's default routing)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router[0].T + router[1]
    top, index = logits.topk(topk, dim=-1)
    probs = torch.softmax(top, dim=-1)
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(topk):
            e = experts[int(index[t, j])]
            a = e["w1"] @ tokens[t] + e["b1"]
            gate, linear = a.chunk(2)
            y = e["w2"] @ (torch.nn.functional.silu(gate) * linear) + e["b2"]
            out[t] += probs[t, j] * y
    return out.reshape(x.shape)


def test_moe_layer_with_biases_matches_float64_reference():
    (r,) = run_distributed(_layer_child, 1)
    assert r["bias"] is None  # the expert bias is inside the output, not handed back
    x = r["x"].double().requires_grad_()
    b2 = [e["b2"].clone().requires_grad_() for e in r["experts"]]
    experts = [dict(e, b2=b) for e, b in zip(r["experts"], b2)]
    ref = _reference(x, r["router"], experts)
    torch.testing.assert_close(r["out"].double(), ref, rtol=1e-5, atol=1e-5)
    (ref * r["upstream"].double()).sum().backward()
    torch.testing.assert_close(r["dx"].double(), x.grad, rtol=1e-4, atol=1e-5)
    for got, want in zip(r["db2"], b2):
        expected = torch.zeros_like(want) if want.grad is None else want.grad  # no token routed
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def _train_child(rank, world, *, argv):
    from tst_megatron.training import trainer
    from tst_megatron.training.config import parse_args

    return trainer.train(parse_args(argv))


@pytest.mark.slow
def test_moe_with_biases_trains_through_the_switch_on_one_and_two_expert_ranks():
    (one,) = run_distributed(_train_child, 1, argv=ARGV)
    two = run_distributed(_train_child, 2, argv=ARGV + ["--expert-model-parallel-size", "2"])
    for history in [one] + two:
        assert sorted(history["train"]) == [1, 2]
        assert all(torch.isfinite(torch.tensor(v)) for v in history["train"].values())
