"""Forward-step functions for megatron-core's pipeline schedules, one per phase.

Both follow Megatron's contract: ``forward_step(data_iterator, model) -> (output,
loss_func)``; ``loss_func(output) -> (loss_sum, num_tokens, report)`` with an *integer*
``num_tokens`` (the schedule accumulates it in an int tensor) and
``config.calculate_per_token_loss = True`` so gradients are scaled by the global token count.

Phase 1 (``docs/design.md``, "The method"): the first stage embeds bags with ``bag_embedding`` and
passes them as ``decoder_input``; the last stage takes vocab-parallel logits
(``labels=None``) and scores the next bag with the MCE. The MCE denominator
``sum_k w_k m_k`` is not an integer for power weights, so the loss returned is
``MCE_mb * n_mb`` with ``n_mb`` the integer number of scored slots: the schedule's
``sum / sum n`` then averages micro-batch MCEs weighted by their scored slots, which for
uniform weights is exactly the global MCE.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.utils import get_batch_on_this_cp_rank

from tst_megatron.superposition import (
    align_bag_targets,
    bag_embedding,
    bag_weights,
    fold_bags,
    multi_hot_cross_entropy,
    vocab_parallel_multi_target_cross_entropy,
)


def unwrap(model):
    """The ``GPTModel`` inside DDP (or other) wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _report(loss_sum: torch.Tensor, num_tokens: torch.Tensor) -> dict:
    return {"lm loss": torch.stack([loss_sum.detach().float(), num_tokens.float()])}


def make_phase1_step(
    *, bag_size: int, weighting: str, tp_group, cp_group: Optional[dist.ProcessGroup] = None
):
    """Forward step of the superposition phase for samples of ``S*T`` tokens."""
    weights = bag_weights(bag_size, weighting)

    def forward_step(data_iterator, model):
        # Every stage reads the micro-batch (cheap); only the first embeds, only the last scores.
        batch = next(data_iterator)
        gpt = unwrap(model)
        targets, mask = align_bag_targets(batch["labels"], batch["loss_mask"], bag_size)
        local = get_batch_on_this_cp_rank(
            {"bags": fold_bags(batch["tokens"], bag_size), "targets": targets, "mask": mask},
            cp_group=cp_group,
        )  # CP splits the latent sequence: whole bags per chunk
        x = bag_embedding(gpt.embedding, local["bags"]) if gpt.pre_process else None
        output = model(None, None, None, decoder_input=x, labels=None)

        def loss_func(logits):
            ce = vocab_parallel_multi_target_cross_entropy(
                logits, local["targets"], tp_group=tp_group
            )
            loss_sum, weight_sum = multi_hot_cross_entropy(ce, local["mask"], weights.to(ce.device))
            scored = (local["mask"] > 0).sum().to(torch.int)
            scale = torch.where(weight_sum > 0, scored.float() / weight_sum.clamp_min(1e-12), 0.0)
            loss = loss_sum * scale  # = MCE_mb * scored slots
            return loss, scored, _report(loss, scored)

        return output, loss_func

    return forward_step


def make_phase2_step(*, cp_group: Optional[dist.ProcessGroup] = None):
    """Forward step of ordinary next-token training (and of validation in both phases)."""

    def forward_step(data_iterator, model):
        batch = get_batch_on_this_cp_rank(dict(next(data_iterator)), cp_group=cp_group)
        per_token = model(
            batch["tokens"],
            batch["position_ids"],
            batch.get("attention_mask"),
            labels=batch["labels"],
        )
        loss_mask = batch["loss_mask"]

        def loss_func(output):
            loss = (output.float() * loss_mask).sum()
            num_tokens = loss_mask.sum().to(torch.int)
            return loss, num_tokens, _report(loss, num_tokens)

        return per_token, loss_func

    return forward_step
