"""Keep expected upstream warnings out of command-line output."""

import warnings

#: Expected on machines without Transformer Engine/Apex, and upstream deprecations that the
#: user cannot act on.
KNOWN_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    r"`torch.distributed.\w+` is deprecated",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated and will be removed",
)


def quiet_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` in this process (entry points call it before imports)."""
    for message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


#: What megatron-core announces at import for each optional package it lacks (Transformer
#: Engine, Apex): about ten ``UserWarning`` lines before a launch's output. The launchers refuse
#: in one line every setting that needs one of them.
MISSING_PACKAGE_NOTICES = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    r"Only transformer-engine>=1\.7\.0 supports MoE experts",
)


def quiet_missing_package_notices() -> None:
    """Ignore :data:`MISSING_PACKAGE_NOTICES` in this process (the launchers call it before
    importing megatron-core)."""
    for message in MISSING_PACKAGE_NOTICES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
