"""The TST core under tensor parallelism (2 gloo processes) against plain float64 references.

References are written here with stock PyTorch ops in float64 on one process:
``nn.functional.embedding`` + mean for the bag embedding, per-slot
``nn.functional.cross_entropy`` for the multi-target CE. Every backward uses a random,
non-unit upstream gradient.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.distributed.harness import run_distributed, tp_layer_config

V, H, B, T = 32, 16, 2, 6  # vocab, hidden, micro-batch, latent length


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g, dtype=torch.float64), torch.randn(
        T, H, generator=g, dtype=torch.float64
    )


def _bags(seed, bag_size):
    g = torch.Generator().manual_seed(seed + 1)
    bags = torch.randint(0, V, (B, T, bag_size), generator=g)
    bags[0, 0, :] = 7  # a bag of one repeated token
    bags[1, 2, 0] = bags[1, 2, -1]  # a duplicate inside a bag
    return bags


def _upstream(seed, shape):
    g = torch.Generator().manual_seed(seed + 2)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * 3.0 + 0.5


# --- children (run on every rank) ---------------------------------------------------------


def _embedding_child(rank, world, *, sp, position, bag_size, seed, dtype=torch.float32):
    from megatron.core import parallel_state as ps
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed
    from tst_megatron.superposition import bag_embedding

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    set_seed(seed)
    config = tp_layer_config(world, hidden_size=H, sequence_parallel=sp)
    emb = LanguageModelEmbedding(
        config, vocab_size=V, max_sequence_length=T, position_embedding_type=position
    ).to(dtype)
    word, pos = _tables(seed)
    shard = V // world
    with torch.no_grad():
        emb.word_embeddings.weight.copy_(word[rank * shard : (rank + 1) * shard])
        if position == "learned_absolute":
            emb.position_embeddings.weight.copy_(pos)

    # Method code must take its group from its arguments: make the global getter raise.
    def _forbidden(*args, **kwargs):
        raise AssertionError("superposition code read parallel_state")

    saved = ps.get_tensor_model_parallel_group
    ps.get_tensor_model_parallel_group = _forbidden
    try:
        out = bag_embedding(emb, _bags(seed, bag_size))
        grad = _upstream(seed, (T, B, H)).to(dtype)
        if sp:
            grad = grad.chunk(world, dim=0)[rank]
        out.backward(grad)
        errors = []
        for bad in (-1, V):
            bags = _bags(seed, bag_size)
            bags[1, 1, 1] = bad
            try:
                bag_embedding(emb, bags, check=True)
            except ValueError as exc:
                errors.append(str(exc))
    finally:
        ps.get_tensor_model_parallel_group = saved
    return {
        "out": out.detach(),
        "word_grad": emb.word_embeddings.weight.grad.clone(),
        "pos_grad": (
            emb.position_embeddings.weight.grad.clone() if position == "learned_absolute" else None
        ),
        "errors": errors,
    }


def _ce_child(rank, world, *, dtype, seed):
    from megatron.core import parallel_state as ps

    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel
    from tst_megatron.superposition import (
        bag_weights,
        multi_hot_cross_entropy,
        vocab_parallel_multi_target_cross_entropy,
    )

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=world))
    group = ps.get_tensor_model_parallel_group()
    logits, targets, mask, grad = _ce_inputs(seed)
    shard = V // world
    local = logits[..., rank * shard : (rank + 1) * shard].to(dtype).contiguous()
    local.requires_grad_(True)
    before = local.detach().clone()
    ce = vocab_parallel_multi_target_cross_entropy(local, targets, tp_group=group)
    ce.backward(grad.float())
    result = {
        "ce": ce.detach(),
        "grad": local.grad.clone(),
        "unchanged": torch.equal(local.detach(), before),
    }

    # MCE with power weights and masked slots, through the same CE.
    local2 = (
        logits[..., rank * shard : (rank + 1) * shard].to(dtype).contiguous().requires_grad_(True)
    )
    ce2 = vocab_parallel_multi_target_cross_entropy(local2, targets, tp_group=group)
    loss_sum, weight_sum = multi_hot_cross_entropy(
        ce2, mask, bag_weights(targets.shape[-1], "power")
    )
    (loss_sum / weight_sum * 1.7).backward()
    result.update(
        loss_sum=loss_sum.detach(), weight_sum=weight_sum.detach(), mce_grad=local2.grad.clone()
    )
    try:
        bad = targets.clone()
        bad[0, 0, 0] = V
        vocab_parallel_multi_target_cross_entropy(local.detach(), bad, tp_group=group, check=True)
    except ValueError as exc:
        result["error"] = str(exc)
    return result


K = 4


def _ce_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.0
    targets = torch.randint(0, V, (B, T, K), generator=g)
    targets[0, 1, :] = targets[0, 1, 0]  # a bag of one repeated token
    targets[1, 3, 2] = targets[1, 3, 0]  # a duplicate
    mask = (torch.rand(B, T, K, generator=g) > 0.3).double()
    mask[:, -1, 1:] = 0.0  # the last-bag pattern
    grad = torch.randn(B, T, K, generator=g, dtype=torch.float64) + 0.3
    return logits, targets, mask, grad


# --- references (float64, one process, stock ops) -----------------------------------------


def _reference_embedding(seed, bag_size, position, dtype=torch.float64):
    word, pos = (t.to(dtype).double() for t in _tables(seed))
    word.requires_grad_(True)
    pos.requires_grad_(True)
    bags = _bags(seed, bag_size)
    out = F.embedding(bags, word).mean(dim=2)  # [B, T, H]
    if position == "learned_absolute":
        out = out + pos[torch.arange(T)]
    out = out.transpose(0, 1)
    out.backward(_upstream(seed, (T, B, H)).to(dtype).double())
    return out.detach(), word.grad, pos.grad


def _reference_ce(logits, targets):
    return torch.stack(
        [
            F.cross_entropy(
                logits.reshape(-1, V), targets[..., k].reshape(-1), reduction="none"
            ).view(B, T)
            for k in range(targets.shape[-1])
        ],
        dim=-1,
    )


# --- tests --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sp,position",
    [(False, "rope"), (True, "rope"), (False, "learned_absolute"), (True, "learned_absolute")],
)
def test_bag_embedding_tp2_matches_reference(sp, position):
    seed, bag_size = 11, 4
    ranks = run_distributed(
        _embedding_child, 2, sp=sp, position=position, bag_size=bag_size, seed=seed
    )
    ref_out, ref_word_grad, ref_pos_grad = _reference_embedding(seed, bag_size, position)
    out = torch.cat([r["out"] for r in ranks], dim=0) if sp else ranks[0]["out"]
    if not sp:
        torch.testing.assert_close(ranks[1]["out"], ranks[0]["out"], rtol=0, atol=0)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    word_grad = torch.cat([r["word_grad"] for r in ranks], dim=0)
    torch.testing.assert_close(word_grad.double(), ref_word_grad, rtol=1e-5, atol=1e-5)
    if position == "learned_absolute":
        for r in ranks:
            torch.testing.assert_close(r["pos_grad"].double(), ref_pos_grad, rtol=1e-5, atol=1e-5)
    # Out-of-range ids: one clear message, identical on every rank.
    assert ranks[0]["errors"] == ranks[1]["errors"]
    assert ranks[0]["errors"] == [
        "token id -1 is outside the vocabulary [0, 32)",
        "token id 32 is outside the vocabulary [0, 32)",
    ]


def test_bag_embedding_tp1_matches_reference_and_tp2():
    seed, bag_size = 5, 3
    (single,) = run_distributed(
        _embedding_child, 1, sp=False, position="learned_absolute", bag_size=bag_size, seed=seed
    )
    ref_out, ref_word_grad, _ = _reference_embedding(seed, bag_size, "learned_absolute")
    torch.testing.assert_close(single["out"].double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(single["word_grad"].double(), ref_word_grad, rtol=1e-5, atol=1e-5)
    assert single["errors"][1] == "token id 32 is outside the vocabulary [0, 32)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_target_ce_tp2_matches_reference(dtype):
    seed = 3
    ranks = run_distributed(_ce_child, 2, dtype=dtype, seed=seed)
    logits, targets, mask, grad = _ce_inputs(seed)
    # Reference on the logits as the ranks saw them (rounded to dtype), in float64.
    logits_ref = logits.to(dtype).double().requires_grad_(True)
    ref_ce = _reference_ce(logits_ref, targets)
    ref_ce.backward(grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for r in ranks:
        assert r["unchanged"], "the CE modified its input"
        torch.testing.assert_close(r["ce"].double(), ref_ce.detach(), **tol)
        assert r["error"] == "target id 32 is outside the vocabulary [0, 32)"
    grad_full = torch.cat([r["grad"] for r in ranks], dim=-1)
    assert grad_full.dtype == dtype
    torch.testing.assert_close(grad_full.double(), logits_ref.grad, **tol)

    # MCE with power weights: loss_sum = sum w m ce, weight_sum = sum w m.
    w = 1.0 / torch.arange(1, K + 1, dtype=torch.float64)
    w = w / w.sum()
    logits_ref2 = logits.to(dtype).double().requires_grad_(True)
    ce2 = _reference_ce(logits_ref2, targets)
    ref_loss_sum = (ce2 * mask * w).sum()
    ref_weight_sum = (mask * w).sum()
    (ref_loss_sum / ref_weight_sum * 1.7).backward()
    for r in ranks:
        torch.testing.assert_close(r["loss_sum"].double(), ref_loss_sum.detach(), **tol)
        torch.testing.assert_close(r["weight_sum"].double(), ref_weight_sum, rtol=1e-6, atol=1e-6)
    mce_grad = torch.cat([r["mce_grad"] for r in ranks], dim=-1)
    torch.testing.assert_close(mce_grad.double(), logits_ref2.grad, **tol)


def test_bag_embedding_tp2_sp_bf16_within_tolerance():
    seed, bag_size = 13, 6
    ranks = run_distributed(
        _embedding_child,
        2,
        sp=True,
        position="rope",
        bag_size=bag_size,
        seed=seed,
        dtype=torch.bfloat16,
    )
    ref_out, ref_word_grad, _ = _reference_embedding(seed, bag_size, "rope", torch.bfloat16)
    out = torch.cat([r["out"] for r in ranks], dim=0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    word_grad = torch.cat([r["word_grad"] for r in ranks], dim=0)
    torch.testing.assert_close(word_grad.double(), ref_word_grad, rtol=2e-2, atol=2e-2)
