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


class _OneRank:
    """A tensor-parallel group of one rank, without ``torch.distributed``: megatron-core's
    TP collectives return their input for a group of size 1 (``mappings._reduce``). No
    process group is started in the test process, so mutation testing can fork it."""

    def size(self):
        return 1

    def rank(self):
        return 0


@pytest.fixture
def tp1():
    """megatron-core's TP mappings given :class:`_OneRank` as it is (without a process group
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
    emb.tp_group = emb.word_embeddings.tp_group = _OneRank()
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
