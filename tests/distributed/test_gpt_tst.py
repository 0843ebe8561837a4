"""A megatron-core GPTModel (local spec, MoE, 2 layers) driven through TST's seams on the
CPU runtime: ``bag_embedding`` -> ``decoder_input``, ``labels=[b, T, S]`` -> per-slot CE
from the model's loss seam (``TSTGPTModel``) -> MCE, forward and backward, with EP=2 (alltoall
dispatcher) and PP=2 (1F1B schedule) on 2 gloo processes, every gradient compared with the
1-process result of the same weights and data. MoE under TP=2 + SP through the switch:
``test_megatron_lm_layouts.py``.
"""

import zlib

import pytest
import torch

from tests.distributed.harness import run_distributed

V, T, S, B, LAYERS, EXPERTS = 64, 8, 4, 2, 2, 4
MICRO_BATCHES = 2


def _config(tp=1, pp=1, ep=1, dispatcher="alltoall"):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_dtype=torch.float32,
    )


def _global_name(name, pp_rank, ep_rank):
    """Local parameter name -> name in the unsplit (1-process) model."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + pp_rank * LAYERS // 2)
    if "local_experts" in parts:
        i = parts.index("local_experts") + 1
        parts[i] = str(int(parts[i]) + ep_rank * EXPERTS // 2)
    return ".".join(parts)


def _set_weights(model, pp_rank=0, ep_rank=0):
    """Deterministic weights keyed by the global name, so every layout holds the same model."""
    names = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            gname = _global_name(name, pp_rank, ep_rank)
            g = torch.Generator().manual_seed(zlib.crc32(gname.encode()))
            base = 1.0 if "norm" in gname else 0.0
            param.copy_(base + 0.08 * torch.randn(param.shape, generator=g))
            names[name] = gname
    return names


def _batch(index):
    g = torch.Generator().manual_seed(100 + index)
    tokens = torch.randint(0, V, (B, S * T + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:], torch.ones(B, S * T)


def _mce(model, batch, tp_group):
    """Phase 1 through the model's loss seam: ``labels=[b, T, S]`` -> per-slot CE -> MCE."""
    from tst_megatron.superposition import (
        align_bag_targets,
        bag_embedding,
        bag_weights,
        fold_bags,
        multi_hot_cross_entropy,
    )

    tokens, labels, loss_mask = batch
    x = bag_embedding(model.embedding, fold_bags(tokens, S)) if model.pre_process else None
    targets, mask = align_bag_targets(labels, loss_mask, S)
    out = model(None, None, None, decoder_input=x, labels=targets)

    def loss_func(per_slot_ce):
        loss_sum, weight_sum = multi_hot_cross_entropy(per_slot_ce, mask, bag_weights(S))
        loss = loss_sum / weight_sum
        return loss, {"mce": loss.detach()}

    return out, loss_func


def _model_child(rank, world, *, tp, pp, ep, dispatcher, batches):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.distributed.harness import build_gpt_model
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed

    initialize_model_parallel(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
        )
    )
    set_seed(7)
    model = build_gpt_model(
        _config(tp, pp, ep, dispatcher),
        vocab_size=V,
        max_sequence_length=T,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    names = _set_weights(
        model, ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    )
    tp_group = ps.get_tensor_model_parallel_group()
    data = iter([_batch(i) for i in batches[ps.get_data_parallel_rank()]])

    def forward_step(data_iterator, model):
        return _mce(model, next(data_iterator), tp_group)

    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=[model],
        num_microbatches=len(batches[0]),
        seq_length=T,
        micro_batch_size=B,
        forward_only=False,
    )
    grads = {names[n]: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": [d["mce"] for d in losses], "grads": grads}


def _reference(batch_lists):
    """1 process: the unsplit model, each batch's MCE / (#batches in its list), summed grads."""
    return run_distributed(
        _model_child, 1, tp=1, pp=1, ep=1, dispatcher="alltoall", batches=batch_lists
    )[0]


@pytest.mark.slow
def test_pp2_matches_one_process():
    ranks = run_distributed(
        _model_child, 2, tp=1, pp=2, ep=1, dispatcher="alltoall", batches=[[0, 1]]
    )
    ref = _reference([[0, 1]])
    assert ranks[0]["losses"] == []  # first stage computes no loss
    torch.testing.assert_close(torch.stack(ranks[1]["losses"]), torch.stack(ref["losses"]))
    merged = {**ranks[0]["grads"], **ranks[1]["grads"]}
    assert merged.keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_ep2_matches_one_process():
    # EP=2 on 2 ranks: DP=2 for dense weights, experts split. Rank r gets batch r. The
    # allgather dispatcher (Megatron-LM's default) at EP=2: every parameter's step in
    # test_megatron_lm_moe.py
    ranks = run_distributed(
        _model_child, 2, tp=1, pp=1, ep=2, dispatcher="alltoall", batches=[[0], [1]]
    )
    refs = [_reference([[0]]), _reference([[1]])]
    for r in range(2):
        torch.testing.assert_close(ranks[r]["losses"][0], refs[r]["losses"][0])
        for name, grad in ranks[r]["grads"].items():
            if "local_experts" in name:  # experts see both ranks' tokens
                expected = refs[0]["grads"][name] + refs[1]["grads"][name]
            else:  # dense weights: this rank's batch only (DDP would average them)
                expected = refs[r]["grads"][name]
            torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6, msg=name)
