"""The phase-1 loss seam (``TSTGPTModel``) and ``bag_embedding`` against megatron-core itself.

- state-dict and ``sharded_state_dict`` keys equal a baseline ``GPTModel``'s (dense and MoE);
- ``labels=[b, T, S]`` gives the per-slot CE of a float64 reference computed from the
  model's own logits, and the same parameter gradients;
- no logits-sized tensor is allocated beyond what the baseline (phase-2) step allocates;
- ``bag_embedding`` at ``S = 1`` equals ``LanguageModelEmbedding.forward`` (TP=1 and TP=2,
  with and without SP, learned/RoPE positions, fp32 residual, MuP where megatron-core has it);
- phase 2 (``labels=[b, T]``) with nan/inf logits at masked positions: the loss and every
  parameter gradient equal a float64 reference over the unmasked positions (TP=1 and TP=2;
  the fused cross-entropy against its own clean run, exactly);
- logits that are not this rank's vocabulary shard (gathered at TP=2) are refused.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed.harness import run_distributed, set_weights, small_config

V, T, S, B = 96, 8, 4, 2


def _config(*, experts=None, hidden=16, tp=1, hidden_dropout=0.0, **extra):
    return small_config(
        experts=experts, hidden_size=hidden, tp=tp, hidden_dropout=hidden_dropout, **extra
    )


def _init(tp=1):
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed

    initialize_model_parallel(ParallelConfig(tensor_model_parallel_size=tp))
    set_seed(3)


def _keys_child(rank, world):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router import TopKRouter

    from tst_megatron.models.gpt import TSTGPTModel, gpt_block_spec

    _init()
    result = {}
    for experts in (None, 4):
        config = _config(experts=experts)
        models = [
            cls(
                config=config,
                transformer_layer_spec=gpt_block_spec(config),
                vocab_size=V,
                max_sequence_length=T,
            )
            for cls in (GPTModel, TSTGPTModel)
        ]
        result[experts] = [
            (sorted(m.state_dict().keys()), sorted(m.sharded_state_dict().keys())) for m in models
        ]
        routers = [type(m) for m in models[1].modules() if "Router" in type(m).__name__]
        result[f"routers{experts}"] = [r is TopKRouter for r in routers]  # megatron-core's own
    return result


def _qk_norms_child(rank, world):
    from tst_megatron.models.gpt import gpt_block_spec

    _init()
    found = {}
    for experts in (None, 4):
        for l2 in (False, True):
            spec = gpt_block_spec(_config(experts=experts, qk_layernorm=True, qk_l2_norm=l2))
            attention = [layer.submodules.self_attention.submodules for layer in spec.layer_specs]
            found[experts, l2] = [
                (a.q_layernorm.__name__, a.k_layernorm.__name__) for a in attention
            ]
    return found


def test_qk_l2_norm_reaches_the_local_layer_spec():
    """``--qk-l2-norm`` gives every decoder layer of the local spec megatron-core's
    ``L2Norm`` for queries and keys (dense and MoE); without it, ``--qk-layernorm``'s norm."""
    (found,) = run_distributed(_qk_norms_child, 1)
    for experts in (None, 4):
        assert found[experts, True] == [("L2Norm", "L2Norm")] * 2
        assert found[experts, False] == [("SequenceParallelNorm", "SequenceParallelNorm")] * 2


def test_state_dict_keys_equal_baseline_gpt_model():
    (result,) = run_distributed(_keys_child, 1)
    for experts in (None, 4):
        (base_sd, base_sharded), (tst_sd, tst_sharded) = result[experts]
        assert tst_sd == base_sd and tst_sharded == base_sharded
        assert len(base_sd) > 10
    assert result["routers4"] == [True, True] and result["routersNone"] == []


def _batch():
    g = torch.Generator().manual_seed(17)
    tokens = torch.randint(0, V, (B, S * T + 1), generator=g)
    upstream = torch.randn(B, T, S, generator=g, dtype=torch.float64) + 0.3
    return tokens, upstream


def _seam_child(rank, world):
    from tests.distributed.harness import build_gpt_model
    from tst_megatron.superposition import align_bag_targets, bag_embedding, fold_bags

    _init()
    model = build_gpt_model(_config(experts=4), vocab_size=V, max_sequence_length=T)
    set_weights(model)
    tokens, upstream = _batch()
    targets, _ = align_bag_targets(tokens[:, 1:], torch.ones(B, S * T), S)
    bags = fold_bags(tokens[:, :-1], S)
    out = {}
    # The seam: per-slot CE from the model's loss path.
    ce = model(None, None, None, decoder_input=bag_embedding(model.embedding, bags), labels=targets)
    ce.backward(upstream.float())
    out["ce"] = ce.detach()
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    # The same model's logits (labels=None), for the float64 reference.
    logits = model(None, None, None, decoder_input=bag_embedding(model.embedding, bags))
    out["logits"] = logits.detach()
    ref_logits = logits.detach().double().requires_grad_(True)
    ref = torch.stack(
        [
            F.cross_entropy(
                ref_logits.reshape(-1, V), targets[..., k].reshape(-1), reduction="none"
            )
            for k in range(S)
        ],
        dim=-1,
    ).view(B, T, S)
    ref.backward(upstream)
    logits.backward(ref_logits.grad.float())
    out["ref_ce"] = ref.detach()
    out["ref_grads"] = {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }
    return out


def test_seam_per_slot_ce_and_gradients_match_reference():
    (r,) = run_distributed(_seam_child, 1)
    assert r["ce"].shape == (B, T, S) and r["ce"].dtype == torch.float32
    torch.testing.assert_close(r["ce"].double(), r["ref_ce"], rtol=1e-5, atol=1e-5)
    assert r["grads"].keys() == r["ref_grads"].keys()
    for name, grad in r["ref_grads"].items():
        torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


class _LargeTensors(TorchDispatchMode):
    """Count the new buffers of at least ``numel`` elements that ops allocate (an output whose
    storage is none of the op's inputs': in-place ops and views allocate nothing)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.count += t.untyped_storage().data_ptr() not in inputs
        return out


def _copies_child(rank, world):
    from tests.distributed.harness import build_gpt_model
    from tst_megatron.superposition import align_bag_targets, bag_embedding, fold_bags

    _init()
    vocab = 2048  # logits [T, b, V] = 32768 elements, the largest tensors by far (h = 8)
    model = build_gpt_model(_config(hidden=8), vocab_size=vocab, max_sequence_length=T)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (B, S * T + 1), generator=g)
    counts = {}
    # Phase 2 (the baseline): megatron-core's own loss path.
    with _LargeTensors(T * B * vocab) as big:
        x, y = tokens[:, :T], tokens[:, 1 : T + 1]
        loss = model(x, torch.arange(T).expand(B, T), None, labels=y)
        loss.sum().backward()
    counts["phase2"] = big.count
    with _LargeTensors(T * B * vocab) as big:
        targets, _ = align_bag_targets(tokens[:, 1:], torch.ones(B, S * T), S)
        x = bag_embedding(model.embedding, fold_bags(tokens[:, :-1], S))
        ce = model(None, None, None, decoder_input=x, labels=targets)
        ce.sum().backward()
    counts["phase1"] = big.count
    return counts


def test_phase1_allocates_no_extra_logits_sized_tensor():
    """The logits are scored where they are, sequence-first, in place."""
    (counts,) = run_distributed(_copies_child, 1)
    assert counts["phase2"] >= 1
    assert counts["phase1"] <= counts["phase2"], counts


def _embedding_child(rank, world, *, cases):
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tst_megatron.superposition import bag_embedding

    _init(world)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    results = []
    for case in cases:
        extra = dict(case.get("extra", {}))
        if not set(extra) <= fields:
            results.append(None)  # this megatron-core has no such setting (e.g. MuP < 0.17)
            continue
        config = _config(tp=world, hidden=16, hidden_dropout=case.get("dropout", 0.0), **extra)
        emb = LanguageModelEmbedding(
            config, vocab_size=V, max_sequence_length=T, position_embedding_type=case["position"]
        )
        set_weights(emb)
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, V, (B, T), generator=g)
        positions = torch.arange(T).expand(B, T)
        outs = []
        for fn in (
            lambda: emb(ids, positions),
            lambda: bag_embedding(emb, ids.unsqueeze(-1), positions),
        ):
            torch.manual_seed(11)  # the same dropout mask for both
            from megatron.core import tensor_parallel

            tensor_parallel.model_parallel_cuda_manual_seed(11)
            emb.zero_grad()
            out = fn()
            out.backward(torch.linspace(-1, 2, out.numel()).view_as(out))
            outs.append((out.detach(), emb.word_embeddings.weight.grad.clone()))
        results.append(outs)
    return results


EMBEDDING_CASES = [
    {"position": "rope"},
    {"position": "learned_absolute"},
    {"position": "learned_absolute", "extra": {"fp32_residual_connection": True}},
    {"position": "rope", "dropout": 0.3},
    {"position": "learned_absolute", "extra": {"use_mup": True, "mup_embedding_mult": 2.5}},
]


@pytest.mark.parametrize("world", [1, 2])
def test_bag_embedding_at_s1_equals_language_model_embedding(world):
    ranks = run_distributed(_embedding_child, world, cases=EMBEDDING_CASES)
    for results in ranks:
        for case, outs in zip(EMBEDDING_CASES, results):
            if outs is None:
                assert "use_mup" in case.get("extra", {})
                continue
            (ref_out, ref_grad), (out, grad) = outs
            assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, case
            torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6, msg=str(case))
            torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6, msg=str(case))


# --- phase 2: masked positions with non-finite logits ------------------------


def _phase2_batch():
    g = torch.Generator().manual_seed(23)
    loss_mask = torch.ones(B, T)
    loss_mask[0, 2:5] = 0
    loss_mask[1, 0] = 0
    loss_mask[1, 7] = 0
    return {
        "tokens": torch.randint(0, V, (B, T), generator=g),
        "position_ids": torch.arange(T).expand(B, T),
        "attention_mask": None,
        "labels": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": loss_mask,
    }


def _poison(rank, scored):
    """A forward hook on the output layer: nan / +inf / -inf logits at the masked positions,
    on rank 0's vocabulary shard only (the TP reductions spread them to every rank)."""

    def hook(module, inputs, output):
        logits, bias = output  # [T, b, V/tp]
        if rank != 0:
            return output
        bad = torch.full_like(logits, float("nan"))
        bad[:, 1] = float("inf")  # nan rows in sample 0, +inf rows in sample 1
        bad[0, 1, :3] = -float("inf")
        # Added, not selected: the logits' gradient passes through unchanged (torch.where
        # would itself zero the masked rows' gradient on the way back).
        return logits + torch.where(~scored.T.unsqueeze(-1), bad, 0.0), bias

    return hook


def _phase2_grads(model, batch, upstream, hook=None):
    """Loss, scored-token count and parameter gradients of one phase-2 forward step, and
    the validation loss (the same step without backward)."""
    from tst_megatron.loop.forward import make_phase2_step

    handle = model.output_layer.register_forward_hook(hook) if hook else None
    step = make_phase2_step()
    model.zero_grad()
    per_token, loss_func = step(iter([batch]), model)
    loss, num_tokens, _ = loss_func(per_token)
    (loss * upstream).backward()
    with torch.no_grad():
        per_token, loss_func = step(iter([batch]), model)
        valid_loss = loss_func(per_token)[0]
    if handle:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return dict(loss=loss.detach(), num_tokens=int(num_tokens), valid_loss=valid_loss, grads=grads)


def _masked_child(rank, world):
    """Phase-2 loss and gradients with non-finite logits at the masked positions, against a
    float64 cross-entropy over the unmasked positions of the clean logits; at TP=1 also
    megatron-core's fused cross-entropy against its own run on the clean logits."""
    from tests.distributed.harness import build_gpt_model

    _init(world)
    model = build_gpt_model(_config(experts=4, tp=world), vocab_size=V, max_sequence_length=T)
    set_weights(model)
    batch = _phase2_batch()
    scored = batch["loss_mask"] > 0
    upstream = 0.37 + torch.rand((), generator=torch.Generator().manual_seed(4))  # non-unit

    # Reference: the clean model's full-vocabulary logits (megatron-core's differentiable
    # gather), CE in float64 over the scored positions only.
    logits = model(batch["tokens"], batch["position_ids"], None, runtime_gather_output=True)
    ref = F.cross_entropy(
        logits.double().reshape(-1, V), batch["labels"].reshape(-1), reduction="none"
    ).view(B, T)
    ref_loss = ref[scored].sum()
    (ref_loss * upstream).backward()
    out = {"ref_loss": ref_loss.detach()}
    out["ref_grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
    out.update(_phase2_grads(model, batch, upstream, _poison(rank, scored)))
    if world == 1:  # the fused kernel (its gradient is bf16, so compared with its own run)
        fused = build_gpt_model(
            _config(experts=4, cross_entropy_loss_fusion=True), vocab_size=V, max_sequence_length=T
        )
        fused.load_state_dict(model.state_dict())
        out["fused_clean"] = _phase2_grads(fused, batch, upstream)
        out["fused"] = _phase2_grads(fused, batch, upstream, _poison(rank, scored))
    return out


def _check_masked(r):
    assert r["num_tokens"] == B * T - 5
    for key in ("loss", "valid_loss"):
        torch.testing.assert_close(r[key].double(), r["ref_loss"], rtol=1e-5, atol=1e-5)
    bad = sorted(n for n, g in r["grads"].items() if not g.isfinite().all())
    assert not bad, f"{len(bad)} of {len(r['grads'])} parameter gradients are not finite: {bad}"
    for name, grad in r["ref_grads"].items():
        torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if "fused" in r:
        clean, fused = r["fused_clean"], r["fused"]
        torch.testing.assert_close(fused["loss"], clean["loss"], rtol=0, atol=0)
        for name, grad in clean["grads"].items():  # masked rows add exactly nothing
            torch.testing.assert_close(fused["grads"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("world", [1, 2])
def test_phase2_masked_nonfinite_logits_give_finite_loss_and_reference_gradients(world):
    """Masked positions contribute exactly zero to the loss and the gradients."""
    for r in run_distributed(_masked_child, world):
        _check_masked(r)


# --- gathered logits are not a shard ---------------------------------------


def _gathered_child(rank, world):
    from tests.distributed.harness import build_gpt_model

    _init(world)
    model = build_gpt_model(_config(tp=world), vocab_size=V, max_sequence_length=T)
    batch = _phase2_batch()
    errors = []
    targets = batch["labels"].unsqueeze(-1).expand(B, T, 2)  # phase-1 [b, T, S] labels
    for labels in (batch["labels"], targets):
        try:
            model(batch["tokens"], batch["position_ids"], None, labels=labels,
                  runtime_gather_output=True)  # fmt: skip
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    # The seam itself, with logits one entry too wide.
    try:
        model.compute_language_model_loss(batch["labels"], torch.zeros(T, B, V // world + 1))
        errors.append(None)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_gathered_logits_are_refused_by_the_seam():
    """Full-vocabulary logits at TP=2 scored as a shard read log 2 too high."""
    for errors in run_distributed(_gathered_child, 2):
        for error in errors:
            assert error is not None and "\n" not in error
            assert "padded vocabulary 96 / TP 2 = 48" in error, error
        assert errors[0].startswith("logits have 96 vocabulary entries per rank")
        assert errors[2].startswith("logits have 49 vocabulary entries per rank")
