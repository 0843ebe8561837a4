"""The study's markdown reports: one comparison (``tst_vs_baseline.md``), the grid
(``tst_grid.md``) and the horizons (``tst_horizons.md``, ``tst_moe*.md``), from the values of
:mod:`study.analysis`. Every line a report gets is written here; nothing is measured here."""

from __future__ import annotations

import os
import platform
import shlex
import sys

from measure import write, write_index

from study.analysis import (
    LEVEL,
    ROUTER_TAGS,
    arm_lr,
    baseline_curve,
    crossing,
    dense_table,
    equal_loss_speedup,
    final,
    first_step_reaching,
    gaps,
    layer_tags,
    paired_interval,
    router_length,
    router_verdict,
    seed_gaps,
    seed_of,
    seed_speedups,
    verdict,
    window_mean,
)
from study.definitions import (
    EVAL_ROUNDS,
    ROOT,
    arm_label,
    batch_shape,
    describe,
    report_name,
    whole_split_iters,
)
from study.plots import plot_horizons, plot_router


def invocation() -> str:
    """This script's command line as run (for the reports)."""
    return shlex.join(["benchmarks/tst_vs_baseline.py", *sys.argv[1:]])


def machine_line(args) -> str:
    """The report's machine: the GPUs (``--device cuda``) or the CPU and its gloo processes."""
    if args.device == "cuda":
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "GPU"
        return (
            f"Machine: {args.nnodes} node(s) x {args.nproc_per_node} {gpu}, "
            f"Python {platform.python_version()}."
        )
    return (
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, Python "
        f"{platform.python_version()}, {args.nproc_per_node} gloo processes, no GPU."
    )


# --- one comparison and the grid ----------------------------------------------------------


def report(args, corpus, baselines: list, best: dict, tst: dict, size: int, fraction) -> str:
    """``tst_vs_baseline.md``: the LR sweep, the baseline at its best LR against TST S =
    ``size``, r = ``fraction``, and when TST reaches the baseline's final loss."""
    base_final, tst_final = final(best), final(tst)
    reach = first_step_reaching(tst["valid"], base_final)
    steps = best["valid"][-1][0]
    outcome = (
        f"TST reaches the baseline's final validation loss at step {reach} of {steps}: "
        f"{steps / reach:.2f}x fewer steps (equal FLOPs per step)"
        if reach
        else "TST does not reach the baseline's final validation loss within the run at this scale"
    )
    data = ""
    if corpus.train_tokens:  # a --preset study: how much distinct text each arm read
        data = (
            f" Corpus `{corpus.digest}` (first 16 hex digits of the SHA-256 of the `.idx` and "
            f"`.bin`): {corpus.train_tokens:,} training and {corpus.valid_tokens:,} held-out "
            f"validation tokens; a *pass* is the tokens an arm read over the training split "
            "(above 1: text was read again). Both arms are scored on the same validation "
            "windows."
        )
    lines = [
        "# TST vs baseline at matched FLOPs",
        "",
        machine_line(args),
        "",
        f"Model/data: {describe(args, corpus)}, {args.train_iters} steps. TST: S = {size}, "
        f"r = {fraction}.{data}",
        "",
        "## Learning rate (chosen for the baseline, used by both arms)",
        "",
        "| LR | baseline final validation loss |",
        "|---|---|",
    ]
    lines += [f"| {b['lr']:g} | {final(b):.4f} |" for b in baselines]
    lines += [
        "",
        "## Result",
        "",
        "| arm | final validation loss | tokens consumed | passes | wall-clock (s) | tokens/s |",
        "|---|---|---|---|---|---|",
        _result_row(f"baseline (LR {best['lr']:g})", best, corpus),
        _result_row(f"TST S={size}, r={fraction}", tst, corpus),
        "",
        f"Difference (TST - baseline): {tst_final - base_final:+.4f} nats. {outcome}.",
        "",
        "![validation curves](tst_vs_baseline.png)",
        "",
        f"Commands (run by `{invocation()}`):",
        "",
        f"    baseline: {best['command']}",
        f"    TST:      {tst['command']}",
        "",
    ]
    return "\n".join(lines)


def _result_row(name: str, arm: dict, corpus) -> str:
    """One arm's line of :func:`report`'s table: tokens/s from the arm's wall-clock (its whole
    launch: start-up, evaluations and saves included)."""
    passes = f"{arm['tokens'] / corpus.train_tokens:.2f}" if corpus.train_tokens else "-"
    rate = arm["tokens"] / arm["wall_s"] if arm["wall_s"] else float("nan")
    return (
        f"| {name} | {final(arm):.4f} | {arm['tokens']} | {passes} | {arm['wall_s']:.0f} "
        f"| {rate:,.0f} |"
    )


def grid_report(args, best: dict, grid_rows: list) -> str:
    """``tst_grid.md``: one table line per (S, r) of ``grid_rows`` (``(S, r, arm)``)."""
    lines = []
    for s, r, tst in grid_rows:
        reach = first_step_reaching(tst["valid"], final(best))
        lines.append(
            f"| {s} | {r} | {final(tst):.4f} | {final(tst) - final(best):+.4f} "
            f"| {reach if reach else 'not reached'} | {tst['tokens']} |"
        )
    return "\n".join(
        [
            "# TST grid: bag size S x phase-1 fraction r",
            "",
            f"Same model, data, schedule and {args.train_iters} steps as `tst_vs_baseline.md`; "
            f"LR {best['lr']:g} for every arm (the baseline's best among `--lrs {args.lrs}`); "
            f"baseline final validation loss {final(best):.4f} ({best['tokens']} tokens). "
            f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores, 2 gloo processes.",
            "",
            "| S | r | final validation loss | vs baseline | step reaching the baseline's final loss "
            "| tokens consumed |",
            "|---|---|---|---|---|---|",
            *lines,
            "",
            "Command: `.venv/bin/python benchmarks/tst_vs_baseline.py --grid --lrs "
            + args.lrs
            + "`",
            "",
        ]
    )


# --- the horizons report ------------------------------------------------------------------


def gap_cell(values: list) -> str:
    """``+0.0123`` for one seed; ``+0.0123 [-0.0040, +0.0301] (3 seeds)``: mean, then the
    smallest and largest seed's gap."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:+.4f}"
    return f"{mean:+.4f} [{min(values):+.4f}, {max(values):+.4f}] ({len(values)} seeds)"


def speedup_cell(values: list) -> str:
    """``1.85`` (one seed); ``1.85 [1.60, 2.10] (3 seeds)``: mean, smallest, largest; with
    any seed outside the measured baselines, each seed's value (``>2.00``: beyond the longest
    baseline, more than that; ``<0.50``: above the shortest, less than that)."""
    if not values:
        return "not run"
    if any(where for _, where in values):
        cells = [f"{where}{value:.2f}" for value, where in values]
        note = (
            " (beyond the longest baseline)"
            if all(w == ">" for _, w in values)
            else " (above the shortest baseline)"
            if all(w == "<" for _, w in values)
            else ""
        )
        return ", ".join(cells) + note
    mean = sum(v for v, _ in values) / len(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    low, high = min(v for v, _ in values), max(v for v, _ in values)
    return f"{mean:.2f} [{low:.2f}, {high:.2f}] ({len(values)} seeds)"


def crossing_text(label: str, points: list, last_seeds: "list | None" = None) -> str:
    """One line: where the mean gaps ``points`` (``[(steps, gap)]``) change sign, if they do;
    with ``last_seeds`` (the last length's gap at each seed) it adds when those seeds fall on
    both sides of zero: a tie within the seeds' spread, whatever the mean's sign."""
    if not points:
        return f"- {label}: not run."
    tie = ""
    if last_seeds and min(last_seeds) < 0 < max(last_seeds):
        tie = (
            f" At {points[-1][0]} steps its seeds fall on both sides of the baseline "
            f"({min(last_seeds):+.4f} to {max(last_seeds):+.4f}): a tie within the seeds' spread."
        )
    found = crossing(points)
    if found:
        n0, n1, estimate = found
        return (
            f"- {label}: crosses the baseline between {n0} and {n1} steps "
            f"(about {estimate} by linear interpolation in log steps).{tie}"
        )
    if all(d <= 0 for _, d in points):
        return f"- {label}: at or below the baseline at every length measured.{tie}"
    return (
        f"- {label}: above the baseline at every length measured "
        f"(last gap {points[-1][1]:+.4f} nats at {points[-1][0]} steps).{tie}"
    )


def below_text(rows: list, labels: list) -> str:
    """The report's line of the lengths where an arm is below the baseline: below at every
    seed run, or below on the mean only, not at every seed (a tie within the seeds' spread,
    not a win)."""
    every, mean_only = [], []
    for label in labels:
        for r in rows:
            values = seed_gaps(r, label)
            if values and max(values) < 0:
                one = ", one seed" if len(values) == 1 else ""
                every.append(f"{label} at {r['steps']} steps ({gap_cell(values)}{one})")
            elif values and sum(values) < 0:
                mean_only.append(f"{label} at {r['steps']} steps ({gap_cell(values)})")
    text = "TST below the baseline at equal steps, at every seed run: " + (
        "; ".join(every) if every else "none"
    )
    if mean_only:
        text += "; below on the mean only, not at every seed (a tie): " + "; ".join(mean_only)
    return text + "."


def ranking_lines(rows: list, labels: list) -> list:
    """At each length with more than one arm: the arms from the lowest mean final validation
    loss (TST - baseline, over the seeds run) up."""
    lines = []
    for r in rows:
        ranked = sorted((sum(g) / len(g), label) for label in labels if (g := seed_gaps(r, label)))
        if len(ranked) > 1:
            lines.append(
                f"Arms at {r['steps']} steps from the lowest final validation loss: "
                + ", ".join(f"{label} ({gap:+.4f})" for gap, label in ranked)
                + "."
            )
    return lines + [""] if lines else []


def speedup_section(rows: list, labels: list) -> list:
    """The report's lines of the equal-loss speedup of every arm at every length."""
    curve = baseline_curve(rows)
    lines = [
        "## Equal-loss speedup (the paper's metric)",
        "",
        "For a TST arm of L steps with final validation loss x: the baseline length L' that "
        "reaches x, linear in log(steps) between the measured baseline lengths (each its own "
        "complete WSD run at its best LR; the mean over the seeds run at that length: "
        + ", ".join(f"{n}: {v:.4f}" for n, v in curve)
        + "); speedup = L'/L. Each seed's x is its paired gap added to the baseline's mean "
        "at L; a cell gives the mean and, in brackets, the smallest and largest seed. `>a`: "
        "below the longest baseline's loss, a speedup of more than a; `<a`: above the "
        "shortest baseline's loss, less than a.",
        "",
        "| steps | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for r in rows:
        cells = [speedup_cell(seed_speedups(rows, r, label)) for label in labels]
        lines.append(f"| {r['steps']} | " + " | ".join(cells) + " |")
    return lines


def statistics_section(rows: list, labels: list) -> list:
    """The report's paired statistics at each length run at two seeds or more: the mean gap,
    its t interval (:func:`~study.analysis.paired_interval`), the seeds below the baseline,
    the equal-loss speedup at the mean gap and at the interval's ends (a lower gap is a
    higher speedup) and the verdict (:func:`~study.analysis.verdict`)."""
    curve = baseline_curve(rows)
    body = []
    for r in rows:
        for label in labels:
            values = seed_gaps(r, label)
            if len(values) < 2:
                continue
            mean, low, high = paired_interval(values)
            at = dict(curve)[r["steps"]]
            speed = [equal_loss_speedup(curve, r["steps"], at + g) for g in (mean, high, low)]
            (m, mw), (lo, lw), (hi, hw) = speed
            below = sum(v < 0 for v in values)
            body.append(
                f"| {r['steps']} | {label} | {len(values)} | {mean:+.4f} | "
                f"[{low:+.4f}, {high:+.4f}] | {below} of {len(values)} | "
                f"{mw}{m:.2f} [{lw}{lo:.2f}, {hw}{hi:.2f}] | {verdict(low, high)} |"
            )
    if not body:
        return []
    return [
        "",
        "## Paired statistics over the seeds",
        "",
        f"Each row: the mean paired gap (TST - the same seed's baseline), its {LEVEL:.0%} "
        "interval by Student's t over the seeds (n - 1 degrees of freedom, `scipy.stats.t`), "
        "how many seeds are below their baseline, and the equal-loss speedup (as above) at "
        "the mean gap, in brackets at the interval's ends (`>a`, `<a`: beyond the measured "
        "baselines). Ahead or behind only where the whole interval is on one side of 0.",
        "",
        f"| steps | arm | seeds | mean gap | {LEVEL:.0%} t-interval | seeds below | "
        "equal-loss speedup | verdict |",
        "|---|---|---|---|---|---|---|---|",
        *body,
    ]


def dense_speedup_report(path: str) -> str:
    """The equal-loss speedups of the dense horizons table ``path`` (its markdown table:
    steps, LR, baseline loss, then per arm ``mean [min, max]`` gaps): the baseline curve is
    the table's baseline column, an arm's loss that plus its gap; the spread comes from the
    smallest and largest seed's gap (the speedup falls as the loss rises). "" without it."""
    if not path or not os.path.exists(path):
        return ""
    with open(path) as f:
        rows, labels = dense_table(f.read())
    if not rows:
        return ""
    curve = [(n, base) for n, base, _ in rows]
    lines = [
        "## Equal-loss speedup of the dense table",
        "",
        f"From `{os.path.relpath(path, ROOT)}` (its baseline column: "
        + ", ".join(f"{n}: {v:.4f}" for n, v in curve)
        + "; each arm's loss is that plus its gap). A cell: the speedup of the mean gap, then "
        "in brackets those of the largest and smallest seed gap where the table gives them.",
        "",
        "| steps | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for n, base, cells in rows:
        out = []
        for gaps_ in cells:
            if gaps_ is None:
                out.append("not run")
                continue
            mean = equal_loss_speedup(curve, n, base + gaps_[0])
            text = f"{mean[1]}{mean[0]:.2f}"
            if len(gaps_) == 3:
                worst, best_ = (equal_loss_speedup(curve, n, base + g) for g in gaps_[2:0:-1])
                text += f" [{worst[1]}{worst[0]:.2f}, {best_[1]}{best_[0]:.2f}]"
            out.append(text)
        lines.append(f"| {n} | " + " | ".join(out) + " |")
    longest = max(n for n, _ in curve)
    lines += [
        "",
        f"`>a`: the arm is below the {longest}-step baseline, the longest measured; its "
        f"speedup is more than a (a {2 * longest}-step baseline would say how much more). "
        "`<a`: above the shortest baseline.",
        "",
    ]
    return "\n".join(lines)


def fraction_text(args, labels: list) -> str:
    """The report's words for the phase-1 fraction r of the arms."""
    if any(" r=" in label for label in labels):
        return f"r as each arm's label gives it (else {args.phase1_fraction:g})"
    return f"r = {args.phase1_fraction}"


def seeds_text(rows: list) -> str:
    """The seeds run besides the first, with the lengths they ran at, as they are in ``rows``
    (a seed whose baseline is missing is not counted): ``"1235, 1236 at 3000 steps and 1235,
    1236, 1237 at 6000 steps"``; "" when only the first seed ran."""
    lengths = {}
    for r in rows:
        others = tuple(s["seed"] for s in r["seeds"][1:])
        if others:
            lengths.setdefault(others, []).append(str(r["steps"]))
    return " and ".join(
        f"{', '.join(str(s) for s in seeds)} at {', '.join(steps)} steps"
        for seeds, steps in lengths.items()
    )


def horizons_report(args, corpus, rows: list, labels: list, name: str) -> str:
    """The horizons report ``name``.md: the table of paired gaps (and passes over the
    training split) per length and arm, where the curves cross, the equal-loss speedups, the
    paired statistics, the baseline LRs tried and every arm's launcher command."""
    gbs, seq = batch_shape(args)
    first = args.seeds_list[0]
    header = "| steps | baseline LR | baseline final validation loss (passes) | " + " | ".join(
        f"{label}: TST - baseline (passes)" for label in labels
    )
    title = "MoE: TST vs baseline" if args.model == "moe" else "TST vs baseline"
    lines = [
        f"# {title} across training horizons",
        "",
        machine_line(args),
        "",
        f"Model/data: {describe(args, corpus)}. Every arm has its own complete WSD schedule "
        f"(warmup N/20, decay over the last 10 %); {fraction_text(args, labels)}; every TST arm "
        "uses the baseline's best LR at that length. Training split: "
        f"{corpus.train_tokens:,} tokens; a *pass* is the tokens an arm read divided by that "
        "(more than 1: the data was repeated). Corpus: the first 16 hex digits of the "
        f"SHA-256 of the `.idx` and `.bin`, `{corpus.digest}` (the same digest, the "
        "same tokens).",
        "",
        "Validation: the final validation loss (the table, the gaps) is Megatron-LM's own "
        "evaluation of each arm's last checkpoint on the whole validation split "
        f"({corpus.valid_tokens:,} held-out tokens, {whole_split_iters(args, corpus)} global "
        f"batches of {gbs} x {seq}: the launcher with `--skip-train --load`), so every "
        "arm is scored on the same windows and the gaps are paired; during training "
        f"{args.eval_iters} batches every N/{4 if args.smoke else EVAL_ROUNDS} steps and at the "
        f"switch. Seed {first}"
        + (
            f"; also seeds {seeds_text(rows)}, each arm against the baseline of its own seed (at "
            "the first seed's best LR); a cell gives the mean gap and, in brackets, the smallest "
            "and largest seed's gap (the plot's error bars)."
            if seeds_text(rows)
            else "."
        ),
        "",
        "Modes: `full` = bag-averaged input and MCE over the next bag; `input` = bag-averaged "
        "input, next bag's first token as the target; `output` = ordinary token input, each "
        "position scored with the MCE on the S tokens that follow it (reads what the baseline reads).",
        "",
        header + " |",
        "|---|---|---|" + "---|" * len(labels),
    ]
    train = corpus.train_tokens
    for r in rows:
        lead = r["seeds"][0]
        base = lead["best"]
        cells = [
            str(r["steps"]),
            f"{base['lr']:g}",
            f"{final(base):.4f} ({base['tokens'] / train:.3g})",
        ]
        for label in labels:
            arm = lead["arms"].get(label)
            cells.append(
                f"{gap_cell(seed_gaps(r, label))} ({arm['tokens'] / train:.3g})"
                if arm
                else "not run"
            )
        lines.append("| " + " | ".join(cells) + " |")
    for r in rows:  # arms read back by --reuse may predate a better baseline LR
        lead = r["seeds"][0]
        lrs = {arm_lr(arm) for arm in lead["arms"].values()} - {lead["best"]["lr"]}
        if lrs:
            lines += [
                "",
                f"At {r['steps']} steps the TST arms ran at LR "
                f"{', '.join(f'{lr:g}' for lr in sorted(lrs))}, not at the baseline's best "
                f"({lead['best']['lr']:g}): the gaps above are against the better baseline.",
            ]
    lines += ["", "## Where the curves cross", ""]
    for label in labels:
        seeds = [g for r in rows if (g := seed_gaps(r, label))]
        lines.append(crossing_text(label, gaps(rows, label), seeds[-1] if seeds else None))
    lines += ["", below_text(rows, labels), ""]
    lines += ranking_lines(rows, labels) + speedup_section(rows, labels)
    lines += statistics_section(rows, labels)
    lines += [
        "",
        f"![TST - baseline against steps]({name}.png)",
        "",
        "## Learning rates tried for the baseline",
        "",
        "| steps | LR | final validation loss |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['steps']} | {b['lr']:g} | {final(b):.4f} |" for r in rows for b in r["baselines"]
    ]
    written = (
        "Written from the recorded arm files (`arm.json`, nothing run) by"
        if args.report_only
        else "Command:"
    )
    lines += ["", f"{written} `.venv/bin/python {invocation()}`; each arm's launcher command:", ""]
    for r in rows:
        lead = r["seeds"][0]
        lines.append(f"    {lead['best']['command']}")
        lines += [f"    {arm['command']}" for arm in lead["arms"].values()]
    return "\n".join(lines) + "\n"


def router_report(rows: list, labels: list, png: str) -> str:
    """The router-health section: per arm of the first seed, the load imbalance and the aux
    loss in phase 1 (after the warmup), in the first N/20 steps after the switch and in the
    last 10 % of the run, each against the baseline's over the same steps."""
    row = router_length(rows, labels)
    lead = row["seeds"][0]
    base = lead["best"]["router"]
    n = row["steps"]
    lines = [
        "## Router health across the switch",
        "",
        f"The {n}-step runs of seed {seed_of(lead['best'])}. Load imbalance: max over mean tokens "
        "per expert in a layer, over every token of an iteration's global batch (1 is "
        "perfect, 4 the worst for top-2 of 8), recorded by `benchmarks/moe_launcher.py` in "
        "Megatron-LM's MoE metrics tracker, mean over the layers (`load_imbalance`) and per "
        "layer (`moe/load_imbalance_layer_<i>`); aux loss: Megatron-LM's "
        "`load_balancing_loss` (over its coefficient, 1 at uniform routing). Dropless routing: "
        "no capacity, no dropped tokens. Each cell: the arm, then (the baseline over the same "
        "iterations).",
        "",
        "| arm | switch | imbalance: phase 1 | imbalance: first N/20 after the switch | "
        "imbalance: last 10 % | aux loss: phase 1 | aux loss: first N/20 after | aux loss: "
        "last 10 % | worst layer, phase 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for label in labels:
        arm = lead["arms"].get(label)
        if not arm or "router" not in arm or not arm.get("switch"):
            continue
        router, switch = arm["router"], arm["switch"]
        windows = [(n // 20, switch), (switch, switch + n // 20), (n - n // 10, n)]
        cells = [label, str(switch)]
        for tag in ROUTER_TAGS[::-1]:
            for start, stop in windows:
                mine, theirs = (window_mean(r.get(tag, []), start, stop) for r in (router, base))
                cells.append(
                    f"{mine:.3f} ({theirs:.3f})" if mine is not None and theirs is not None else "-"
                )
        worst = [
            (t, window_mean(router[t], n // 20, switch))
            for t in layer_tags(router, "load_imbalance")
        ]
        worst = [(t, v) for t, v in worst if v is not None]
        if worst:
            t, v = max(worst, key=lambda x: x[1])
            cells.append(f"layer {t.rsplit('_', 1)[1]}: {v:.3f}")
        else:
            cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
        phase1 = [window_mean(r.get("load_imbalance", []), n // 20, switch) for r in (router, base)]
        last = [window_mean(r.get("load_imbalance", []), n - n // 10, n) for r in (router, base)]
        if None not in phase1 + last:
            notes.append(router_verdict(label, phase1, last))
    lines += ["", *notes, "", f"![router health against steps]({png})", ""]
    return "\n".join(lines)


def write_horizons_report(args, corpus, rows: list, arms: list) -> str:
    """Write the horizons report and its figures under ``--output-dir`` (MoE: with the
    router section, the dense table's speedups and the link to the cost report), then the
    index ``docs/results.md``; returns the report's text."""
    name = report_name(args)
    labels = [arm_label(*spec) for spec in arms]
    plot_horizons(rows, labels, os.path.join(args.output_dir, name + ".png"))
    text = horizons_report(args, corpus, rows, labels, name)
    if args.model == "moe":
        router_png = name + "_router.png"
        if plot_router(rows, labels, os.path.join(args.output_dir, router_png)):
            text += "\n" + router_report(rows, labels, router_png)
        text += "\n" + dense_speedup_report(args.dense_report)
        if os.path.exists(os.path.join(args.output_dir, "tst_moe_cost.md")):
            text += (
                "\nCost per step of this MoE against the dense model of the dense study, side "
                "by side: [tst_moe_cost](tst_moe_cost.md).\n"
            )
    write(os.path.join(args.output_dir, name + ".md"), text)
    write_index(args.output_dir)
    return text
