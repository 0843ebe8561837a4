"""Forward-step functions for megatron-core's pipeline schedules, one per phase.

Both follow Megatron's contract: ``forward_step(data_iterator, model) -> (output,
loss_func)``; ``loss_func(output) -> (loss_sum, num_tokens, report)`` with an *integer*
``num_tokens`` (the schedule accumulates it in an int tensor) and
``config.calculate_per_token_loss = True`` so gradients are scaled by the global count.

Phase 1 (``docs/design.md``, "The method"): the first stage embeds bags with ``bag_embedding`` and
passes them as ``decoder_input``; the last stage gets per-slot cross-entropy ``[b, T, S]``
from the model's own loss seam (:class:`~tst_megatron.training.gpt.TSTGPTModel` with
``labels=`` the ``[b, T, S]`` bag targets) and reduces it to the MCE. A model with
multi-token prediction skips its MTP block there (see ``TSTGPTModel``); phase 2 and
validation run it as megatron-core does.

The unit of ``num_tokens`` is a *scored position* in both phases: a token whose loss mask
is 1 in phase 2, a latent position with at least one scored slot in phase 1. The loss
returned is ``MCE_mb * n_mb``. Two consequences:

- the step's loss (``sum / sum n``) is the MCE of the micro-batches weighted by their
  scored positions; with uniform weights and no masking inside bags it is exactly the
  paper's MCE, the mean over all scored slots (every micro-batch has the same
  slots-per-position ratio);
- megatron-core scales the MoE aux and z losses by the number of routed positions, which
  the global count divides: per position, the balancing gradient at a given
  ``--moe-aux-loss-coeff`` is the same in phase 1 as in phase 2 (counting slots would
  weigh it about ``1/S`` as much in phase 1).

Masked positions and slots are excluded by selection (``torch.where``), never by
multiplication, so an ``inf``/``nan`` there cannot reach the loss. Their gradient is zero,
and the model's loss seam turns a zero gradient into exactly zero on the logits' rows (the
cross-entropy's backward alone would give ``nan * 0 = nan``): phase 1 in
``vocab_parallel_multi_target_cross_entropy``, phase 2 and validation around megatron-core's
cross-entropy (:class:`~tst_megatron.training.gpt.TSTGPTModel`), so no gradient is
non-finite either. Nothing here reads a device value on the host.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist

from tst_megatron.superposition import (
    bag_embedding,
    multi_hot_cross_entropy,
)
from tst_megatron.superposition.bags import phase1_inputs, phase1_targets, phase1_weights


def unwrap(model):
    """The ``GPTModel`` inside DDP (or other) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _report(loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> dict:
    return {"lm loss": torch.stack([loss_sum.detach().float(), num_tokens.float()])}


def split_for_context_parallel(batch: dict, cp_size: int, cp_rank: int) -> dict:
    """This CP rank's share of a micro-batch: megatron-core's load-balanced (zig-zag) split.

    The sequence dimension (dim 1; dim 2 for ``attention_mask``) is cut into ``2 * cp_size``
    equal chunks and rank ``r`` keeps chunks ``r`` and ``2*cp_size - 1 - r``, concatenated,
    so causal attention costs the same on every rank. This is what
    ``megatron.core.utils.get_batch_on_this_cp_rank`` does (tested against 0.16.1's);
    owning it keeps the step independent of that function's signature, which changed in
    megatron-core 0.18 and 0.19. In phase 1 the split runs on the *latent* sequence of
    ``[b, T, S]`` bags, so each chunk holds whole bags and exactly their targets.

    Args:
        batch: name -> ``[b, T, ...]`` tensor (``attention_mask``: ``[b, 1, T, T]``) or ``None``.
        cp_size: context-parallel size; ``1`` returns ``batch`` unchanged.
        cp_rank: this rank in the CP group.

    Returns:
        A new dict with ``[b, T/cp_size, ...]`` tensors (views where possible).

    Raises:
        ValueError: a sequence length is not a multiple of ``2 * cp_size``.
    """
    if cp_size == 1:
        return batch
    chunks = 2 * cp_size
    out = {}
    for key, value in batch.items():
        if value is None:
            out[key] = None
            continue
        dim = 2 if key == "attention_mask" else 1
        length = value.shape[dim]
        if length % chunks:
            raise ValueError(
                f"{key}: sequence length {length} is not a multiple of 2 x CP = {chunks}"
            )
        parts = value.chunk(chunks, dim=dim)
        out[key] = torch.cat([parts[cp_rank], parts[chunks - 1 - cp_rank]], dim=dim)
    return out


@functools.lru_cache(maxsize=None)
def _slot_weights(bag_size: int, weighting: str, mode: str, device: torch.device) -> torch.Tensor:
    """``phase1_weights`` on ``device``, copied there once per run (not per micro-batch)."""
    return phase1_weights(bag_size, weighting, mode).to(device)


def _cp_split(batch: dict, cp_group: Optional[dist.ProcessGroup]) -> dict:
    if cp_group is None:
        return batch
    return split_for_context_parallel(batch, cp_group.size(), cp_group.rank())


def make_phase1_step(
    *,
    bag_size: int,
    weighting: str,
    tp_group=None,
    cp_group: Optional[dist.ProcessGroup] = None,
    mode: str = "full",
):
    """Forward step of the superposition phase in ``mode`` (``superposition.bags.TST_MODES``):
    samples of ``S*T`` tokens (``full``, ``input``) or ``T`` tokens (``output``), inputs from
    ``phase1_inputs`` (``[b, T, S]`` bags or ``[b, T, 1]``), targets ``[b, T, k]`` from
    ``phase1_targets``, MCE weights from ``phase1_weights``.

    ``tp_group`` is accepted for compatibility and unused: the model's loss seam takes the
    output layer's own group. ``cp_group`` splits the latent sequence (whole bags).
    """

    def forward_step(data_iterator, model):
        # Every stage reads the micro-batch (cheap); only the first embeds, only the last scores.
        batch = next(data_iterator)
        gpt = unwrap(model)
        targets, mask = phase1_targets(batch["labels"], batch["loss_mask"], bag_size, mode)
        bags = phase1_inputs(batch["tokens"], bag_size, mode)  # [b, T, S] or [b, T, 1]
        local = _cp_split({"bags": bags, "targets": targets, "mask": mask}, cp_group)
        x = bag_embedding(gpt.embedding, local["bags"]) if gpt.pre_process else None
        per_slot = model(None, None, None, decoder_input=x, labels=local["targets"])
        weights = _slot_weights(bag_size, weighting, mode, local["mask"].device)

        def loss_func(ce):
            loss_sum, weight_sum = multi_hot_cross_entropy(ce, local["mask"], weights)
            positions = (local["mask"] > 0).any(dim=-1).sum().to(torch.int)
            mce = torch.where(weight_sum > 0, loss_sum / weight_sum.clamp_min(1e-12), 0.0)
            loss = mce * positions  # = MCE_mb * scored positions (see the module docstring)
            return loss, positions, _report(loss, positions)

        return per_slot, loss_func

    return forward_step


def make_phase2_step(*, cp_group: Optional[dist.ProcessGroup] = None):
    """Forward step of ordinary next-token training (and of validation in both phases).

    The model gets ``labels=`` and ``loss_mask=`` as in Megatron-LM's ``pretrain_gpt.py``:
    megatron-core's multi-token prediction (``process_mtp_loss``) masks and counts its
    rolled labels with it; without MTP the model does not read it.
    """

    def forward_step(data_iterator, model):
        batch = _cp_split(dict(next(data_iterator)), cp_group)
        loss_mask = batch["loss_mask"]
        per_token = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
            loss_mask=loss_mask,
        )

        def loss_func(output):
            scored = loss_mask > 0
            loss = torch.where(scored, output.float(), 0.0).sum()
            num_tokens = scored.sum().to(torch.int)
            return loss, num_tokens, _report(loss, num_tokens)

        return per_token, loss_func

    return forward_step
