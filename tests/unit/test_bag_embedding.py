"""The bag embedding at TP = 1 in this process, against a float64 reference written here.

The 2- and 4-process tests (``tests/distributed/test_core_tp.py``, ``test_core_tp_dp.py``)
check the vocab-parallel lookup and its collectives; this file checks, in the test process
itself (so that mutation testing sees it, ``docs/testing.md``), everything else
``bag_embedding`` does: the mean of each bag, the latent positions, the tail it copies from
``LanguageModelEmbedding.forward`` (MuP multiplier, fp32 residual, dropout), its dtype, the
forward pre-hooks and its refusals.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

V, H, B, T = 32, 16, 2, 6  # vocab, hidden, micro-batch, latent length


class _Rank:
    """Rank ``rank`` of a tensor-parallel group of ``size`` ranks, in this one process, without
    ``torch.distributed`` (no process group is started here, so mutation testing can fork the
    test process); megatron-core's TP collectives return their input for a group of one."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.fixture
def tp1():
    """megatron-core's TP mappings given a :class:`_Rank` as it is (without a process group
    they would replace it by None)."""
    from unittest import mock

    with mock.patch(
        "megatron.core.tensor_parallel.mappings.get_tensor_model_parallel_group_if_none",
        lambda group, **_: group,
    ):
        yield


def _embedding(position="learned_absolute", dtype=torch.float32, **config):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    layer = dict(num_layers=1, hidden_size=H, num_attention_heads=2, hidden_dropout=0.0)
    cfg = TransformerConfig(**layer, use_cpu_initialization=True, **config)
    emb = LanguageModelEmbedding(
        cfg, vocab_size=V, max_sequence_length=T + 2, position_embedding_type=position
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        emb.word_embeddings.weight.copy_(torch.randn(V, H, generator=g))
        if position == "learned_absolute":
            emb.position_embeddings.weight.copy_(torch.randn(T + 2, H, generator=g))
    emb.tp_group = emb.word_embeddings.tp_group = _Rank(0, 1)
    return emb.to(dtype)


def _bags(bag_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    bags = torch.randint(0, V, (B, T, bag_size), generator=g)
    bags[0, 0, :] = 7  # a bag of one repeated token
    bags[1, 2, 0] = bags[1, 2, -1]  # a duplicate inside a bag
    return bags


def _reference(emb, bags, positions=None):
    """``[T, b, h]`` float64: mean of each bag's embeddings plus the latent position's."""
    word = emb.word_embeddings.weight.detach().double()
    out = F.embedding(bags, word).mean(dim=2)  # [B, T, H]
    if emb.add_position_embedding:
        pos = emb.position_embeddings.weight.detach().double()
        positions = torch.arange(T).expand(B, T) if positions is None else positions
        out = out + pos[positions]
    return out.transpose(0, 1)


@pytest.mark.parametrize("bag_size", [1, 3, 4])
@pytest.mark.parametrize("position", ["learned_absolute", "rope"])
def test_bag_mean_and_positions_equal_the_reference(tp1, bag_size, position):
    from tst_megatron.superposition import bag_embedding

    emb = _embedding(position)
    bags = _bags(bag_size)
    out = bag_embedding(emb, bags)
    assert out.shape == (T, B, H) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _reference(emb, bags), rtol=1e-6, atol=1e-6)
    # gradient: d out / d E[v] = (upstream summed over the bag slots holding v) / S
    upstream = torch.randn(T, B, H, generator=torch.Generator().manual_seed(2))
    out.backward(upstream)
    word = torch.zeros(V, H, dtype=torch.float64)
    for b in range(B):
        for j in range(T):
            for k in range(bag_size):
                word[bags[b, j, k]] += upstream[j, b].double() / bag_size
    torch.testing.assert_close(emb.word_embeddings.weight.grad.double(), word, rtol=1e-6, atol=1e-6)


def test_given_latent_positions_are_used(tp1):
    from tst_megatron.superposition import bag_embedding

    emb, bags = _embedding(), _bags(4)
    positions = torch.tensor([[2, 3, 4, 5, 6, 7], [0, 0, 1, 1, 2, 2]])
    out = bag_embedding(emb, bags, position_ids=positions)
    torch.testing.assert_close(out.double(), _reference(emb, bags, positions), rtol=1e-6, atol=1e-6)


def test_bag_of_one_equals_megatron_cores_embedding(tp1):
    from tst_megatron.superposition import bag_embedding

    for config in ({}, {"fp32_residual_connection": True}):
        emb = _embedding(dtype=torch.bfloat16, **config)
        tokens = _bags(1)[..., 0]
        positions = torch.arange(T).expand(B, T)
        got = bag_embedding(emb, tokens[..., None])
        want = emb(tokens, positions)
        assert got.dtype == want.dtype == (torch.float32 if config else torch.bfloat16)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_bf16_mean_is_taken_in_fp32_and_cast_once(tp1):
    from tst_megatron.superposition import bag_embedding

    emb = _embedding("rope", dtype=torch.bfloat16)
    bags = _bags(6)
    word = emb.word_embeddings.weight.detach()
    # the bag sum of stock embedding_bag (its CPU kernel accumulates as it does), divided by S
    # in fp32, then rounded to bf16 once
    summed = F.embedding_bag(bags.reshape(B * T, 6), word, mode="sum").float()
    want = (summed / 6).to(torch.bfloat16).view(B, T, H).transpose(0, 1)
    got = bag_embedding(emb, bags)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mup_multiplier_and_dropout_follow_the_config(tp1):
    from tst_megatron.superposition import bag_embedding

    bags = _bags(3)
    plain = _embedding()
    ref = _reference(plain, bags)
    mup = _embedding(use_mup=True, mup_embedding_mult=2.5)
    torch.testing.assert_close(bag_embedding(mup, bags).double(), 2.5 * ref, rtol=1e-6, atol=1e-6)
    # dropout is the embedding's own: in training, about half the entries become 0 at p = 0.5
    drop = _embedding()
    drop.embedding_dropout.p = 0.5
    torch.manual_seed(0)
    out = bag_embedding(drop, bags)
    zeros = (out == 0).double().mean().item()
    assert 0.3 < zeros < 0.7
    kept = out != 0
    torch.testing.assert_close(out[kept].double(), 2 * ref[kept], rtol=1e-6, atol=1e-6)
    drop.eval()
    torch.testing.assert_close(bag_embedding(drop, bags).double(), ref, rtol=1e-6, atol=1e-6)


def test_the_word_embeddings_forward_pre_hooks_run_once_with_the_bags(tp1):
    """megatron-core's DDP waits for the parameters' all-gather in these hooks."""
    from tst_megatron.superposition import bag_embedding

    emb, bags = _embedding(), _bags(2)
    seen = []
    handle = emb.word_embeddings.register_forward_pre_hook(lambda m, a: seen.append((m, a)))
    try:
        bag_embedding(emb, bags)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0][0] is emb.word_embeddings
    assert len(seen[0][1]) == 1 and seen[0][1][0] is bags


def test_refusals_name_the_problem(tp1):
    from tst_megatron.superposition import bag_embedding

    emb = _embedding()
    with pytest.raises(ValueError, match=r"^bags must be \[b, T, S\], got shape \(2, 6\)$"):
        bag_embedding(emb, _bags(2)[..., 0])
    with pytest.raises(ValueError, match="^token ids must be an integer tensor, got dtype"):
        bag_embedding(emb, _bags(2).float())
    with pytest.raises(ValueError, match="^token ids must be an integer tensor, got dtype"):
        bag_embedding(emb, _bags(2) > 3)
    bad = _bags(2)
    bad[1, 1, 1] = V
    with pytest.raises(ValueError, match=r"^token id 32 is outside the vocabulary \[0, 32\)$"):
        bag_embedding(emb, bad, check=True)
    with pytest.raises((IndexError, RuntimeError)):  # unchecked at TP = 1: the lookup fails
        bag_embedding(emb, bad)
    emb.tokentype_embeddings = torch.nn.Embedding(2, H)
    with pytest.raises(ValueError, match="^bag_embedding does not support token-type"):
        bag_embedding(emb, _bags(2))


def _shard_partial(word, bags, lo, hi):
    """float64 ``[B, T, H]``: the bag means of the ids in ``[lo, hi)`` only (what the rank
    holding that vocab shard contributes to the TP sum), written plainly."""
    inside = ((bags >= lo) & (bags < hi)).double()
    rows = F.embedding(bags.clamp(0, V - 1), word.double())  # [B, T, S, H]
    return (rows * inside[..., None]).sum(dim=2) / bags.shape[-1]


def _tp_rank(rank, size, word, position, monkeypatch, calls, **config):
    """The embedding of TP rank ``rank`` of ``size`` (its vocab shard of ``word``), with
    megatron-core's TP collectives replaced by what the other ranks would add: their
    reference partial sums (so each rank's output is the whole embedding)."""
    from tst_megatron.superposition import embedding as module

    emb = _embedding(position, tensor_model_parallel_size=size, **config)
    shard = V // size
    lo, hi = rank * shard, (rank + 1) * shard
    group = _Rank(rank, size)
    word_layer = emb.word_embeddings
    word_layer.weight = torch.nn.Parameter(word[lo:hi].clone())
    word_layer.vocab_start_index, word_layer.vocab_end_index = lo, hi
    emb.tp_group = word_layer.tp_group = group

    def others(bags):
        return sum(
            _shard_partial(word, bags, r * shard, (r + 1) * shard) for r in range(size) if r != rank
        ).float()

    def reduce(x, group=None):
        calls.append(("reduce", group))
        return x + others(state["bags"])

    def reduce_scatter(x, group=None):  # [T, b, h] -> this rank's [T/tp, b, h]
        calls.append(("reduce_scatter", group))
        whole = x + others(state["bags"]).transpose(0, 1)
        return whole.chunk(group.size(), dim=0)[group.rank()]

    def scatter(x, group=None):
        calls.append(("scatter", group))
        return x.chunk(group.size(), dim=0)[group.rank()]

    class _Tracker:  # the model-parallel RNG region SP's dropout runs in (a GPU's RNG state)
        def fork(self):
            import contextlib

            calls.append(("rng fork", group))
            return contextlib.nullcontext()

    state = {}
    tp = module.tensor_parallel
    monkeypatch.setattr(tp, "get_cuda_rng_tracker", _Tracker)
    monkeypatch.setattr(tp, "reduce_from_tensor_model_parallel_region", reduce)
    monkeypatch.setattr(tp, "reduce_scatter_to_sequence_parallel_region", reduce_scatter)
    monkeypatch.setattr(tp, "scatter_to_sequence_parallel_region", scatter)
    return emb, group, state


@pytest.mark.parametrize(
    "position, sp",
    [("learned_absolute", False), ("rope", False), ("learned_absolute", True), ("rope", True)],
)
def test_each_tp_rank_looks_up_its_vocab_shard_and_reduces_on_its_group(
    tp1, monkeypatch, position, sp
):
    """TP = 2 in one process: each rank embeds the ids of its vocab shard (others as 0), the
    bag mean taken before the TP reduction of ``[b, T, h]`` on the embedding's own group
    (under SP with RoPE a reduce-scatter to ``[T/tp, b, h]``; with learned positions a
    reduce, the positions, then the scatter), with gradients into its shard only."""
    from tst_megatron.superposition import bag_embedding

    g = torch.Generator().manual_seed(8)
    word = torch.randn(V, H, generator=g)
    bags = _bags(4)
    bags[0, 1, :] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])  # both shards' edges
    for rank in range(2):
        calls = []
        emb, group, state = _tp_rank(
            rank, 2, word, position, monkeypatch, calls, sequence_parallel=sp
        )
        state["bags"] = bags
        out = bag_embedding(emb, bags)
        full = _shard_partial(word, bags, 0, V)
        if position == "learned_absolute":
            full = full + emb.position_embeddings.weight.detach().double()[torch.arange(T)]
        want = full.transpose(0, 1)  # [T, B, H]
        if sp:
            want = want.chunk(2, dim=0)[rank]
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        kinds = [kind for kind, _ in calls]
        if sp and position == "rope":
            assert kinds == ["reduce_scatter", "rng fork"]
        elif sp:
            assert kinds == ["reduce", "scatter", "rng fork"]
        else:
            assert kinds == ["reduce"]
        assert all(where is group for _, where in calls)
        # d out / d shard row v = (upstream summed over the slots holding v) / S
        upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        out.backward(upstream)
        if sp:
            continue  # the scatter's backward (an all-gather) is the 2-process tests'
        grad = torch.zeros(V, H, dtype=torch.float64)
        for b in range(B):
            for j in range(T):
                for k in range(4):
                    grad[bags[b, j, k]] += upstream[j, b].double() / 4
        lo, hi = rank * (V // 2), (rank + 1) * (V // 2)
        torch.testing.assert_close(
            emb.word_embeddings.weight.grad.double(), grad[lo:hi], rtol=1e-5, atol=1e-5
        )


def test_sequence_parallel_output_is_cloned_only_when_asked(tp1, monkeypatch):
    """``clone_scatter_output_in_embedding`` (megatron-core's default) clones the scattered
    output; off, the output is the scatter's view."""
    from tst_megatron.superposition import bag_embedding

    word = torch.randn(V, H, generator=torch.Generator().manual_seed(2))
    for clone in (True, False):
        emb, _, state = _tp_rank(
            0, 2, word, "learned_absolute", monkeypatch, [], sequence_parallel=True,
            clone_scatter_output_in_embedding=clone,
        )  # fmt: skip
        state["bags"] = _bags(2)
        seen = []
        emb.embedding_dropout.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        bag_embedding(emb, state["bags"])
        assert (seen[0]._base is None) == clone


def test_mup_multiplies_only_when_on_and_not_one(tp1):
    from tst_megatron.superposition import bag_embedding

    bags = _bags(3)
    ref = _reference(_embedding(), bags)
    for config, factor in (
        ({"use_mup": True, "mup_embedding_mult": 2.0}, 2.0),
        ({"use_mup": False, "mup_embedding_mult": 2.5}, 1.0),
        ({"use_mup": True, "mup_embedding_mult": 1.0}, 1.0),
    ):
        out = bag_embedding(_embedding(**config), bags)
        torch.testing.assert_close(out.double(), factor * ref, rtol=1e-6, atol=1e-6)


def test_an_embedding_without_token_type_attribute_is_accepted(tp1):
    from tst_megatron.superposition import bag_embedding

    emb, bags = _embedding(), _bags(2)
    del emb.tokentype_embeddings
    torch.testing.assert_close(
        bag_embedding(emb, bags).double(), _reference(emb, bags), rtol=1e-6, atol=1e-6
    )
