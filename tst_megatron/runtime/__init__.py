"""Where the process runs: torch.distributed + megatron-core parallel state + seeds
(:mod:`.distributed`; torchrun's or Slurm's environment, :mod:`.slurm`) and the CPU/gloo
redirection of megatron-core's CUDA assumptions (:mod:`.cpu`). The launcher starts its
processes through Megatron-LM's ``pretrain()``; :func:`init_distributed` and
:class:`ParallelConfig` start them for the tools, benchmarks and tests that run megatron-core
without Megatron-LM's loop.
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

__all__ = [
    "ParallelConfig",
    "ProcessInfo",
    "destroy",
    "init_distributed",
    "initialize_model_parallel",
    "report_error",
    "resolve_process",
    "set_seed",
]
