"""Bag folding, label/mask alignment and slot weights (``docs/design.md``, "The method")."""

from __future__ import annotations

import torch

BAG_WEIGHTINGS = ("uniform", "power")


def _check_bag_size(bag_size: int) -> None:
    if isinstance(bag_size, bool) or not isinstance(bag_size, int) or bag_size < 1:
        raise ValueError(f"bag_size must be an integer >= 1, got {bag_size!r}")


def fold_bags(tokens: torch.Tensor, bag_size: int) -> torch.Tensor:
    """Fold a batch of token ids into contiguous, non-overlapping bags.

    Args:
        tokens: ``[b, S*T]`` integer token ids (any dtype; returned as a view when possible).
        bag_size: ``S >= 1``.

    Returns:
        ``[b, T, S]``: element ``[i, j, k]`` is ``tokens[i, j*S + k]``.

    Raises:
        ValueError: ``bag_size < 1``, ``tokens`` not 2-D, or the length not a multiple of
            ``bag_size``.
    """
    _check_bag_size(bag_size)
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [b, S*T], got shape {tuple(tokens.shape)}")
    b, length = tokens.shape
    if length % bag_size != 0:
        raise ValueError(f"sequence length {length} is not a multiple of bag_size {bag_size}")
    return tokens.reshape(b, length // bag_size, bag_size)


def align_bag_targets(
    labels: torch.Tensor, loss_mask: torch.Tensor, bag_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn standard next-token labels into the targets of the next bag.

    With ``x`` the sample's ``S*T + 1`` tokens, the standard labels are
    ``labels[i] = x[i+1]``. Slot ``k`` of latent position ``j`` targets
    ``x[(j+1)*S + k] = labels[j*S + k + S - 1]``: the labels shifted left by ``S - 1``,
    the tail padded, folded to ``[b, T, S]`` (``docs/design.md``, "Label alignment").
    The last latent position of a sample has only slot 0 valid.

    Args:
        labels: ``[b, S*T]`` integer next-token labels.
        loss_mask: ``[b, S*T]`` standard loss mask (bool, int or float; 1 = scored).
        bag_size: ``S >= 1``; ``S = 1`` returns the labels and mask unchanged, folded.

    Returns:
        ``(targets, mask)``: ``targets`` ``[b, T, S]`` int64, ``mask`` ``[b, T, S]`` float32.
        Padded slots (past the end of the sample) have target 0 and mask 0.

    Raises:
        ValueError: shapes differ, are not 2-D, or the length is not a multiple of ``S``.
    """
    _check_bag_size(bag_size)
    if labels.shape != loss_mask.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape"
        )
    fold_bags(labels, bag_size)  # validates rank and divisibility
    shift = bag_size - 1
    targets = labels.new_zeros(labels.shape, dtype=torch.int64)
    mask = torch.zeros(labels.shape, dtype=torch.float32, device=labels.device)
    length = labels.shape[1]
    targets[:, : length - shift] = labels[:, shift:].to(torch.int64)
    mask[:, : length - shift] = loss_mask[:, shift:].to(torch.float32)
    return fold_bags(targets, bag_size), fold_bags(mask, bag_size)


def bag_weights(bag_size: int, kind: str = "uniform") -> torch.Tensor:
    """Slot weights ``w_k`` of the multi-hot cross-entropy.

    Args:
        bag_size: ``S >= 1``.
        kind: ``"uniform"`` (``w_k = 1/S``, the paper's default) or ``"power"``
            (``w_k ∝ 1/(k+1)``, normalised; the paper's appendix, better for ``S >= 8``).

    Returns:
        ``[S]`` float32, summing to 1.

    Raises:
        ValueError: ``bag_size < 1`` or an unknown ``kind``.
    """
    _check_bag_size(bag_size)
    if kind == "uniform":
        weights = torch.ones(bag_size, dtype=torch.float64)
    elif kind == "power":
        weights = 1.0 / torch.arange(1, bag_size + 1, dtype=torch.float64)
    else:
        raise ValueError(f"unknown bag weighting {kind!r}; choose one of {BAG_WEIGHTINGS}")
    return (weights / weights.sum()).to(torch.float32)
