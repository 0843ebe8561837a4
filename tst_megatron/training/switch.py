"""The switch at iteration ``N1``: the Megatron-LM intervals set to ``N1`` for that iteration
only, so that ``train()`` saves, validates and logs the switch with its own code, and the
validation samples that extra round needs (``docs/launcher.md``, "The switch")."""

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
    """Megatron-LM's own conditions for a validation at ``iteration`` other than its interval
    (``train()``: ``--eval-iters`` > 0, ``--start-eval-at-iter``; ``do_valid`` is checked by
    the caller once the data loaders exist)."""
    start = getattr(args, "start_eval_at_iter", None)
    return _eval_iters(args) > 0 and (start is None or iteration >= start)


def divides(interval, iteration: int) -> bool:
    return bool(interval) and iteration % interval == 0


def switch_overrides(args, n1: int) -> dict:
    """The Megatron-LM intervals to set to ``N1`` for iteration ``N1`` only, so that
    ``train()`` saves, validates and logs the switch with its own code.

    ``save_interval`` when ``--save`` is given, ``--no-tst-save-at-switch`` is not, and
    ``--save-interval`` does not divide ``N1``; ``eval_interval`` when validation is on
    (``args.do_valid``, ``--eval-iters`` > 0, ``N1 >= --start-eval-at-iter``) and
    ``--eval-interval`` does not divide ``N1``; ``log_interval`` when ``--log-interval``
    does not divide ``N1`` (so no ``training_log`` average spans both phases). Empty when
    the switch is not inside the run (``N1`` = 0, ``N1 >= --train-iters``, ``--skip-train``).

    Returns:
        ``{args attribute: N1}`` (each key one of ``save_interval``, ``eval_interval``,
        ``log_interval``).
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
    """Validation samples the round at the switch adds to Megatron-LM's count
    (``get_train_valid_test_num_samples``: ``(train_iters // eval_interval + 1)`` rounds of
    ``--eval-iters`` global batches): one round when :func:`switch_overrides` will add a
    validation at ``N1``, else 0. Read before the data loaders exist (``do_valid`` unknown)."""
    if getattr(args, "full_validation", False):
        return 0  # every round reads the whole set from its start
    n1 = schedule(args).n1
    if not _switch_in_run(args, n1) or not _validates_at(args, n1):
        return 0
    if divides(args.eval_interval, n1):
        return 0
    batch = getattr(args, "eval_global_batch_size", None) or args.global_batch_size
    return _eval_iters(args) * batch
