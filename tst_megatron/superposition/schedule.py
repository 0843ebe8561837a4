"""The TST settings (:class:`TSTConfig`, the ``--tst-*`` flags) and the phase schedule as a
pure function of the iteration.

:class:`Schedule` knows the plan (``docs/design.md``, "The schedule"): phase 1 on iterations
``[0, N1)``, phase 2 on ``[N1, N)``. Resuming recomputes the phase from the iteration number;
no stage index is ever stored. Megatron-LM's loop decides checkpoints, validation and exits.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tst_megatron.superposition.bags import BagWeighting, TSTMode, mode_reads_bags

#: r when neither --tst-phase1-iters nor --tst-phase1-fraction is given: the paper's 0.3.
DEFAULT_PHASE1_FRACTION = 0.3


@dataclasses.dataclass(frozen=True)
class TSTConfig:
    """Token superposition training (Peng et al. 2026): the first iterations train on bags
    of S contiguous tokens (input: the mean of their embeddings; output: the whole next bag,
    multi-hot cross-entropy), the rest is ordinary next-token training. --tst-bag-size 1
    (the default) is a plain Megatron-LM run."""

    bag_size: int = 1
    """Tokens per bag (S) in phase 1. 1 turns TST off. The paper used 6 for dense models and
    16 for its MoE. Default: 1."""
    phase1_iters: Optional[int] = None
    """Iterations in phase 1 (N1). Give this or --tst-phase1-fraction, not both. Default:
    0.3 of --train-iters."""
    phase1_fraction: Optional[float] = None
    """Share of --train-iters in phase 1 (r); N1 = round(r x train iterations), Python's round
    of the float product (an exact half to the even integer: 0.5 x 5 -> 2). Default: 0.3
    when --tst-bag-size > 1 and --tst-phase1-iters is not given."""
    bag_weighting: BagWeighting = "uniform"
    """Weights of the S targets of a bag in the phase-1 loss: uniform, or power (weight
    1/(k+1) for the k-th token, normalised; the paper found it steadier at S >= 8). Default:
    uniform."""
    save_at_switch: bool = True
    """Do not save a checkpoint at the end of phase 1 (by default one is saved there when
    --save is given)."""
    mode: TSTMode = "full"
    """What phase 1 superposes: full (bag-averaged input and the next bag as the target),
    input (bag-averaged input, the first token of the next bag as the target) or output (ordinary
    input, the next S tokens as the target; reads as much text as a baseline). Default:
    full."""
    loss_chunks: int = 1
    """Compute the output layer and the loss over this many chunks of the positions, in both
    phases, so that at most one chunk's logits (and their fp32 softmax) exist at a time; a
    chunk's logits are computed again in backward (one more matmul of the output layer). 1:
    megatron-core's output layer and cross-entropy. Default: 1."""

    def validate(self, train_iters: int) -> list[str]:
        """The problems of these settings, one line each naming the flag (empty: none).
        Reads only; the choice of ``bag_weighting`` is checked from its ``Literal`` type by
        the caller (:func:`tst_megatron.training.checks.tst.tst_problems`)."""
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
        if (
            isinstance(self.loss_chunks, bool)
            or not isinstance(self.loss_chunks, int)
            or self.loss_chunks < 1
        ):
            problems.append(f"--tst-loss-chunks must be an integer >= 1, got {self.loss_chunks!r}")
        if self.mode != "full" and self.bag_size == 1:
            problems.append(
                f"--tst-mode {self.mode} needs --tst-bag-size > 1 (S = 1 has no phase 1)"
            )
        return problems

    def notes(self, train_iters: int) -> list[str]:
        """What the user should know of these (valid) settings, one line each: phase-1 flags
        without a bag size (no phase 1), or a phase 1 that fills all ``train_iters``."""
        given = [
            flag
            for flag, value in (
                ("--tst-phase1-iters", self.phase1_iters),
                ("--tst-phase1-fraction", self.phase1_fraction),
            )
            if value is not None
        ]
        if self.bag_size == 1 and given:
            return [f"{' and '.join(given)} without --tst-bag-size > 1: no phase 1 (plain run)"]
        if self.bag_size > 1 and self.phase1_steps(train_iters) >= train_iters > 0:
            return [
                f"phase 1 fills all {train_iters} iterations: this run trains no next-token "
                "step (continue it from its last checkpoint with a larger --train-iters, the "
                "same --tst-phase1-iters and --override-opt-param-scheduler: the learning-rate "
                "schedule becomes the longer run's, from the checkpoint's iteration on)"
            ]
        return []

    def windows_per_sample(self) -> int:
        """``T``-token windows in one phase-1 sample: ``S`` (``full``, ``input``), 1 (``output``)."""
        return self.bag_size if mode_reads_bags(self.mode) else 1

    def phase1_steps(self, train_iters: int) -> int:
        """N1, the number of phase-1 optimizer steps out of ``train_iters``."""
        if self.bag_size == 1:
            return 0
        if self.phase1_iters is not None:
            return self.phase1_iters
        fraction = DEFAULT_PHASE1_FRACTION if self.phase1_fraction is None else self.phase1_fraction
        return int(round(fraction * train_iters))


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one optimizer step does: its phase, bag size and sequence lengths."""

    index: int
    """1 = superposition (bags), 2 = recovery (next-token)."""
    bag_size: int
    """S for this step (1 in phase 2)."""
    data_seq_length: int
    """Tokens per sample read from the data: ``S * T`` in phase 1 (``T`` with ``--tst-mode
    output``), ``T`` in phase 2."""
    model_seq_length: int
    """Positions the transformer processes: always ``T``; the pipeline schedule's ``seq_length``."""
    first_iteration: int = 0
    """Iteration at which the phase starts (0, or ``N1`` for phase 2)."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The run's two phases: phase 1 on iterations ``[0, N1)``, phase 2 on ``[N1, N)``.

    Build it with :meth:`plan`; ``N1 = 0`` (``S = 1``) is a plain next-token run.
    """

    train_iters: int
    """N, the optimizer steps of the whole run (``--train-iters``)."""
    phase1: Phase
    phase2: Phase

    @classmethod
    def plan(cls, tst: TSTConfig, *, seq_length: int, train_iters: int) -> "Schedule":
        """The schedule of ``tst`` for ``T = seq_length`` and ``N = train_iters`` (N1 computed here)."""
        n1, s, t = tst.phase1_steps(train_iters), tst.bag_size, seq_length
        data = tst.windows_per_sample() * t  # S*T, or T in output mode
        return cls(train_iters, Phase(1, s, data, t, 0), Phase(2, 1, t, t, n1))

    @property
    def n1(self) -> int:
        """N1: the number of phase-1 optimizer steps."""
        return self.phase2.first_iteration

    def phase_at(self, iteration: int) -> Phase:
        """The phase of 0-based ``iteration`` (the number of optimizer steps already taken)."""
        return self.phase1 if iteration < self.n1 else self.phase2
