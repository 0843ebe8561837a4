"""Multi-token prediction (``mtp_num_layers``) with TST, one process (spawned: megatron-core's
globals stay out of pytest's process), a tiny GPT with one MTP layer on the local spec:

- phase 1 (the project's phase-1 forward step, ``[b, T, S]`` labels): the loss equals a
  float64 reference of the bag loss computed from a plain megatron-core ``GPTModel``
  *without* MTP (same weights), the gradients of the shared parameters equal that model's,
  and every MTP parameter gets an exactly zero gradient (random non-unit upstream); nothing
  is logged for MTP;
- phase 2 (the project's phase-2 forward step): the loss and every gradient equal
  megatron-core's plain ``GPTModel`` with the same weights and the same MTP block, called as
  Megatron-LM's ``pretrain_gpt.py`` calls it (``labels=``, ``loss_mask=``), with masked
  positions and a non-unit MTP loss scale; the MTP parameters do train and their loss is
  logged.
"""

from __future__ import annotations

import torch

from tests.distributed.harness import (
    reference_bag_ce,
    run_distributed,
    set_weights,
    small_config,
)

V, T, S, B = 64, 8, 2, 2


def _grads(model):
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def _reference_mce(logits, stream, mask):
    """float64 bag loss: position j predicts tokens ``stream[(j+1)S + k]``, k < S, each
    scored when it exists and its label's mask is 1; uniform weights, so the MCE is the mean
    CE over scored slots. Returns ``(MCE * scored positions, scored positions)``, what the
    phase-1 loss function returns (``loop/forward.py``)."""
    terms, positions = reference_bag_ce(logits, stream, mask, S=S, T=T)
    return torch.stack(terms).mean() * positions, positions


def _mtp_child(rank, world):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
    )

    from tst_megatron.loop.forward import make_phase1_step, make_phase2_step
    from tst_megatron.models.gpt import TSTGPTModel, gpt_block_spec, local_mtp_block_spec
    from tst_megatron.runtime import ParallelConfig, initialize_model_parallel, set_seed

    initialize_model_parallel(ParallelConfig())
    set_seed(3)
    config = small_config(mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
    spec = gpt_block_spec(config)
    mtp_spec = local_mtp_block_spec(config)
    common = dict(vocab_size=V, max_sequence_length=T)
    model = TSTGPTModel(config, spec, mtp_block_spec=mtp_spec, **common)
    set_weights(model)
    # megatron-core's own model, same weights, same MTP; and one without MTP at all
    with_mtp = GPTModel(config, spec, mtp_block_spec=mtp_spec, **common)
    with_mtp.load_state_dict(model.state_dict())
    plain_config = small_config()
    without_mtp = GPTModel(plain_config, gpt_block_spec(plain_config), **common)
    shared = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    without_mtp.load_state_dict(shared)
    out = {"mtp_names": sorted(n for n, _ in model.named_parameters() if n.startswith("mtp."))}

    g = torch.Generator().manual_seed(5)
    stream = torch.randint(0, V, (B, S * T + 1), generator=g)
    mask = torch.ones(B, S * T)
    mask[0, 5] = 0  # one masked label inside a bag
    upstream = float(0.37 + torch.rand((), generator=g))  # non-unit
    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.7))  # the schedule sets it; non-unit

    # --- phase 1: the project's forward step on the model with MTP -----------------------
    model.train()
    step1 = make_phase1_step(bag_size=S, weighting="uniform")
    batch1 = {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": mask}
    per_slot, loss_func = step1(iter([batch1]), model)
    loss, n, _ = loss_func(per_slot)
    (loss * upstream).backward()
    out["phase1"] = (loss.detach().double(), int(n), _grads(model))
    out["phase1_logged"] = dict(MTPLossLoggingHelper.tracker)
    model.zero_grad()

    # the reference: the model without MTP, bag means built plainly, CE in float64
    bags = stream[:, :-1].reshape(B, T, S)
    emb = without_mtp.embedding
    x = emb.word_embeddings.weight[bags].mean(dim=2) + emb.position_embeddings.weight[:T][None]
    logits = without_mtp(None, None, None, decoder_input=x.transpose(0, 1).contiguous())
    ref_logits = logits.detach().double().requires_grad_(True)
    ref_loss, ref_n = _reference_mce(ref_logits, stream, mask)
    (ref_loss * upstream).backward()
    logits.backward(ref_logits.grad.float())
    out["ref_phase1"] = (ref_loss.detach(), ref_n, _grads(without_mtp))

    # --- phase 2: the project's forward step vs megatron-core's GPTModel with MTP ---------
    window = stream[:, : T + 1]
    loss_mask = torch.ones(B, T)
    loss_mask[0, 2:4] = 0
    loss_mask[1, 6] = 0
    batch2 = {
        "tokens": window[:, :-1],
        "labels": window[:, 1:],
        "loss_mask": loss_mask,
        "position_ids": torch.arange(T).expand(B, T),
    }
    step2 = make_phase2_step()
    per_token, loss_func = step2(iter([batch2]), model)
    loss, n, _ = loss_func(per_token)
    (loss * upstream).backward()
    out["phase2"] = (loss.detach().double(), int(n), _grads(model))
    logged = MTPLossLoggingHelper.tracker  # megatron-core 0.16: "values"; 0.19: "loss_values"
    out["phase2_logged"] = logged.get("loss_values", logged.get("values")).clone()

    # Megatron-LM's pretrain_gpt.py: model(tokens, position_ids, attention_mask,
    # labels=labels, loss_mask=loss_mask); loss_func: sum(losses * loss_mask), float64 here
    with_mtp.train()
    per_token = with_mtp(
        batch2["tokens"],
        batch2["position_ids"],
        None,
        labels=batch2["labels"],
        loss_mask=loss_mask,
    )
    ref = (per_token.double() * loss_mask.double()).sum()
    (ref * upstream).backward()
    out["ref_phase2"] = (ref.detach(), int(loss_mask.sum()), _grads(with_mtp))
    return out


def test_mtp_is_skipped_in_phase1_and_is_megatron_core_s_in_phase2():
    (r,) = run_distributed(_mtp_child, 1)
    assert r["mtp_names"], "the model has no MTP parameters"

    # phase 1: the bag loss without MTP; MTP parameters get exactly zero
    (loss, n, grads), (ref_loss, ref_n, ref_grads) = r["phase1"], r["ref_phase1"]
    assert n == ref_n
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads) | set(r["mtp_names"])
    for name, ref in ref_grads.items():
        assert ref is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
    for name in r["mtp_names"]:  # an exact zero, not None (DDP's bucket hooks must fire)
        assert grads[name] is not None and not grads[name].any(), name
    assert not r["phase1_logged"], r["phase1_logged"]  # nothing logged for MTP in phase 1

    # phase 2: megatron-core's GPTModel with the same MTP, loss and every gradient
    (loss, n, grads), (ref_loss, ref_n, ref_grads) = r["phase2"], r["ref_phase2"]
    assert n == ref_n == B * T - 3
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=name)
    assert all(grads[name].abs().sum() > 0 for name in r["mtp_names"])  # MTP trains
    assert r["phase2_logged"].shape == (1,) and float(r["phase2_logged"][0]) > 0
