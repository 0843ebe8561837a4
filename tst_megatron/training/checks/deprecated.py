"""Flags Megatron-LM 0.19.2 still parses but no longer runs as written, found before any work.
Each is listed in ``docs/launcher.md`` with what this launcher does with it:

- :data:`STOPS`: ``validate_args`` prints a line and calls ``exit()`` (status 0, nothing
  trained, no error): refused before parsing (:func:`stop_problems`).
- ignored (:func:`problems`, :func:`notes`): accepted, then dropped. Refused in one line naming
  the replacement where the run would differ from what the line asks for
  (``--rampup-batch-size``: megatron-core 0.19's ``init_num_microbatches_calculator`` only logs
  a warning and trains at ``--global-batch-size`` from the first step); a ``note:`` where it
  would not (:data:`IGNORED_NOTED`).
- :data:`TRANSLATED`: old spellings Megatron-LM maps to their replacement (the run is the one
  asked for): a ``note:`` naming the new spelling, printed by the launch as by the dry run
  (Megatron-LM's own warning is muted in a dry run, and a ``logging`` warning of megatron-core
  reaches no one).

Presence is read from the command line as given (``Launch.argv``, ``Launch.given``): ``validate_args`` deletes
or rewrites most of these attributes.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from tst_megatron.training.argv import flag_values

#: ``{flag: what to use instead}`` for flags on which ``validate_args`` prints a line and
#: calls ``exit()`` (a "successful" run that trained nothing).
STOPS = {
    "--checkpoint-activations": "--recompute-activations (or --recompute-granularity and "
    "--recompute-method)",
}

#: ``{flag: why the run is the one asked for}``: accepted and ignored by Megatron-LM 0.19.2
#: without changing the run (a ``note:``); the cases where they would change it are refused
#: by :func:`problems`.
IGNORED_NOTED = {
    "--use-mcore-models": "megatron-core's models are the only ones",
    "--disable-msc": "MSC (multi-storage client) is off unless --enable-msc",
    "--ckpt-fully-parallel-save": "fully parallel saving is the default "
    "(--no-ckpt-fully-parallel-save turns it off)",
    "--use-dist-ckpt": "the checkpoint format is --ckpt-format's",
    "--dist-ckpt-format": "the checkpoint format is --ckpt-format's",
    "--fp8-interval": "Transformer Engine 1.8 and later recompute the FP8 scaling factors "
    "every step, which --fp8-interval 1 asks for",
    **{
        f"--{no}-tp-comm-split-{kind}": f"it matters only with --tp-comm-overlap, where "
        f"megatron-core reads --no-tp-comm-overlap-{kind} instead"
        for no in ("no", "disable")
        for kind in ("ag", "rs")
    },
}

#: ``{flag: the spelling Megatron-LM 0.19.2 translates it to}`` (the run is the one asked for).
TRANSLATED = {
    "--enable-cuda-graph": "--cuda-graph-impl local",
    "--external-cuda-graph": "--cuda-graph-impl transformer_engine",
    "--cuda-graph-scope": "--cuda-graph-modules",
    "--use-rotary-position-embeddings": "--position-embedding-type rope",
    "--no-weight-decay-cond-type": "--apply-wd-to-qk-layernorm",
    "--moe-layer-recompute": "--recompute-granularity selective --recompute-modules moe",
    "--moe-enable-deepep": "--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep",
    "--moe-deepep-num-sms": "--moe-flex-dispatcher-num-sms",
    "--moe-hybridep-num-sms": "--moe-flex-dispatcher-num-sms",
    "--optimizer dist_muon": "--optimizer muon --use-distributed-optimizer",
    # pretrain_hybrid.py's (the GPT launcher refuses every hybrid flag before this)
    "--hybrid-override-pattern": "--hybrid-layer-pattern",
    "--mtp-hybrid-override-pattern": "the MTP part of --hybrid-layer-pattern (main/mtp/mtp..., "
    "one '/' part per --mtp-num-layers; without --mtp-num-layers it is ignored)",
}

#: The most steps :func:`rampup_schedule` spells out in an error line.
MAX_SPELLED_STEPS = 16


def stop_problems(flags: Sequence[str]) -> list[str]:
    """One line for each flag of :data:`STOPS` in ``flags`` (the command line's ``--`` words)."""
    return [
        f"{flag} is no longer valid in Megatron-LM 0.19 (its argument validation prints this "
        f"and exits with status 0, training nothing): use {instead}"
        for flag, instead in STOPS.items()
        if flag in flags
    ]


def rampup_schedule(rampup: Sequence, global_batch: int, seq_length: int) -> Optional[str]:
    """The ``--step-batch-size-schedule`` (thresholds in tokens, as Megatron-LM reads them with
    ``--seq-length``) that steps as ``--rampup-batch-size start increment samples`` did before
    Megatron-LM 0.19: after ``c`` consumed samples the global batch was ``start + floor(c /
    (samples / k)) * increment`` up to ``global_batch``, ``k = (global_batch - start) /
    increment`` (Megatron-LM 0.13's ``RampupBatchsizeNumMicroBatchesCalculator``), so step
    ``j`` starts at sample ``ceil(j * samples / k)``.

    Returns:
        ``"0:start T1:B1 ..."``, or None when the ramp is not one the old calculator accepted
        (``global_batch - start`` not a non-negative multiple of a positive increment).
    """
    start, increment, samples = (int(x) for x in rampup)
    diff = global_batch - start
    if increment <= 0 or diff < 0 or diff % increment:
        return None
    k = diff // increment
    steps = [f"0:{start if k else global_batch}"]
    steps += [
        f"{math.ceil(j * samples / k) * seq_length}:{start + j * increment}"
        for j in range(1, k + 1)
    ]
    return " ".join(steps)


def _rampup_problem(args) -> str:
    """The refusal of ``--rampup-batch-size``, with the schedule that replaces it."""
    start, increment, samples = (int(x) for x in args.rampup_batch_size)
    line = (
        f"--rampup-batch-size is ignored by Megatron-LM 0.19 (deprecated; the run would train "
        f"at --global-batch-size {args.global_batch_size} from the first step): give the ramp "
        f"as --step-batch-size-schedule in place of --global-batch-size"
    )
    schedule = rampup_schedule(args.rampup_batch_size, args.global_batch_size, args.seq_length)
    if schedule is None:
        return line
    steps = schedule.split()
    if len(steps) <= MAX_SPELLED_STEPS:
        return f"{line}, here '{schedule}' (thresholds in tokens)"
    return (
        f"{line}, here {len(steps)} steps from '{steps[0]}' to '{steps[-1]}' (thresholds in "
        f"tokens: step j at ceil(j x {samples} / {len(steps) - 1}) samples x --seq-length "
        f"{args.seq_length}, batch {start} + j x {increment})"
    )


def _refusals(launch) -> dict[str, str]:
    """``{flag: its error line}`` of the ignored flags that would change the run."""
    args, flags = launch.args, set(launch.given)
    found = {}
    if getattr(args, "rampup_batch_size", None):
        found["--rampup-batch-size"] = _rampup_problem(args)
    if "--fp8-interval" in flags and getattr(args, "fp8_interval", 1) != 1:
        found["--fp8-interval"] = (
            f"--fp8-interval {args.fp8_interval} is ignored by Transformer Engine 1.8 and "
            "later (megatron-core 0.19 only warns): the FP8 scaling factors are recomputed "
            "every step; drop the flag"
        )
    if "--use-dist-ckpt" in flags and args.ckpt_format == "torch":
        found["--use-dist-ckpt"] = (
            "--use-dist-ckpt has no effect in Megatron-LM 0.19 and this line saves "
            "--ckpt-format torch: give --ckpt-format torch_dist for a distributed checkpoint"
        )
    value = flag_values(launch.argv, "--dist-ckpt-format").dist_ckpt_format
    if value is not None and value != args.ckpt_format:
        found["--dist-ckpt-format"] = (
            f"--dist-ckpt-format {value} has no effect in Megatron-LM 0.19 (this line saves "
            f"--ckpt-format {args.ckpt_format}): give the format as --ckpt-format"
        )
    if "--ckpt-fully-parallel-save" in flags and not args.ckpt_fully_parallel_save:
        found["--ckpt-fully-parallel-save"] = (
            "--ckpt-fully-parallel-save has no effect in Megatron-LM 0.19 and this line also "
            "gives --no-ckpt-fully-parallel-save: keep one (parallel saving is the default)"
        )
    if getattr(args, "tp_comm_overlap", False):
        for flag in flags:
            if flag.startswith(("--no-tp-comm-split-", "--disable-tp-comm-split-")):
                kind = flag.rsplit("-", 1)[1]
                found[flag] = (
                    f"{flag} is ignored by megatron-core 0.19 with Transformer Engine 1.5 and "
                    f"later: give --no-tp-comm-overlap-{kind}"
                )
    return found


def problems(launch) -> list[str]:
    """The ignored flags that would change the run, one line each: ``--rampup-batch-size``;
    ``--fp8-interval`` other than 1; ``--use-dist-ckpt`` with ``--ckpt-format torch``;
    ``--dist-ckpt-format`` other than ``--ckpt-format``; ``--ckpt-fully-parallel-save`` with
    ``--no-ckpt-fully-parallel-save``; ``--no-tp-comm-split-ag``/``-rs`` with
    ``--tp-comm-overlap`` (megatron-core 0.19's ``TELinear`` reads
    ``--no-tp-comm-overlap-ag``/``-rs`` with Transformer Engine 1.5 and later)."""
    return list(_refusals(launch).values())


def notes(launch) -> list[str]:
    """A ``note:`` for each flag of :data:`IGNORED_NOTED` or :data:`TRANSLATED` on the command
    line that :func:`problems` does not refuse."""
    flags, refused = set(launch.given), _refusals(launch)
    found = [
        f"{flag} is deprecated and ignored by Megatron-LM 0.19: {why}"
        for flag, why in IGNORED_NOTED.items()
        if flag in flags and flag not in refused
    ]
    optimizer = flag_values(launch.argv, "--optimizer").optimizer
    for old, new in TRANSLATED.items():
        flag, _, value = old.partition(" ")
        if flag in flags and (not value or value == optimizer):
            found.append(f"{old} is deprecated: Megatron-LM 0.19 runs it as {new}")
    return found
