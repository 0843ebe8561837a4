"""Pure functions of a study's arms and rows (no files, no processes): paired gaps,
crossings, the paper's equal-loss speedup, Student's t intervals and router verdicts.

Rows and arms are as :mod:`study` describes them; a *gap* is an arm's final validation loss
minus the same seed's baseline's, in nats.
"""

from __future__ import annotations

import math
import re
import shlex
import statistics

LEVEL = 0.95
"""The confidence level of the paired intervals."""

ROUTER_TOLERANCE = 0.05
"""A relative difference in mean load imbalance within which an arm counts as level with the
baseline."""

ROUTER_TAGS = ("load_balancing_loss", "load_imbalance")
"""The router's TensorBoard series an MoE arm records: Megatron-LM's aux loss (over its
coefficient; mean over layers) and ``benchmarks/moe_launcher.py``'s max/mean tokens per
expert, each also per layer (``moe/<tag>_layer_<i>``, ``--moe-per-layer-logging``)."""


def final(arm: dict) -> float:
    """An arm's final validation loss (nats)."""
    return arm["valid"][-1][1]


def flag_value(flags: list, name: str, default=None):
    """The value after the last ``name`` in ``flags`` (``default`` when absent)."""
    if name not in flags:
        return default
    return flags[len(flags) - 1 - flags[::-1].index(name) + 1]


def raw_tokens(flags: list, phases: list) -> int:
    """Tokens an arm read: for each iteration of the ``tst-phase`` series (``(step, phase)``),
    the global batch times ``S*T`` in phase 1 (``T`` with ``--tst-mode output``, which reads
    ordinary windows) or ``T`` in phase 2, as the launcher's raw-tokens counts."""
    gbs = int(flag_value(flags, "--global-batch-size"))
    seq = int(flag_value(flags, "--seq-length"))
    bag = int(flag_value(flags, "--tst-bag-size", 1))
    phase1 = seq if flag_value(flags, "--tst-mode", "full") == "output" else bag * seq
    return sum(gbs * (phase1 if phase == 1.0 else seq) for _, phase in phases)


def arm_lr(arm: dict) -> float:
    """The ``--lr`` of an arm's launcher command."""
    return float(flag_value(shlex.split(arm["command"]), "--lr"))


def seed_of(arm: dict) -> str:
    """The ``--seed`` of an arm's launcher command (``"?"`` without one)."""
    return flag_value(shlex.split(arm.get("command", "")), "--seed", "?")


def is_router_tag(tag: str) -> bool:
    return tag in ROUTER_TAGS or any(tag.startswith(f"moe/{name}_layer_") for name in ROUTER_TAGS)


def first_step_reaching(curve: list, target: float) -> "int | None":
    """The first iteration of ``[(iteration, loss)]`` at or below ``target``."""
    return next((step for step, value in curve if value <= target), None)


# --- paired gaps over the seeds -------------------------------------------------------


def seed_gaps(row: dict, label: str) -> list:
    """TST - baseline final validation loss of one arm at one length, one value per seed:
    each seed's arm against the same seed's baseline (paired)."""
    return [final(s["arms"][label]) - final(s["best"]) for s in row["seeds"] if label in s["arms"]]


def gaps(rows: list, label: str) -> list:
    """``[(steps, mean TST - baseline final validation loss over the seeds)]`` of one arm
    across the lengths."""
    return [(r["steps"], sum(g) / len(g)) for r in rows if (g := seed_gaps(r, label))]


def crossing(points: list) -> "tuple | None":
    """Where ``(steps, TST - baseline)`` points first go from above 0 to at or below it:
    ``(steps_before, steps_after, estimate)`` with the estimate linear in log(steps); None
    when they never cross (the caller tells 'always below' from 'always above')."""
    for (n0, d0), (n1, d1) in zip(points, points[1:]):
        if d0 > 0 >= d1:
            x = math.log(n0) + (math.log(n1) - math.log(n0)) * d0 / (d0 - d1)
            return n0, n1, round(math.exp(x))
    return None


def paired_interval(values: list, level: float = LEVEL) -> tuple:
    """``(mean, low, high)`` of paired gaps over the seeds: Student's t interval
    ``mean +- t_{(1+level)/2, n-1} * s / sqrt(n)``, ``s`` the sample standard deviation
    (``scipy.stats.t``); ``low`` and ``high`` are nan for one seed.

    Gaps -0.1, 0.0, +0.1: mean 0, s = 0.1, t_{0.975, 2} = 4.303: ``(0, -0.248, +0.248)``."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    from scipy.stats import t

    half = t.ppf((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """``ahead`` (the whole interval below zero), ``behind`` (above), else ``tie``."""
    if high < 0:
        return "ahead"
    if low > 0:
        return "behind"
    return "tie (the interval holds 0)"


# --- the paper's metric: equal-loss speedup -------------------------------------------


def equal_loss_steps(curve: list, loss: float) -> tuple:
    """The baseline length ``L'`` that reaches ``loss``: ``curve`` is the baseline's final
    validation loss at each measured length, ``[(steps, loss)]``; ``L'`` is interpolated
    linearly in log(steps) between the two measured lengths whose losses bracket ``loss``
    (the shortest such pair). Returns ``(L', "")``, or ``(None, "beyond")`` when ``loss`` is
    below every measured baseline loss (the baseline needs more than its longest length),
    ``(None, "above")`` when it is above every one (less than its shortest length).

    Raises ValueError on an empty curve.

    Baseline lengths 1000 -> 3.0 and 4000 -> 2.0, loss 2.5: ``L' = exp(log 1000 + log 4 / 2)
    = 2000``."""
    points = sorted(curve)
    if not points:
        raise ValueError("no baseline lengths")
    for (n0, l0), (n1, l1) in zip(points, points[1:]):
        if min(l0, l1) <= loss <= max(l0, l1):
            if l0 == l1:
                return float(n0), ""
            x = math.log(n0) + (math.log(n1) - math.log(n0)) * (l0 - loss) / (l0 - l1)
            return math.exp(x), ""
    if len(points) == 1 and loss == points[0][1]:
        return float(points[0][0]), ""
    if loss < min(v for _, v in points):
        return None, "beyond"
    if loss > max(v for _, v in points):
        return None, "above"
    return None, "unbracketed"  # a non-monotone curve that still misses loss: not expected


def equal_loss_speedup(curve: list, steps: int, loss: float) -> tuple:
    """``L' / L`` for an arm of ``steps`` = L with final validation loss ``loss``
    (:func:`equal_loss_steps`), as ``(value, where)``: ``where`` "" (exact), ``">"`` (beyond
    the longest baseline: the speedup is more than ``longest / L``, the value given), ``"<"``
    (above the shortest: less than ``shortest / L``)."""
    found, where = equal_loss_steps(curve, loss)
    lengths = [n for n, _ in curve]
    if where == "beyond":
        return max(lengths) / steps, ">"
    if where == "above":
        return min(lengths) / steps, "<"
    if where:
        return float("nan"), "?"
    return found / steps, ""


def baseline_curve(rows: list) -> list:
    """``[(steps, baseline final validation loss)]``, the mean over the seeds run at each
    length (each seed's baseline at the chosen LR)."""
    curve = []
    for r in rows:
        losses = [final(s["best"]) for s in r["seeds"]]
        curve.append((r["steps"], sum(losses) / len(losses)))
    return curve


def seed_speedups(rows: list, row: dict, label: str) -> list:
    """One arm's equal-loss speedup at one length, one ``(value, where)`` per seed: the
    seed's paired gap (arm - the same seed's baseline, :func:`seed_gaps`) added to the
    baseline curve's loss at that length (:func:`baseline_curve`, the mean over seeds), then
    read off that curve. Pairing removes the seed's offset, as the gaps do."""
    curve = baseline_curve(rows)
    at = dict(curve)[row["steps"]]
    return [equal_loss_speedup(curve, row["steps"], at + g) for g in seed_gaps(row, label)]


def dense_table(text: str) -> tuple:
    """``([(steps, baseline loss, [gaps or None per arm])], labels)`` from a horizons report's
    markdown table; gaps are ``[mean]`` or ``[mean, min, max]``."""
    number = r"[+-]?\d+\.\d+"
    rows, labels = [], []
    for line in text.splitlines():
        if line.startswith("| steps | baseline LR |"):
            labels = [c.split(":")[0].strip() for c in line.strip("|").split("|")[3:]]
        elif labels and re.match(r"\| \d+ \|", line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            base = float(re.match(number, cells[2]).group())
            arms = []
            for cell in cells[3:]:
                values = [float(x) for x in re.findall(number, cell)]
                if cell.startswith("not run") or not values:
                    arms.append(None)
                    continue
                arms.append(values[:3] if "[" in cell else values[:1])
            rows.append((int(cells[0]), base, arms))
        elif rows:
            break
    return rows, labels


# --- router health (MoE) -------------------------------------------------------------


def router_length(rows: list, labels: list) -> "dict | None":
    """The row whose router curves the report shows: the one whose first seed has the most
    TST arms that recorded them (the longest of those)."""
    candidates = [r for r in rows if "router" in r["seeds"][0]["best"]]
    if not candidates:
        return None
    return max(
        candidates,
        key=lambda r: (
            sum("router" in r["seeds"][0]["arms"].get(label, {}) for label in labels),
            r["steps"],
        ),
    )


def smooth(points: list, window: int) -> list:
    """A trailing moving average of ``[(step, value)]`` (``window`` points)."""
    out, total = [], 0.0
    for i, (step, value) in enumerate(points):
        total += value
        if i >= window:
            total -= points[i - window][1]
        out.append((step, total / min(i + 1, window)))
    return out


def window_mean(points: list, start: int, stop: int) -> "float | None":
    """The mean of ``[(step, value)]`` over ``start < step <= stop``."""
    values = [v for step, v in points if start < step <= stop]
    return sum(values) / len(values) if values else None


def layer_tags(router: dict, name: str) -> list:
    """The per-layer tags ``moe/<name>_layer_<i>`` of a router dict, in layer order."""
    prefix = f"moe/{name}_layer_"
    return sorted((t for t in router if t.startswith(prefix)), key=lambda t: int(t[len(prefix) :]))


def router_verdict(label: str, phase1: list, last: list) -> str:
    """One line: the arm's mean load imbalance against the baseline's (``[arm, baseline]``)
    in phase 1 and in the last 10 % of the run, and what that says: phase 1 more (or less)
    imbalanced than the baseline by more than :data:`ROUTER_TOLERANCE`, and whether the
    last 10 % is back within it."""
    during, after = phase1[0] / phase1[1] - 1, last[0] / last[1] - 1
    if during > ROUTER_TOLERANCE:
        what = "phase 1 routes less evenly than the baseline"
    elif during < -ROUTER_TOLERANCE:
        what = "phase 1 routes more evenly than the baseline"
    else:
        what = "phase 1 routes as evenly as the baseline"
    if abs(after) <= ROUTER_TOLERANCE:
        end = f"by the last 10 % it is level with the baseline (within {ROUTER_TOLERANCE:.0%})"
    else:
        side = "more" if after > 0 else "less"
        end = f"in the last 10 % it is still {side} imbalanced than the baseline"
    return (
        f"- {label}: {what} ({phase1[0]:.3f} vs {phase1[1]:.3f}, {100 * during:+.1f} %); "
        f"{end} ({last[0]:.3f} vs {last[1]:.3f}, {100 * after:+.1f} %)."
    )
