"""Where the process runs: torch.distributed + megatron-core parallel state + seeds
(:mod:`.distributed`; torchrun's or Slurm's environment, :mod:`.slurm`), the CPU/gloo
redirection of megatron-core's CUDA assumptions (:mod:`.cpu`) and what a CPU run adds to and
refuses in a command line (:mod:`.cpu_settings`), a sequence-parallel-capable norm for the
local layer spec (:mod:`.norm`), Transformer Engine's FP8 shape rules (:mod:`.fp8`), and what
a dry run answers for a cluster's GPU and TE (:mod:`.assumed`).
"""

from tst_megatron.runtime.distributed import (
    ParallelConfig,
    ProcessInfo,
    destroy,
    init_distributed,
    initialize_model_parallel,
    report_error,
    resolve_process,
    set_seed,
)
from tst_megatron.runtime.norm import SequenceParallelNorm

__all__ = [
    "ParallelConfig",
    "ProcessInfo",
    "SequenceParallelNorm",
    "destroy",
    "init_distributed",
    "initialize_model_parallel",
    "report_error",
    "resolve_process",
    "set_seed",
]
