"""The study's figures (matplotlib, Agg): validation curves of one comparison, the paired
gaps against the horizon, and the router's health across the switch."""

from __future__ import annotations

from study.analysis import gaps, layer_tags, router_length, seed_gaps, smooth
from tst_megatron.plots import save_figure


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(best: dict, tst: dict, tst_label: str, path: str) -> None:
    """Validation loss against iterations of the baseline ``best`` and the TST arm ``tst``
    (its switch marked), written as a PNG at ``path``."""
    fig, ax = _pyplot().subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(*zip(*best["valid"]), "o-", ms=3, label=f"baseline (LR {best['lr']:g})")
    ax.plot(*zip(*tst["valid"]), "o-", ms=3, label=tst_label)
    if tst["switch"] is not None:
        ax.axvline(
            tst["switch"], color="gray", ls="--", label=f"TST switch (iteration {tst['switch']})"
        )
    ax.axhline(best["valid"][-1][1], color="tab:blue", ls=":", lw=1, label="baseline final")
    ax.set_xlabel("iteration (equal FLOPs per step)")
    ax.set_ylabel("validation next-token loss (nats)")
    save_figure(fig, ax, path)


def plot_horizons(rows: list, labels: list, path: str) -> None:
    """TST - baseline final validation loss against the run length (log scale), one line
    per arm: the mean over the seeds, the smallest and largest seed as error bars."""
    fig, ax = _pyplot().subplots(figsize=(8, 4.5), dpi=120)
    for label in labels:
        points = gaps(rows, label)
        if points:
            spread = [seed_gaps(r, label) for r in rows if seed_gaps(r, label)]
            low = [mean - min(g) for (_, mean), g in zip(points, spread)]
            high = [max(g) - mean for (_, mean), g in zip(points, spread)]
            ax.errorbar(*zip(*points), yerr=[low, high], fmt="o-", ms=4, capsize=3, label=label)
    ax.axhline(0.0, color="gray", ls="--", lw=1, label="baseline")
    ax.set_xscale("log")
    steps = [r["steps"] for r in rows]
    ax.set_xticks(steps, [str(n) for n in steps])
    ax.minorticks_off()
    ax.set_xlabel("training steps (each run its own WSD schedule; equal FLOPs per step)")
    ax.set_ylabel("TST - baseline final validation loss (nats)")
    save_figure(fig, ax, path)


def plot_router(rows: list, labels: list, path: str) -> bool:
    """The router's health against steps for the baseline and every TST arm of one length
    (:func:`~study.analysis.router_length`, its first seed): the aux loss (over its
    coefficient, mean over layers) and the load imbalance (max/mean tokens per expert, the
    mean over layers and the worst layer), moving averages over N/60 steps, each arm's switch
    marked. False (nothing written) when no arm has them."""
    row = router_length(rows, labels)
    if row is None:
        return False
    plt = _pyplot()
    lead = row["seeds"][0]
    window = max(1, row["steps"] // 60)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), dpi=110)
    arms = [("baseline", lead["best"])] + [
        (label, lead["arms"][label]) for label in labels if "router" in lead["arms"].get(label, {})
    ]
    for index, (label, arm) in enumerate(arms):
        router, color = arm["router"], f"C{index}"
        style = dict(color=color, lw=1.2 if label == "baseline" else 1.0)
        if "load_balancing_loss" in router:
            axes[0].plot(*zip(*smooth(router["load_balancing_loss"], window)), label=label, **style)
        if "load_imbalance" in router:
            axes[1].plot(*zip(*smooth(router["load_imbalance"], window)), label=label, **style)
        tags = layer_tags(router, "load_imbalance")
        if tags:
            worst = [
                (step, max(router[t][i][1] for t in tags))
                for i, (step, _) in enumerate(router[tags[0]])
            ]
            axes[2].plot(*zip(*smooth(worst, window)), label=label, **style)
        if arm.get("switch"):
            for ax in axes:
                ax.axvline(arm["switch"], color=color, ls="--", lw=0.8)
    titles = (
        "aux loss / coefficient (mean over layers)",
        "load imbalance, max/mean tokens per expert (mean over layers)",
        "load imbalance, worst layer",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel(f"iteration ({row['steps']}-step runs; dashed: each arm's switch)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
