"""The switch at iteration ``N1``: Megatron-LM intervals set to ``N1`` for that iteration so
``train()`` saves, validates and logs it (``docs/launcher.md``, "The switch")."""

from __future__ import annotations

from tst_megatron.training.flags import tst_config
from tst_megatron.training.plan import schedule, train_iters


def _eval_iters(args) -> int:
    """``--eval-iters`` summed over the validation sets (Megatron-LM allows a list)."""
    iters = getattr(args, "eval_iters", 0) or 0
    return sum(iters) if isinstance(iters, (list, tuple)) else iters


def _switch_in_run(args, n1: int) -> bool:
    """The run trains and switches inside it: ``0 < N1 < --train-iters``."""
    return not getattr(args, "skip_train", False) and 0 < n1 < train_iters(args)


def _validates_at(args, iteration: int) -> bool:
    """Megatron-LM ``train()``'s conditions for validating at ``iteration``, besides the
    interval and ``do_valid``."""
    start = getattr(args, "start_eval_at_iter", None)
    return _eval_iters(args) > 0 and (start is None or iteration >= start)


def divides(interval, iteration: int) -> bool:
    """Whether ``interval`` is set and divides ``iteration``."""
    return bool(interval) and iteration % interval == 0


def switch_overrides(args, n1: int) -> dict:
    """The Megatron-LM intervals to set to ``N1`` for iteration ``N1`` only: each of
    ``save_interval`` (with ``--save`` and TST's save-at-switch), ``eval_interval`` (when
    validating) and ``log_interval`` that does not already divide ``N1``.

    Returns:
        ``{args attribute: N1}``; empty when the switch is not inside the run.
    """
    if not _switch_in_run(args, n1):
        return {}
    out = {}
    if tst_config(args).save_at_switch and args.save and not divides(args.save_interval, n1):
        out["save_interval"] = n1
    valid = getattr(args, "do_valid", False) and _validates_at(args, n1)
    if valid and not divides(args.eval_interval, n1):
        out["eval_interval"] = n1
    if not divides(args.log_interval, n1):
        out["log_interval"] = n1
    return out


def switch_validation_samples(args) -> int:
    """Validation samples to add to Megatron-LM's ``get_train_valid_test_num_samples`` count:
    one round (``--eval-iters`` global batches) when :func:`switch_overrides` adds a
    validation at ``N1``, else 0."""
    if getattr(args, "full_validation", False):
        return 0  # every round reads the whole set from its start
    n1 = schedule(args).n1
    if not _switch_in_run(args, n1) or not _validates_at(args, n1):
        return 0
    if divides(args.eval_interval, n1):
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return _eval_iters(args) * batch
