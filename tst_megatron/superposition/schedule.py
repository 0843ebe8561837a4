"""The TST phase schedule and the loop's decisions, as pure functions of the iteration.

:class:`Schedule` is the one place that knows the plan (``docs/design.md``, "The schedule"):
phase 1 on iterations ``[0, N1)``, phase 2 on ``[N1, N)``, ``N1`` computed once. Resuming
recomputes the phase from the iteration number; no stage index is ever stored.
:func:`should_eval`, :func:`should_save` and :func:`should_exit` decide what happens after
a step, from the iteration and the settings only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from tst_megatron.superposition.bags import BagWeighting, TSTMode, mode_reads_bags


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
    mode: TSTMode = "full"
    """Phase-1 superposition (``--tst-mode``; paper section 5.2): ``full`` = bag-averaged
    input, MCE over the next bag (samples of S*T tokens); ``input`` = bag-averaged input,
    target the next bag's first token (S*T tokens); ``output`` = ordinary token input, MCE
    over the S tokens after each position (T tokens, as the baseline)."""

    def validate(self, train_iters: int) -> list[str]:
        """The problems of these settings, one line each naming the flag (empty: none).
        Reads only; the choice of ``bag_weighting`` is checked from its ``Literal`` type by
        the caller (:func:`tst_megatron.training.megatron_lm.tst_problems`)."""
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
        if self.mode != "full" and self.bag_size == 1:
            problems.append(
                f"--tst-mode {self.mode} needs --tst-bag-size > 1 (S = 1 has no phase 1)"
            )
        return problems

    def windows_per_sample(self) -> int:
        """``T``-token windows in one phase-1 sample: ``S`` (``full``, ``input``), 1 (``output``)."""
        return self.bag_size if mode_reads_bags(self.mode) else 1

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
    """What one optimizer step does, and where its data comes from.

    The first five fields are the plan (compared, printed); a training loop binds the last two
    (:meth:`bind`): this module knows nothing of datasets or models.
    """

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
    read_sample: Optional[Callable[[int], dict]] = dataclasses.field(
        default=None, compare=False, repr=False
    )
    """Sample ``i`` of the phase's data (a dict of ``[data_seq_length]`` tensors)."""
    forward_step: Optional[Callable] = dataclasses.field(default=None, compare=False, repr=False)
    """The phase's megatron-core forward-step function ``(data_iterator, model)``."""

    def data_step(self, iteration: int) -> int:
        """The phase-local data step of 0-based ``iteration``: phase 2 reads its own data from
        its step 0 (``N1``) on, whatever phase 1 read."""
        return iteration - self.first_iteration

    def bind(self, read_sample: Callable[[int], dict], forward_step: Callable) -> "Phase":
        """This phase reading ``read_sample`` and stepping with ``forward_step``."""
        return dataclasses.replace(self, read_sample=read_sample, forward_step=forward_step)


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

    def switches_after(self, iteration: int) -> bool:
        """True when ``iteration`` completed steps end phase 1 (``iteration == N1 > 0``)."""
        return 0 < self.n1 == iteration

    def bind(self, phase1: tuple, phase2: tuple) -> "Schedule":
        """The schedule with each phase bound to ``(read_sample, forward_step)`` (:meth:`Phase.bind`)."""
        return dataclasses.replace(
            self, phase1=self.phase1.bind(*phase1), phase2=self.phase2.bind(*phase2)
        )
