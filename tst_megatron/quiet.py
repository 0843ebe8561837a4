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
