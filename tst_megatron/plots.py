"""A PNG of training and validation loss against steps, with the TST switch marked, read
from the launcher's TensorBoard events (Megatron-LM's tags)."""

from __future__ import annotations

import os

from tst_megatron.data.files import atomic_path


def read_scalars(tensorboard_dir: str) -> dict:
    """``{tag: [(step, value), ...]}`` of every scalar in ``tensorboard_dir`` (last write of
    a step wins, so a resumed run's events replace the overlapping ones)."""
    # TensorBoard's reader: heavy, only for plots
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(tensorboard_dir):
        raise ValueError(f"{tensorboard_dir} is not a directory of TensorBoard events")
    events = EventAccumulator(tensorboard_dir, size_guidance={"scalars": 0})
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        by_step = {e.step: e.value for e in events.Scalars(tag)}
        out[tag] = sorted(by_step.items())
    return out


def switch_iteration(phase_points) -> "int | None":
    """The iteration after which training switched to phase 2, from ``tst-phase`` points
    (the value at iteration ``i`` is the phase of the step that produced it), or None."""
    first_phase2 = next((step for step, value in phase_points if value == 2.0), None)
    if first_phase2 is None or not any(value == 1.0 for _, value in phase_points):
        return None
    return first_phase2 - 1


#: TensorBoard tags of the validation loss: the hand-written trainer's, then Megatron-LM's
#: (``evaluate_and_print_results`` writes ``"<key> validation"``).
VALIDATION_TAGS = ("validation lm loss", "lm loss validation")


def validation_tag(scalars: dict) -> "str | None":
    """The first of :data:`VALIDATION_TAGS` in ``scalars`` (tag -> points), or None."""
    return next((tag for tag in VALIDATION_TAGS if tag in scalars), None)


def plot_losses(tensorboard_dir: str, output: str, *, title: str = "TST pretraining") -> str:
    """Write the loss plot to ``output`` (PNG); return its path.

    Raises:
        ValueError: ``tensorboard_dir`` is missing or holds no training loss.
    """
    # matplotlib: optional and heavy, only for plots
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use(): pyplot takes its backend on import

    scalars = read_scalars(tensorboard_dir)
    if not any(tag in scalars for tag in ("mce loss", "lm loss")):
        raise ValueError(f"no training loss in {tensorboard_dir}")
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    if "mce loss" in scalars:
        ax.plot(
            *zip(*scalars["mce loss"]), label="train: bag MCE loss (phase 1)", color="tab:orange"
        )
    if "lm loss" in scalars:
        ax.plot(
            *zip(*scalars["lm loss"]), label="train: next-token loss (phase 2)", color="tab:blue"
        )
    valid = validation_tag(scalars)
    if valid is not None:
        ax.plot(
            *zip(*scalars[valid]),
            "o-",
            label="validation: next-token loss",
            color="tab:green",
            markersize=3,
        )
    switch = switch_iteration(scalars.get("tst-phase", []))
    if switch is not None:
        ax.axvline(
            switch,
            color="gray",
            linestyle="--",
            label=f"switch to next-token at iteration {switch}",
        )
    ax.set_xlabel("iteration (equal FLOPs per step)")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    return save_figure(fig, ax, output)


def save_figure(fig, ax, path: str) -> str:
    """Grid, legend and tight layout on ``ax``, then write ``fig`` as PNG to ``path``
    atomically (temporary name, then rename) and close it. Returns ``path``."""
    # matplotlib: optional and heavy, only for plots
    import matplotlib.pyplot as plt

    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path
