"""Settings Megatron-LM 0.19 accepts but cannot run (its ``pretrain()`` would stop with a
traceback after set-up), and the Megatron-LM flags this launcher refuses, found before any
work: each function reads only and returns one line per problem naming the flag (empty: none).
"""

from __future__ import annotations

from tst_megatron.training.flags import REFUSED_FLAGS


def late_megatron_problems(args) -> list[str]:
    """Settings ``validate_args`` accepts but ``pretrain()`` refuses only after building the
    model: no ``--train-iters``/``--train-samples`` or ``--lr`` (the scheduler raises);
    ``--lr-decay-style WSD`` without its decay length;
    no ``--eval-interval`` (a ``TypeError`` sizing the validation set); ``--full-validation``
    with one validation set (a ``TypeError`` in ``evaluate()``, Megatron-LM 0.19.2);
    ``--wandb-project`` without ``--wandb-exp-name``."""
    problems = []
    if getattr(args, "wandb_project", None) and not getattr(args, "wandb_exp_name", None):
        problems.append("--wandb-project needs --wandb-exp-name (Megatron-LM raises without)")
    if not args.skip_train:
        if not (args.train_iters or args.train_samples):
            problems.append(
                "give --train-iters or --train-samples (Megatron-LM's scheduler stops without "
                "either after building the model)"
            )
        if args.lr is None:
            problems.append("--lr is required (Megatron-LM's scheduler has no default)")
    if args.full_validation and not getattr(args, "multiple_validation_sets", False):
        problems.append(
            "--full-validation stops Megatron-LM 0.19 at its first evaluation with one "
            "validation set (a TypeError in evaluate()); size --eval-iters to the validation "
            "split instead"
        )
    elif args.eval_interval is None and not args.skip_train:
        problems.append(
            "--eval-interval is required (Megatron-LM 0.19 has no default and would stop with "
            "a TypeError while sizing the validation set)"
        )
    if args.lr_decay_style == "WSD":
        flag, value = (
            ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters)
            if args.train_iters
            else ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples)
        )
        if value is None:
            problems.append(
                f"--lr-decay-style WSD needs {flag} (the length of the decay; Megatron-LM's "
                "scheduler has no default and would stop after building the model)"
            )
    return problems


def refused_flag_problems(args) -> list[str]:
    """Each Megatron-LM flag set in ``args`` that the launcher refuses
    (:data:`~tst_megatron.training.flags.REFUSED_FLAGS`), with why."""
    return [
        f"--{flag.replace('_', '-')} is not supported by this launcher: {why}"
        for flag, why in REFUSED_FLAGS.items()
        if getattr(args, flag, False)
    ]


def problems(launch) -> list[str]:
    """The Megatron-LM rules of a :class:`~tst_megatron.training.checks.Launch`."""
    return late_megatron_problems(launch.args) + refused_flag_problems(launch.args)


def notes(launch) -> list[str]:
    """``--finetune`` without ``--load`` or ``--pretrained-checkpoint``: Megatron-LM 0.19 starts
    from fresh weights at iteration 0 without a word, as if the flag were not given."""
    args = launch.args
    if getattr(args, "finetune", False) and not (args.load or args.pretrained_checkpoint):
        return [
            "--finetune without --load (or --pretrained-checkpoint): there is no checkpoint to "
            "start from, so the run starts from fresh weights, as Megatron-LM does"
        ]
    return []
