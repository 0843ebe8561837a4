"""Run megatron-core on a CPU with gloo: the one place its CUDA assumptions are redirected.

This is for laptops, CI and debugging; GPU runs never call :func:`enable`. The redirections
(``docs/design.md``, "megatron-core on the CPU", lists the assumptions) are scoped to megatron-core's own
modules: nothing in ``torch`` itself is changed, so project code and user code see the
real ``torch.cuda``.

How:
1. Every loaded ``megatron.core`` module whose global ``torch`` is the real torch gets a
   stand-in module (:class:`~tst_megatron.runtime.cpu_torch._CpuTorch`) as its ``torch`` global. It forwards every
   attribute to torch, except that (a) tensor factories (``torch.zeros(..., device='cuda')``
   and friends) map a CUDA device to the CPU, and (b) ``torch.cuda`` becomes
   :class:`~tst_megatron.runtime.cpu_torch._CpuCuda`: ``current_device()`` is the CPU, streams and events are no-ops that
   keep ordering trivially (the CPU is synchronous), the "CUDA" RNG state is the CPU
   generator's.
2. Functions whose bodies check CUDA tensor types or move split sizes off a GPU are
   replaced in their modules' namespaces by CPU versions (``_REPLACED`` lists them).
3. Upstream bug: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine
   (NameError in the first MoE router forward); it is defined as ``None``.
4. The tracker's "CPU RNG state changed within GPU RNG context" warning is filtered: on
   a CPU the tracked "CUDA" state *is* the CPU state, so the warning would fire on every
   dropout.
5. With ``enable(training=True)`` (Megatron-LM's loop, ``megatron.training``) the same stand-in is given to the ``megatron.training`` modules a
   CPU ``pretrain()`` reaches (``_TRAINING_MODULES``), with three differences, each for one
   call site: ``initialize.py`` sees a CUDA that is "available" with one device (it asserts
   ``torch.cuda.is_available()`` and initialises model parallelism and the model-parallel
   RNG only when ``device_count() > 0``); ``torch.cuda.get_device_properties`` /
   ``get_device_capability`` answer a compute capability of 0.0 (``validate_args`` asks
   for it when TP or CP > 1); and a model chunk is kept on the CPU by
   :func:`keep_on_cpu` (``get_model`` calls ``model_module.cuda(...)``), its parameters'
   ``type()`` naming the CUDA type (the distributed optimizer checks it).
6. The stand-in's ``torch.utils.data.DataLoader`` (Megatron-LM's
   ``build_pretraining_data_loader`` builds its loaders with it) gives each loader a
   generator of its own (:class:`~tst_megatron.runtime.cpu_torch._OwnSeedDataLoader`): otherwise ``iter(loader)`` draws from
   torch's global CPU generator, which on a CPU is also dropout's, after a resume has
   restored it, and a resumed run with dropout would not continue bitwise.
7. The all-to-all overlap's schedule (``--overlap-moe-expert-parallel-comm``: megatron-core's
   combined 1F1B, ``_MODULES``' schedule-plan modules): its streams are :class:`~tst_megatron.runtime.cpu_torch._Stream`, a
   ``torch.Stream`` of the CPU; ``tensor.record_stream`` on a CPU tensor does nothing (a CPU
   kernel registered for ``aten::record_stream``, :func:`_record_stream_on_cpu`); and its
   nodes keep their inputs instead of freeing them (``_should_free_input``).

:func:`enable` is idempotent and may be called before or after ``torch.distributed`` is
initialised; :func:`is_enabled` tells whether it ran.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from tst_megatron.runtime.cpu_torch import _CPU_TORCH, _CPU_TORCH_INIT

#: megatron-core releases whose CUDA assumptions this module handles: the range the package
#: declares in pyproject.toml. Both ends run the whole test suite in CI (``.ci/run``).
SUPPORTED_MEGATRON_CORE = ">=0.19,<0.20"

#: megatron-core modules imported (so that they are redirected) by :func:`enable`.
_MODULES = (
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.data",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.param_and_grad_buffer",
    # the all-to-all overlap's schedule (--overlap-moe-expert-parallel-comm): its streams and
    # events
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.pipeline_parallel.combined_1f1b",
    "megatron.core.models.common.model_chunk_schedule_plan",
    "megatron.core.models.common.utils",
    "megatron.core.models.gpt.fine_grained_callables",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing.strategies.torch",
    # Imported lazily by the torch_dist strategy: the
    # checkpoint writer calls torch.cuda.synchronize() and creates CUDA tensors.
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.exchange_utils",
)

#: megatron.training modules that a CPU ``pretrain()`` reaches, redirected by
#: ``enable(training=True)``. ``megatron.training.initialize`` gets :data:`_CPU_TORCH_INIT`.
_TRAINING_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.arguments",
    "megatron.training.global_vars",
    "megatron.training.async_utils",
    "megatron.training.inprocess_restart",
    "megatron.training.utils.common_utils",
    "megatron.training.utils.utils",
)

_enabled = False


# --- CPU versions of functions whose bodies assume CUDA tensors ---------------------------


def _get_rng_state(device="cuda", clone=False, graph_safe=False):
    """CPU stand-in for ``tensor_parallel.random._get_cuda_rng_state``."""
    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    """CPU stand-in for ``tensor_parallel.random._set_cuda_rng_state``."""
    torch.set_rng_state(new_state)


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU version of ``optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (same maths:
    scale fp32 grads in place by ``max_norm / (total_norm + 1e-6)`` when that is < 1)."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = []
    for param in parameters:
        grad = getattr(param, attr, None)
        if grad is not None:
            if grad.dtype != torch.float32 and not use_decoupled_grad:
                raise TypeError(f"expected fp32 gradients, got {grad.dtype}")
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
    """CPU version of ``moe_utils.maybe_move_tensor_to_cpu``: tensors are on the host
    already, but the alltoall dispatcher still needs its split sizes as numpy arrays."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().numpy()
    return tensor


def _should_free_input(name, is_moe, config, num_local_experts):
    """CPU stand-in for the all-to-all overlap's ``should_free_input``
    (``models/common/utils.py``): never. On a GPU a node frees its inputs after
    ``record_stream`` on its CUDA stream; a CPU tensor has no stream to record (and keeping
    the inputs changes no number)."""
    return False


_REPLACED = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _get_rng_state),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_rng_state),
    (
        "megatron.core.optimizer.clip_grads",
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32,
    ),
    (
        "megatron.core.optimizer.optimizer",
        "clip_grad_by_total_norm_fp32",
        _clip_grad_by_total_norm_fp32,
    ),
    (
        "megatron.core.transformer.moe.token_dispatcher",
        "maybe_move_tensor_to_cpu",
        _maybe_move_tensor_to_cpu,
    ),
    ("megatron.core.models.common.utils", "should_free_input", _should_free_input),
)


class _RngWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def check_version() -> str:
    """Return the installed megatron-core version.

    Raises:
        RuntimeError: it is outside :data:`SUPPORTED_MEGATRON_CORE`.
    """
    # megatron-core: heavy, imported when used
    import megatron.core

    version = getattr(megatron.core, "__version__", "unknown")
    try:
        supported = Version(version) in SpecifierSet(SUPPORTED_MEGATRON_CORE, prereleases=True)
    except InvalidVersion:
        supported = False
    if not supported:
        raise RuntimeError(
            f"tst_megatron CPU mode supports megatron-core{SUPPORTED_MEGATRON_CORE} but "
            f"megatron-core {version} is installed; install 'megatron-core{SUPPORTED_MEGATRON_CORE}'"
            " or run on a GPU"
        )
    return version


_training_enabled = False


def _redirect_loaded_modules() -> int:
    prefixes = ("megatron.core", "megatron.training") if _training_enabled else ("megatron.core",)
    count = 0
    for name, module in list(sys.modules.items()):
        if name.startswith(prefixes) and getattr(module, "torch", None) is torch:
            is_init = name == "megatron.training.initialize"
            module.torch = _CPU_TORCH_INIT if is_init else _CPU_TORCH
            count += 1
    return count


def keep_on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` whose ``.cuda(...)`` leaves it where it is: Megatron-LM's ``get_model``
    calls ``model_module.cuda(torch.cuda.current_device())`` on what the model provider
    returns; and whose parameters' ``type()`` names the CUDA type (megatron-core 0.19's
    ``DistributedOptimizer`` accepts only ``torch.cuda.*Tensor`` parameters). Only these
    objects are changed (instance attributes); returns ``module``."""

    def cuda(device=None):
        return module

    module.cuda = cuda
    for param in module.parameters():
        param.type = _cuda_type_name(param)
    return module


def _cuda_type_name(tensor: torch.Tensor):
    """``tensor.type`` whose no-argument call answers the CUDA type name
    (``torch.cuda.FloatTensor``): megatron-core's optimizers sort parameters by that string."""
    real = torch.Tensor.type

    def type_(dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            return real(tensor).replace("torch.", "torch.cuda.", 1)
        return real(tensor, dtype, non_blocking, **kwargs)

    return type_


def enable(*, training: bool = False) -> None:
    """Redirect megatron-core's CUDA assumptions to the CPU (idempotent).

    Safe to call twice, and before or after ``torch.distributed.init_process_group``.
    Modules of megatron-core imported *after* this call are not redirected unless they
    are in ``_MODULES``; call :func:`enable` again after importing others (it is cheap).

    Args:
        training: also redirect Megatron-LM's training loop (``megatron.training``;
            ``_TRAINING_MODULES`` and every loaded
            ``megatron.training`` module), for ``megatron.training.pretrain()`` on a CPU.

    Raises:
        RuntimeError: the installed megatron-core is outside :data:`SUPPORTED_MEGATRON_CORE`.
        ModuleNotFoundError: ``training=True`` and megatron-core ships no ``megatron.training``.
    """
    global _enabled, _training_enabled
    check_version()
    for name in _MODULES:
        importlib.import_module(name)
    if training:
        for name in _TRAINING_MODULES:
            importlib.import_module(name)
        _training_enabled = True
    _redirect_loaded_modules()
    if _enabled:
        return
    for module_name, attr, replacement in _REPLACED:
        setattr(sys.modules[module_name], attr, replacement)
    moe_utils = sys.modules["megatron.core.transformer.moe.moe_utils"]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_RngWarningFilter())
    _record_stream_on_cpu()
    _enabled = True


_LIBRARIES: list = []  # torch.library registrations live as long as their Library object


def _record_stream_on_cpu() -> None:
    """``Tensor.record_stream`` on a CPU tensor does nothing (torch has no CPU kernel for it):
    the all-to-all overlap's schedule records its tensors on its streams before it frees
    them, and a CPU has one synchronous stream. Registered once per process, for CPU tensors
    only."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("record_stream", lambda tensor, stream: None, "CPU")
    _LIBRARIES.append(library)


def is_enabled() -> bool:
    """Whether :func:`enable` has run in this process."""
    return _enabled


def fork_checkpoint_results_queue() -> None:
    """Make megatron-core's torch_dist write-results queue now by ``fork``, as Megatron-LM's
    persistent checkpoint worker does (``megatron.training.async_utils``), for a CPU run: at the
    first save its default ``spawn`` re-imports torch and megatron-core (about 8 s on 2 cores).
    Idempotent."""
    # megatron-core: heavy, imported when used
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        get_write_results_queue,
    )

    get_write_results_queue(mp_mode="fork")
