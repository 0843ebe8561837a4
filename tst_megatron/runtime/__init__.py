"""Where the process runs: torch.distributed + megatron-core parallel state + seeds
(:mod:`.distributed`; torchrun's or Slurm's environment, :mod:`.slurm`), the CPU/gloo
redirection of megatron-core's CUDA assumptions (:mod:`.cpu`), and a
sequence-parallel-capable norm for the local layer spec (:mod:`.norm`).
"""

from tst_megatron.runtime.distributed import (
    ParallelConfig,
    ProcessInfo,
    describe_layout,
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
    "describe_layout",
    "destroy",
    "init_distributed",
    "initialize_model_parallel",
    "report_error",
    "resolve_process",
    "set_seed",
]
