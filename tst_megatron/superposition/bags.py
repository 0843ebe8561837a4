"""Bag folding, label/mask alignment and slot weights (``docs/design.md``, "The method")."""

from __future__ import annotations

from typing import Literal, get_args

import torch

BagWeighting = Literal["uniform", "power"]
"""Slot weights of the MCE loss: the one declaration of the choices."""
BAG_WEIGHTINGS = get_args(BagWeighting)


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


def bag_weights(bag_size: int, weighting: str = "uniform") -> torch.Tensor:
    """Slot weights ``w_k`` of the multi-hot cross-entropy.

    Args:
        bag_size: ``S >= 1``.
        weighting: ``"uniform"`` (``w_k = 1/S``, the paper's default) or ``"power"``
            (``w_k ∝ 1/(k+1)``, normalised; the paper's appendix, better for ``S >= 8``).

    Returns:
        ``[S]`` float32, summing to 1.

    Raises:
        ValueError: ``bag_size < 1`` or an unknown ``weighting``.
    """
    _check_bag_size(bag_size)
    if weighting == "uniform":
        weights = torch.ones(bag_size, dtype=torch.float64)
    elif weighting == "power":
        weights = 1.0 / torch.arange(1, bag_size + 1, dtype=torch.float64)
    else:
        raise ValueError(f"unknown bag weighting {weighting!r}; choose one of {BAG_WEIGHTINGS}")
    return (weights / weights.sum()).to(torch.float32)


# --- superposition modes (paper section 5.2; ``--tst-mode``) -------------------------------

TSTMode = Literal["full", "input", "output"]
TST_MODES = get_args(TSTMode)
"""The phase-1 superposition modes. With ``x`` a sample's tokens and ``y[i] = x[i+1]`` its
standard next-token labels:

- ``full`` (default, the paper's TST): input position ``j`` is the mean embedding of bag
  ``j`` (``x[j*S .. j*S+S-1]``); it predicts the whole next bag, slot ``k`` targeting
  ``x[(j+1)*S + k]``, scored with the MCE over ``S`` slots. Samples of ``S*T`` tokens.
- ``input`` (input-only superposition): the same bag-averaged input; the target is the
  *first token of the next bag*, ``x[(j+1)*S]``: one slot, so the MCE (k = 1, weight 1) is
  the ordinary cross-entropy. Samples of ``S*T`` tokens.
- ``output`` (output-only superposition): ordinary token input, position ``i`` is token
  ``x[i]``; it predicts the ``S`` tokens that follow it, slot ``k`` targeting
  ``x[i+1+k] = y[i+k]``, scored with the MCE over ``S`` slots (slot 0 is the ordinary
  next token). Samples of ``T`` tokens, as the baseline: no more data is read. The last
  ``S - 1`` positions of a sample score only the slots whose target lies in the sample.

Phase 2 is ordinary next-token training in every mode; the model and its state-dict keys
are the same in every mode.
"""


def _check_mode(mode: str) -> None:
    if mode not in TST_MODES:
        raise ValueError(f"unknown TST mode {mode!r}; choose one of {TST_MODES}")


def mode_reads_bags(mode: str) -> bool:
    """True when phase-1 samples hold ``S*T`` tokens (``full``, ``input``); False when they
    hold ``T`` (``output``). Raises ``ValueError`` for an unknown mode."""
    _check_mode(mode)
    return mode != "output"


def following_token_targets(
    labels: torch.Tensor, loss_mask: torch.Tensor, bag_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets of output-only superposition: position ``i`` targets the ``S`` tokens after it.

    Slot ``k`` of position ``i`` is ``labels[i + k]`` (= ``x[i+1+k]``) with the loss mask of
    that label; slots past the end of the sample (``i + k >= T``) have target 0 and mask 0.

    Args:
        labels: ``[b, T]`` integer next-token labels.
        loss_mask: ``[b, T]`` standard loss mask (bool, int or float; 1 = scored).
        bag_size: ``S >= 1``; ``S = 1`` gives the labels and mask as ``[b, T, 1]``.

    Returns:
        ``(targets, mask)``: ``[b, T, S]`` int64 and ``[b, T, S]`` float32.

    Raises:
        ValueError: shapes differ or are not 2-D, or ``bag_size < 1``.
    """
    _check_bag_size(bag_size)
    if labels.shape != loss_mask.shape or labels.dim() != 2:
        raise ValueError(
            f"labels {tuple(labels.shape)} and loss_mask {tuple(loss_mask.shape)} must be the "
            "same [b, T] shape"
        )
    b, length = labels.shape
    targets = labels.new_zeros((b, length, bag_size), dtype=torch.int64)
    mask = torch.zeros((b, length, bag_size), dtype=torch.float32, device=labels.device)
    for k in range(min(bag_size, length)):
        targets[:, : length - k, k] = labels[:, k:].to(torch.int64)
        mask[:, : length - k, k] = loss_mask[:, k:].to(torch.float32)
    return targets, mask


def phase1_inputs(tokens: torch.Tensor, bag_size: int, mode: str) -> torch.Tensor:
    """The bags the phase-1 input embedding averages (:func:`bag_embedding`).

    Args:
        tokens: ``[b, S*T]`` (``full``, ``input``) or ``[b, T]`` (``output``) token ids.
        bag_size: ``S >= 1``.
        mode: one of :data:`TST_MODES`.

    Returns:
        ``[b, T, S]`` bags (``full``, ``input``) or ``[b, T, 1]`` (``output``: a bag of one
        token embeds exactly as the token).

    Raises:
        ValueError: unknown mode, or the checks of :func:`fold_bags`.
    """
    return fold_bags(tokens, bag_size if mode_reads_bags(mode) else 1)


def phase1_targets(
    labels: torch.Tensor, loss_mask: torch.Tensor, bag_size: int, mode: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase-1 targets and their mask, ``[b, T, k]`` each, for the MCE.

    ``full``: :func:`align_bag_targets`, ``k = S``. ``input``: its slot 0 only (the next
    bag's first token), ``k = 1``. ``output``: :func:`following_token_targets`, ``k = S``.

    Args:
        labels, loss_mask: ``[b, S*T]`` (``full``, ``input``) or ``[b, T]`` (``output``).
        bag_size: ``S >= 1``.
        mode: one of :data:`TST_MODES`.

    Returns:
        ``(targets, mask)``: int64 and float32, ``[b, T, k]``.

    Raises:
        ValueError: unknown mode, or the shape checks of the functions above.
    """
    if not mode_reads_bags(mode):
        return following_token_targets(labels, loss_mask, bag_size)
    targets, mask = align_bag_targets(labels, loss_mask, bag_size)
    if mode == "input":
        return targets[..., :1].contiguous(), mask[..., :1].contiguous()
    return targets, mask


def phase1_weights(bag_size: int, weighting: str, mode: str) -> torch.Tensor:
    """Slot weights of the phase-1 MCE: :func:`bag_weights` (``[S]``) for ``full`` and
    ``output``; ``[1.0]`` for ``input`` (one slot: the MCE is the cross-entropy).

    Raises:
        ValueError: unknown mode or weighting, or ``bag_size < 1``.
    """
    weights = bag_weights(bag_size, weighting)
    return weights if mode != "input" else torch.ones(1, dtype=torch.float32)
