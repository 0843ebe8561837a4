"""MoE inside Megatron-LM's own loop (:mod:`tst_megatron.training`): expert
gradients in every expert layout, biases, and the load-balancing losses' gradients.

**Expert layouts.** An expert's gradient is the sum over the ranks that run it on some
tokens. megatron-core reduces an expert parameter over the data-parallel group when it is
tagged ``allreduce``, else over the expert data-parallel group, and sums a parameter tagged
``sequence_parallel`` over the TP group as well. Three layouts went wrong silently:

- expert-TP 1 < TP 2, EP 1 (``--expert-tensor-parallel-size 1`` under
  ``--tensor-model-parallel-size 2 --sequence-parallel``): each TP rank holds every expert
  whole and runs it on its own ``T/tp`` positions; megatron-core 0.16.1 tagged the experts
  for the DP group (size 1 here), so the two replicas kept half a gradient each and drifted;
- the same layout with biases: megatron-core (0.16.1 and 0.19) also sums the experts'
  second-layer bias over TP, on top of the expert-DP sum (twice the gradient on 0.19);
- TP 2 + SP with EP 2 and biases: that TP sum adds the bias gradient of *another* expert
  (the one the TP peer holds at the same local index).

Each layout loads the 1-process run's iteration-1 checkpoint and takes one phase-1 step with
plain SGD (no momentum, weight decay or clipping), so the step each weight takes is
``-lr * gradient``: the torch_dist checkpoint it saves at iteration 2 (the switch) must hold
the 1-process step of every parameter to float32 round-off, then it trains on through the
switch (MoE with biases on 1 and 2 expert ranks).

**Balancing losses.** The router gradient of the aux loss and of the z-loss, measured with
the main loss zeroed, is the same at TP = 2 + SP as at TP = 1 (megatron-core 0.16-0.18
halved it) and the same per position in both TST phases. Megatron-LM's logged value of
both losses is checked against one process in ``test_megatron_lm_layouts.py``.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

pytest.importorskip("megatron.training")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.launcher import pretrain_child_keep_going as _pretrain_child  # noqa: E402
from tests.launcher import scalars as _scalars  # noqa: E402

E, F = 4, 12  # experts, expert FFN width
#: a tiny MoE GPT, biases on (Megatron-LM's default); the switch after 2 of 4 iterations
MOE = [
    "--device", "cpu", "--mock-data", "--tokenizer-type", "NullTokenizer",
    "--vocab-size", "128", "--make-vocab-size-divisible-by", "64",
    "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
    "--seq-length", "8", "--max-position-embeddings", "8", "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--num-experts", str(E), "--moe-ffn-hidden-size", str(F), "--moe-router-topk", "2",
    "--moe-aux-loss-coeff", "1e-2",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
    "--tst-bag-size", "2", "--tst-phase1-iters", "2",
    "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100", "--num-workers", "0",
]  # fmt: skip
#: plain SGD at a constant rate: a parameter's step is ``-LR * gradient``
LR = 0.1
SGD = [
    "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0", "--clip-grad", "0",
    "--lr", str(LR), "--lr-decay-style", "constant", "--ckpt-format", "torch_dist",
]  # fmt: skip
NO_BIAS = ["--disable-bias-linear"]

TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
EXPERT_LAYOUTS = {  # name: (flags, biases)
    "etp1_tp2_bias": (TP2 + ["--expert-tensor-parallel-size", "1"], True),
    "etp1_tp2_ep2_bias": (
        TP2 + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"],
        True,
    ),
    "etp2_tp1_dp2": (["--expert-tensor-parallel-size", "2"] + NO_BIAS, False),
}


def _weights(path) -> dict:
    """``{key: tensor}`` of a torch_dist checkpoint directory (Megatron-LM's global,
    layout-independent keys), read whole in this process with PyTorch's own converter."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/state.pt")
        state = torch.load(f"{tmp}/state.pt", weights_only=False)
    return {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not k.startswith("optimizer") and "_extra_state" not in k
    }


def _steps(path) -> dict:
    """``{key: weight at iteration 2 - weight at iteration 1}`` (float64) of a save directory."""
    one, two = _weights(f"{path}/iter_0000001"), _weights(f"{path}/iter_0000002")
    assert sorted(one) == sorted(two)
    return {k: two[k].double() - one[k].double() for k in one}


@pytest.fixture(scope="module")
def expert_runs(tmp_path_factory):
    """The 1-process runs (with and without biases) saving at 1, 2 (the switch) and 4, and one
    spawn of 2 processes running each expert layout from their iteration 1 through the switch.
    ``{run: (printed by the last rank, TensorBoard scalars, save directory)}``."""
    root = tmp_path_factory.mktemp("experts")

    def argv(run, flags):
        return MOE + SGD + flags + [
            "--save", str(root / run), "--tensorboard-dir", str(root / f"tb_{run}"),
        ]  # fmt: skip

    refs = {
        "bias": argv("bias", ["--save-interval", "1"]),
        "no_bias": argv("no_bias", NO_BIAS + ["--save-interval", "1"]),
    }
    ((*printed,),) = run_distributed(_pretrain_child, 1, runs=list(refs.values()))
    out = {run: (printed[i], root / run) for i, run in enumerate(refs)}
    layouts = {}
    for name, (flags, bias) in EXPERT_LAYOUTS.items():
        ref = "bias" if bias else "no_bias"
        # the reference's iterations 1 (to load) and 2 (to compare), in a directory of its own
        (root / name).mkdir()
        (root / name / "iter_0000001").symlink_to(root / ref / "iter_0000001")
        (root / name / "latest_checkpointed_iteration.txt").write_text("1")
        layouts[name] = argv(  # saves at the switch (2) and at the end (4)
            name,
            flags
            + ["--load", str(root / name), "--no-load-rng", "--save-interval", "100"]
            # plain SGD has no state; Megatron-LM's state of 1 expert rank does not load on
            # 2 ("Expected 2 entries in state dict, but got 4")
            + ["--no-load-optim"],
        )
    first, last = run_distributed(_pretrain_child, 2, runs=list(layouts.values()))
    out.update({run: (last[i], root / run) for i, run in enumerate(layouts)})
    return {
        run: (text, _scalars(str(path.parent / f"tb_{run}")), path)
        for run, (text, path) in out.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(EXPERT_LAYOUTS))
def test_expert_layout_steps_equal_one_process(layout, expert_runs):
    """The step of every parameter (experts, their biases, router, the rest) after one
    phase-1 step from the same weights equals the 1-process step: the reduced gradients."""
    bias = EXPERT_LAYOUTS[layout][1]
    _, _, ref = expert_runs["bias" if bias else "no_bias"]
    text, _, path = expert_runs[layout]
    assert (path / "iter_0000002").is_dir(), text[-3000:]
    want, got = _steps(ref), _steps(path)
    assert sorted(got) == sorted(want)
    experts = [k for k in want if ".mlp.experts." in k]
    assert len(experts) >= (4 if bias else 2), sorted(want)  # fc1, fc2 (and their biases)
    for key in want:
        if key in experts:
            assert want[key].abs().max() > 0, key  # the experts received tokens
        torch.testing.assert_close(
            got[key],
            want[key],
            rtol=1e-4,
            atol=1e-7,  # a few float32 ulps of the weights, which the steps are read from
            msg=lambda text, key=key: f"{layout}, {key}: {text}",
        )


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bias", "etp1_tp2_bias", "etp1_tp2_ep2_bias"])
def test_moe_with_biases_trains_through_the_switch(layout, expert_runs):
    """MoE with biases on 1 and on 2 expert ranks: both phases, finite losses, the phase-2
    losses of the layouts equal to the 1-process run's."""
    text, tb, _ = expert_runs[layout]
    first = 1 if layout == "bias" else 2
    assert sorted(tb.get("mce loss", {})) == list(range(first, 3)), text[-3000:]
    assert sorted(tb["lm loss"]) == [3, 4]
    assert all(math.isfinite(v) for v in (*tb["mce loss"].values(), *tb["lm loss"].values()))
    ref = expert_runs["bias"][1]["lm loss"]
    for i in (3, 4):
        assert tb["lm loss"][i] == pytest.approx(ref[i], rel=1e-5), (layout, i)


# --- MoE layer with biases against a float64 reference ---------------------------------------


def _layer_child(rank, world):
    """The MoE layer of the launcher's model (its model provider, local spec, biases on)
    with non-zero biases: one forward and backward with a random upstream gradient."""
    from megatron.core import mpu, tensor_parallel

    from tst_megatron.models.family import GPT
    from tst_megatron.training.validate import check_and_set_up

    check_and_set_up(MOE + ["--lr", "1e-3"])
    mpu.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    torch.manual_seed(3)
    model = GPT.model_provider()
    moe = model.decoder.layers[0].mlp
    with torch.no_grad():  # non-zero biases, so a missing or doubled bias shows
        if getattr(moe.router, "bias", None) is not None:
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
    router_bias = getattr(moe.router, "bias", None)
    return {
        "x": x.detach(),
        "out": out.detach(),
        "bias": bias,
        "upstream": upstream,
        "dx": x.grad,
        "db2": [e.linear_fc2.bias.grad.clone() for e in moe.experts.local_experts],
        "router": (
            moe.router.weight.detach().double(),
            None if router_bias is None else router_bias.detach().double(),
        ),
        "experts": experts,
    }


def _reference(x, router, experts, topk=2):
    """Plain float64 MoE: router logits ``Wr x (+ br)``, softmax over the top k, each chosen
    expert ``p * (W2 swiglu(W1 x + b1) + b2)``, summed (megatron-core's default routing)."""
    tokens = x.reshape(-1, x.shape[-1])
    logits = tokens @ router[0].T + (0 if router[1] is None else router[1])
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


@pytest.mark.slow
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


# --- balancing-loss gradients: TP = 2 + SP vs TP = 1, phase 1 vs phase 2 ----------------------

V, T, S, B, H, M = 64, 8, 4, 2, 16, 2
CASES = {"aux": (1e-2, None), "z": (0.0, 1e-2)}


def _global(name, shape):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def _tokens():
    g = torch.Generator().manual_seed(23)
    return [torch.randint(0, V, (B, T + 1), generator=g) for _ in range(M)]


def _batches(phase):
    """Phase 2: ``T``-token samples. Phase 1: each token repeated ``S`` times (a bag of S
    copies embeds exactly as the token itself), so the latent batch is the phase-2 batch."""
    out = []
    for x in _tokens():
        if phase == 2:
            out.append(
                {
                    "tokens": x[:, :T],
                    "labels": x[:, 1:],
                    "loss_mask": torch.ones(B, T),
                    "position_ids": torch.arange(T).expand(B, T),
                    "attention_mask": None,
                }
            )
        else:
            long = x.repeat_interleave(S, dim=1)[:, : S * T + 1]
            out.append(
                {"tokens": long[:, :-1], "labels": long[:, 1:], "loss_mask": torch.ones(B, S * T)}
            )
    return out


def _zero_main_loss(forward_step):
    def step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)

        def zeroed(out):
            loss, num_tokens, report = loss_func(out)
            return loss * 0.0, num_tokens, report

        return output, zeroed

    return step


def _router_grads_child(rank, world):
    """The router gradient of the balancing losses alone (main loss zeroed) through the
    forward steps the launcher uses (:mod:`tst_megatron.loop.forward`), megatron-core's
    DDP, schedule and ``finalize_model_grads`` with per-token loss. The same global weights
    in every layout: the embedding table sliced per TP rank, attention's output projection
    zero (so the router input is the normed embedding), the router weight replicated."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.distributed.harness import build_gpt_model, small_config
    from tst_megatron.loop.forward import make_phase1_step, make_phase2_step
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    tp_rank = ps.get_tensor_model_parallel_rank()
    result = {}
    for case, (aux, z) in CASES.items():
        for phase in (1, 2):
            set_seed(1)
            balancing = dict(moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
            config = small_config(num_layers=1, hidden_size=H, experts=E, tp=world, **balancing)
            model = build_gpt_model(config, vocab_size=V, max_sequence_length=T)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "word_embeddings" in name:
                        rows = V // world
                        param.copy_(_global(name, (V, H))[tp_rank * rows : (tp_rank + 1) * rows])
                    elif "router" in name:
                        param.copy_(_global(name, param.shape))
                    elif "linear_proj" in name:
                        param.zero_()
                    elif "norm" in name:
                        param.fill_(1.0)
            ddp = DistributedDataParallel(
                config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
            )
            config.finalize_model_grads_func = finalize_model_grads
            ddp.zero_grad_buffer()
            step = (
                make_phase1_step(bag_size=S, weighting="uniform")
                if phase == 1
                else make_phase2_step(cp_group=ps.get_context_parallel_group())
            )
            get_forward_backward_func()(
                forward_step_func=_zero_main_loss(step),
                data_iterator=iter(_batches(phase)),
                model=[ddp],
                num_microbatches=M,
                seq_length=T,
                micro_batch_size=B,
                forward_only=False,
            )
            grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
            result[case, phase] = [g for n, g in grads.items() if "router" in n][0]
    return result


@pytest.fixture(scope="module")
def router_grads():
    return {
        1: run_distributed(_router_grads_child, 1)[0],
        2: run_distributed(_router_grads_child, 2),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_balancing_gradient_tp2_sp_equals_tp1(router_grads, case):
    """Aux and z-loss router gradients independent of TP/SP (ratio 1.0000)."""
    ref = router_grads[1][case, 2]
    assert ref.abs().max() > 0
    for rank in router_grads[2]:
        grad = rank[case, 2]
        ratio = (grad * ref).sum() / (ref * ref).sum()
        assert round(ratio.item(), 4) == 1.0, f"{case}: TP=2+SP / TP=1 = {ratio.item():.4f}"
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_balancing_gradient_per_position_equal_in_both_phases(router_grads, case):
    """Same latent batch, main loss zeroed: phase 1 equals phase 2 (ratio 1.0000),
    at TP=1 and at TP=2 + SP."""
    for tp, ranks in router_grads.items():
        for r in ranks if tp == 2 else [ranks]:
            p1, p2 = r[case, 1], r[case, 2]
            assert p2.abs().max() > 0
            ratio = (p1 * p2).sum() / (p2 * p2).sum()
            assert round(ratio.item(), 4) == 1.0, (
                f"TP={tp} {case}: phase 1 / 2 = {ratio.item():.4f}"
            )
            torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-9)
