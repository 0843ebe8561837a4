"""The TST core at TP = 2 x DP = 2 (4 gloo processes, one spawn): each data-parallel replica
embeds its own bags and scores its own logits, and every result and gradient equals the
1-process float64 reference of that replica's data. With TP = 2 alone (every other
distributed test) the world and the tensor-parallel group are the same, so a collective sent
to the world instead of the TP group passes there; here it mixes the replicas and fails."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.distributed.harness import run_distributed, tp_layer_config
from tests.distributed.test_core_tp import B, H, K, T, V, _bags, _ce_inputs, _tables, _upstream

BAG = 3


def _child(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.superposition import (
        bag_embedding,
        bag_weights,
        multi_hot_cross_entropy,
        vocab_parallel_multi_target_cross_entropy,
    )
    from tst_megatron.superposition.chunked_loss import chunked_output_cross_entropy

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=2))
    tp, group = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_group()
    replica = ps.get_data_parallel_rank()
    seed = 100 + replica  # each replica its own data
    set_seed(seed)
    shard = V // 2
    out = {"replica": replica, "tp": tp}

    # the bag embedding (sequence parallel: each TP rank holds half the positions)
    config = tp_layer_config(2, hidden_size=H, sequence_parallel=True)
    emb = LanguageModelEmbedding(
        config, vocab_size=V, max_sequence_length=T, position_embedding_type="rope"
    )
    word, _ = _tables(seed)
    with torch.no_grad():
        emb.word_embeddings.weight.copy_(word[tp * shard : (tp + 1) * shard])
    hidden = bag_embedding(emb, _bags(seed, BAG))
    hidden.backward(_upstream(seed, (T, B, H)).float().chunk(2, dim=0)[tp])
    out.update(embedded=hidden.detach(), word_grad=emb.word_embeddings.weight.grad.clone())

    # the multi-target CE and the MCE (power weights) on this replica's logits
    logits, targets, mask, grad = _ce_inputs(seed)
    local = logits[..., tp * shard : (tp + 1) * shard].float().contiguous().requires_grad_(True)
    ce = vocab_parallel_multi_target_cross_entropy(local, targets, tp_group=group)
    loss_sum, weight_sum = multi_hot_cross_entropy(ce, mask, bag_weights(K, "power"))
    (loss_sum / weight_sum).backward()
    out.update(ce=ce.detach(), mce=(loss_sum / weight_sum).detach(), ce_grad=local.grad.clone())

    # the chunked output layer + CE (--tst-loss-chunks): hidden [T, B, H], weight [V/tp, H]
    g = torch.Generator().manual_seed(seed + 7)
    h = torch.randn(T, B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    local_h = h.clone().requires_grad_(True)
    local_w = w[tp * shard : (tp + 1) * shard].clone().requires_grad_(True)
    chunked = chunked_output_cross_entropy(
        local_h, local_w, targets.transpose(0, 1).contiguous(), chunks=3, tp_group=group
    )
    chunked.backward(grad.transpose(0, 1))
    out.update(chunked=chunked.detach(), h_grad=local_h.grad, w_grad=local_w.grad)
    return out


def _references(seed):
    """Float64, one process, stock ops: the embedding of the bags, the per-slot CE and MCE of
    the logits, and the output layer + CE of the chunked case."""
    word, _ = _tables(seed)
    word.requires_grad_(True)
    embedded = F.embedding(_bags(seed, BAG), word).mean(dim=2).transpose(0, 1)  # [T, B, H]
    embedded.backward(_upstream(seed, (T, B, H)).float().double())
    logits, targets, mask, grad = _ce_inputs(seed)
    logits = logits.float().double().requires_grad_(True)
    per_slot = torch.stack(
        [
            F.cross_entropy(logits.reshape(-1, V), targets[..., k].reshape(-1), reduction="none")
            for k in range(K)
        ],
        dim=-1,
    ).view(B, T, K)
    w = 1.0 / torch.arange(1, K + 1, dtype=torch.float64)
    w = w / w.sum()
    mce = (per_slot * mask * w).sum() / (mask * w).sum()
    mce.backward()
    g = torch.Generator().manual_seed(seed + 7)
    h = torch.randn(T, B, H, generator=g, dtype=torch.float64).requires_grad_(True)
    wt = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(True)
    log_p = torch.log_softmax(h @ wt.t(), dim=-1)
    chunked = -torch.gather(log_p, -1, targets.transpose(0, 1))
    chunked.backward(grad.transpose(0, 1))
    return {
        "embedded": embedded.detach(),
        "word_grad": word.grad,
        "ce": per_slot.detach(),
        "mce": mce.detach(),
        "ce_grad": logits.grad,
        "chunked": chunked.detach(),
        "h_grad": h.grad,
        "w_grad": wt.grad,
    }


def test_tp2_by_dp2_each_replica_equals_its_own_one_process_reference():
    ranks = run_distributed(_child, world_size=4)
    assert sorted((r["replica"], r["tp"]) for r in ranks) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    refs = {replica: _references(100 + replica) for replica in (0, 1)}
    assert not torch.allclose(refs[0]["mce"], refs[1]["mce"])  # the replicas' data differ
    half, shard = T // 2, V // 2
    tol = dict(rtol=1e-5, atol=1e-5)
    for r in ranks:
        ref, tp = refs[r["replica"]], r["tp"]
        case = (r["replica"], tp)
        torch.testing.assert_close(
            r["embedded"].double(), ref["embedded"][tp * half : (tp + 1) * half], **tol
        )
        torch.testing.assert_close(
            r["word_grad"].double(), ref["word_grad"][tp * shard : (tp + 1) * shard], **tol
        )
        torch.testing.assert_close(r["ce"].double(), ref["ce"], **tol, msg=str(case))
        torch.testing.assert_close(r["mce"].double(), ref["mce"], **tol, msg=str(case))
        torch.testing.assert_close(
            r["ce_grad"].double(), ref["ce_grad"][..., tp * shard : (tp + 1) * shard], **tol
        )
        exact = dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(r["chunked"], ref["chunked"], **exact, msg=str(case))
        torch.testing.assert_close(r["h_grad"], ref["h_grad"], **exact, msg=str(case))
        torch.testing.assert_close(
            r["w_grad"], ref["w_grad"][tp * shard : (tp + 1) * shard], **exact, msg=str(case)
        )
