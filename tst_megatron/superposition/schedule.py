"""The TST phase schedule: a pure function of the step (TST_SPEC.md sections 2-4).

Resuming recomputes the phase from the iteration number; no stage index is ever stored.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tst_megatron.superposition.bags import BagWeighting


@dataclasses.dataclass(frozen=True)
class TSTConfig:
    """Token Superposition Training settings; each field is a ``--tst-*`` flag.

    ``bag_size = 1`` or zero phase-1 iterations is a plain baseline run.
    """

    bag_size: int = 1
    """S: tokens per bag in phase 1 (``--tst-bag-size``); 1 disables TST."""
    phase1_iters: Optional[int] = None
    """N1: optimizer steps in phase 1 (``--tst-phase1-iters``); None = use the fraction."""
    phase1_fraction: Optional[float] = None
    """r: phase-1 share of ``--train-iters`` (``--tst-phase1-fraction``), N1 = round(r * N).
    None with ``phase1_iters`` None means 0.3 when ``bag_size > 1`` (the paper's r)."""
    bag_weighting: BagWeighting = "uniform"
    """Slot weights of the MCE loss: ``uniform`` or ``power`` (``--tst-bag-weighting``)."""
    save_at_switch: bool = True
    """Save a checkpoint at step N1 (disable with ``--no-tst-save-at-switch``)."""

    def validate(self, train_iters: int) -> list[str]:
        """The problems of these settings, one line each naming the flag (empty: none).
        Reads only; the choice of ``bag_weighting`` is checked from its ``Literal`` type by
        the caller (:func:`tst_megatron.training.config.validate`)."""
        problems = []
        if (
            isinstance(self.bag_size, bool)
            or not isinstance(self.bag_size, int)
            or self.bag_size < 1
        ):
            problems.append(f"--tst-bag-size must be an integer >= 1, got {self.bag_size!r}")
        if self.phase1_iters is not None and self.phase1_fraction is not None:
            problems.append("give --tst-phase1-iters or --tst-phase1-fraction, not both")
        if self.phase1_iters is not None and not 0 <= self.phase1_iters <= train_iters:
            problems.append(
                f"--tst-phase1-iters {self.phase1_iters} must be in [0, --train-iters {train_iters}]"
            )
        if self.phase1_fraction is not None and not 0.0 <= self.phase1_fraction <= 1.0:
            problems.append(f"--tst-phase1-fraction {self.phase1_fraction} must be in [0, 1]")
        return problems

    def phase1_steps(self, train_iters: int) -> int:
        """N1, the number of phase-1 optimizer steps out of ``train_iters``."""
        if self.bag_size == 1:
            return 0
        if self.phase1_iters is not None:
            return self.phase1_iters
        fraction = 0.3 if self.phase1_fraction is None else self.phase1_fraction
        return int(round(fraction * train_iters))


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one optimizer step does."""

    index: int
    """1 = superposition (bags), 2 = recovery (next-token)."""
    bag_size: int
    """S for this step (1 in phase 2)."""
    data_seq_length: int
    """Tokens per sample read from the data: ``S * T`` in phase 1, ``T`` in phase 2."""
    model_seq_length: int
    """Positions the transformer processes: always ``T``; goes to the pipeline schedule."""


def phase_at(step: int, tst: TSTConfig, *, seq_length: int, train_iters: int) -> Phase:
    """The phase of 0-based optimizer step ``step``: steps ``0..N1-1`` are phase 1.

    Args:
        step: 0-based iteration (the number of optimizer steps already taken).
        tst: the TST settings.
        seq_length: ``T`` (``--seq-length``).
        train_iters: ``N`` (``--train-iters``).
    """
    if step < tst.phase1_steps(train_iters):
        return Phase(1, tst.bag_size, tst.bag_size * seq_length, seq_length)
    return Phase(2, 1, seq_length, seq_length)
