"""MoE load balancing weighs the same in every layout and in both TST phases.

The router gradient of the aux loss and of the z-loss is measured with the main loss
zeroed (``loss * 0``: every other gradient is exactly 0), through the trainer's parts
(``build_gpt_model``, DDP, ``finalize_model_grads`` with per-token loss, megatron-core's
schedule, the forward steps of ``training/forward.py``):

- TP=2 + SP equals TP=1 (megatron-core 0.16-0.18 halves it: it scales by the
  router's local, sequence-parallel token count);
- phase 1 equals phase 2 on the same latent batch (bags of S copies of the
  phase-2 token, so the router sees identical inputs), per position.

Same global weights in every layout: the embedding table is sliced per TP rank, attention's
output projection is zero (so the router input is the normed embedding), the router weight
is replicated.
"""

import zlib

import pytest
import torch

from tests.distributed.harness import run_distributed

V, T, S, B, H, E, M = 64, 8, 4, 2, 16, 4, 2
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
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.training import build_gpt_model
    from tst_megatron.training.forward import make_phase1_step, make_phase2_step
    from tst_megatron.training.trainer import moe_logged_aux_loss

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    tp_rank = ps.get_tensor_model_parallel_rank()
    result = {}
    for case, (aux, z) in CASES.items():
        for phase in (1, 2):
            set_seed(1)
            config = TransformerConfig(
                num_layers=1,
                hidden_size=H,
                num_attention_heads=2,
                ffn_hidden_size=32,
                num_moe_experts=E,
                moe_router_topk=2,
                moe_ffn_hidden_size=16,
                moe_aux_loss_coeff=aux,
                moe_z_loss_coeff=z,
                normalization="RMSNorm",
                add_bias_linear=False,
                tensor_model_parallel_size=world,
                sequence_parallel=world > 1,
                use_cpu_initialization=True,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                calculate_per_token_loss=True,
            )
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
            logged = moe_logged_aux_loss(num_layers=1, num_microbatches=M)
            result[case, phase] = {
                "router": [g for n, g in grads.items() if "router" in n][0],
                "logged": logged,
            }
    return result


@pytest.fixture(scope="module")
def layouts():
    return {
        1: run_distributed(_router_grads_child, 1)[0],
        2: run_distributed(_router_grads_child, 2),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_balancing_gradient_tp2_sp_equals_tp1(layouts, case):
    """Aux and z-loss router gradients independent of TP/SP (ratio 1.0000)."""
    ref = layouts[1][case, 2]["router"]
    assert ref.abs().max() > 0
    for rank in layouts[2]:
        grad = rank[case, 2]["router"]
        ratio = (grad * ref).sum() / (ref * ref).sum()
        assert round(ratio.item(), 4) == 1.0, f"{case}: TP=2+SP / TP=1 = {ratio.item():.4f}"
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_balancing_gradient_per_position_equal_in_both_phases(layouts, case):
    """Same latent batch, main loss zeroed: phase 1 equals phase 2 (ratio 1.0000),
    at TP=1 and at TP=2 + SP."""
    for tp, ranks in layouts.items():
        for r in ranks if tp == 2 else [ranks]:
            p1, p2 = r[case, 1]["router"], r[case, 2]["router"]
            assert p2.abs().max() > 0
            ratio = (p1 * p2).sum() / (p2 * p2).sum()
            assert round(ratio.item(), 4) == 1.0, (
                f"TP={tp} {case}: phase 1 / 2 = {ratio.item():.4f}"
            )
            torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_logged_balancing_loss_tp2_sp_equals_tp1(layouts, case):
    """The logged value: ``moe aux loss`` at TP=2 + SP equals TP=1 on every rank
    (megatron-core <= 0.18 logs the z-loss as each rank's mean over its half of the tokens)."""
    ref = layouts[1][case, 2]["logged"]
    assert ref > 0
    for rank in layouts[2]:
        assert rank[case, 2]["logged"] == pytest.approx(ref, rel=1e-5), case
